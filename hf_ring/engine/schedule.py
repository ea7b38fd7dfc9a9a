"""Who sends which K/V rows to whom, and which blocks each rank computes with them.

Pure index math, the same on every rank, so senders and receivers agree on
every message without asking each other. At step ``s`` rank ``r`` receives from
``r - s`` exactly the rows its blocks need and sends ``r + s`` what that rank
needs. Dense attention is the one-branch pattern ``(N, 1)``: the shards travel
whole (or the half a causal zigzag rank can use). A dilated branch moves only its
dilated rows, only between ranks that share a segment, and a row that several
branches read travels once; an empty step is skipped.

With documents packed into the rows, only tiles whose query and key rows
share a document are kept, and only the key rows those tiles read travel.
Bidirectional spans add blocks of kind ``"span"`` over each span's rows for
the pairs causality leaves out (:mod:`hf_ring.engine.spans`), and the keys they read travel too.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

from .blocks import Progression, classify, default_tile, tiles
from .documents import Documents, key_span, reach
from .layout import local_runs, runs_to_local
from .pattern import Branches, head_groups
from .spans import Spans, extra_pairs_possible, merged, touching

SPAN_TILE = 1024
"""Most rows per side of a span's extra blocks: each carries a mask built from positions."""


@dataclass(frozen=True)
class Piece:
    """K/V heads ``heads`` at rows ``rows`` of the source rank, one slab of a message.

    ``within``: the index of another piece of the same message whose heads and
    rows include these ones. Such a piece is not sent: it is a strided view of
    that one (the offset-0 rows of dilation rate 4 are among those of rate 2).
    """

    heads: range
    rows: Progression
    within: Optional[int] = None


def contains(outer: Piece, inner: Piece) -> bool:
    """Every (head, row) of ``inner`` is one of ``outer``'s, at a fixed step: a strided view of it."""
    o, i = outer.rows, inner.rows
    if i.pos < o.pos or i.last_pos > o.last_pos or (i.pos - o.pos) % o.stride or i.local - o.local != i.pos - o.pos:
        return False
    if i.count > 1 and i.stride % o.stride:
        return False
    if any(h not in outer.heads for h in inner.heads):
        return False
    return len(inner.heads) == 1 or inner.heads.step % outer.heads.step == 0


def view_within(outer: Piece, inner: Piece) -> Tuple[slice, slice]:
    """The head and item slices of ``outer``'s ``(B, heads, items, D)`` slab that hold ``inner``."""
    h0 = outer.heads.index(inner.heads[0])
    hs = inner.heads.step // outer.heads.step if len(inner.heads) > 1 else 1
    i0 = (inner.rows.pos - outer.rows.pos) // outer.rows.stride
    st = inner.rows.stride // outer.rows.stride if inner.rows.count > 1 else 1
    return (slice(h0, h0 + (len(inner.heads) - 1) * hs + 1, hs),
            slice(i0, i0 + (inner.rows.count - 1) * st + 1, st))


def sent(pieces) -> List[Piece]:
    """The pieces that travel (those that are no view of another)."""
    return [p for p in pieces if p.within is None]


def _share_rows(pieces: List[Piece]) -> List[Piece]:
    """Mark each piece that another (larger, sent) piece includes: its rows travel once, in that one."""
    order = sorted(range(len(pieces)), key=lambda i: -len(pieces[i].heads) * pieces[i].rows.count)
    out = list(pieces)
    kept: List[int] = []
    for i in order:
        parent = next((j for j in kept if contains(pieces[j], pieces[i])), None)
        if parent is None:
            kept.append(i)
        else:
            out[i] = Piece(pieces[i].heads, pieces[i].rows, parent)
    return out


@dataclass(frozen=True)
class Block:
    """Local query rows ``q`` (heads ``q_heads``) against items ``[k_off, k_off+nk)`` of piece ``piece``.

    The keys sit at positions ``k_pos + j·q.stride``.
    """

    q: Progression
    q_heads: range
    piece: int
    k_off: int
    nk: int
    k_pos: int
    kind: str


@dataclass(frozen=True)
class PairPlan:
    pieces: Tuple[Piece, ...]
    blocks: Tuple[Block, ...]


@dataclass(frozen=True)
class Step:
    shift: int
    src: int  # this step's K/V come from here
    dst: int  # and this rank's K/V go there
    recv: PairPlan
    send: Tuple[Piece, ...]


@dataclass(frozen=True)
class Geometry:
    """What a rank's plan depends on, the same on every rank: the sequence, the ring and the attention's shape.

    ``tile``: most rows per side of a block (None is :func:`default_tile`:
    whole blocks, cut only along a window); ``documents``: global start rows
    of the documents in each batch row, which drops tiles whose rows share no
    document (it needs the one dense branch, since dilation inside documents
    is counted from each document's start, not from row 0); ``head_base``:
    the global index of local query head 0 (head and tensor parallelism hand
    a rank a slice of the heads; a head's dilation offset is its global index
    mod the rate, so each branch reads the rows it reads in one process);
    ``spans``: bidirectional runs of rows per batch row (the one dense branch, like documents).
    """

    seq_len: int
    world_size: int
    layout: str
    causal: bool
    window: Optional[int]
    branches: Branches
    hq: int
    hkv: int
    tile: Optional[int] = None
    documents: Optional[Documents] = None
    head_base: int = 0
    spans: Optional[Spans] = None


@dataclass(frozen=True)
class RankPlan:
    rank: int
    world_size: int
    seq_len: int
    steps: Tuple[Step, ...]


def _class_prog(run: Tuple[int, int, int], seg_lo: int, seg_hi: int, offset: int, rate: int) -> Optional[Progression]:
    """Rows of one run inside segment ``[seg_lo, seg_hi)`` whose in-segment index is ``offset`` mod ``rate``."""
    local, start, length = run
    lo, hi = max(start, seg_lo), min(start + length, seg_hi)
    first = seg_lo + offset
    if lo > first:
        first += -(-(lo - first) // rate) * rate
    if first >= hi:
        return None
    count = len(range(first, hi, rate))
    return Progression(local + first - start, first, count, rate)


def _segments(runs, wt: int) -> List[int]:
    segs = set()
    for _, start, length in runs:
        segs.update(range(start // wt, (start + length - 1) // wt + 1))
    return sorted(segs)


def _document_tiles(q_progs: List[Progression], kp: Progression, tile: int, documents: Documents, seq_len: int,
                    causal: bool,
                    window: Optional[int]) -> List[Tuple[Progression, Tuple[Progression, Progression, str]]]:
    """Tiles whose rows share a document, each cut to the key rows its queries may see there.

    Each query tile is paired only with keys of the documents it touches, so
    planning costs about ``n/tile · (longest/tile + 2)`` tiles, not ``(n/tile)²``.
    """
    kept = []
    for qp in q_progs:
        for first in range(0, qp.count, tile):
            q_tile = qp.sub(first, min(tile, qp.count - first))
            lo, hi = reach(documents, seq_len, q_tile.pos, q_tile.last_pos)
            near = kp.clip(lo, q_tile.last_pos if causal else hi)
            if near is None:
                continue
            for qt, kt, _ in tiles(q_tile, near, causal, window, tile):
                span = key_span(documents, seq_len, qt.pos, qt.last_pos, kt.pos, kt.last_pos, causal, window)
                if span is not None:
                    kt = kt.clip(*span)
                    kept.append((qp, (qt, kt, classify(qt, kt, causal, window))))
    return kept


def _span_tiles(q_progs: List[Progression], kp: Progression, runs, window: Optional[int],
                tile: int) -> List[Tuple[Progression, Tuple[Progression, Progression, str]]]:
    """Blocks of kind ``"span"``: each span's query rows against its key rows, where they can hold a pair that
    causality (with the window) leaves out; the kernel call masks all other pairs."""
    found = []
    for start, stop in runs:
        keys = kp.clip(start, stop - 1)
        if keys is None:
            continue
        for qp in q_progs:
            rows = qp.clip(start, stop - 1)
            if rows is None:
                continue
            for qt, kt, _ in tiles(rows, keys, False, None, min(tile, SPAN_TILE)):
                if extra_pairs_possible(qt.pos, qt.last_pos, kt.pos, kt.last_pos, window):
                    found.append((qp, (qt, kt, "span")))
    return found


@lru_cache(maxsize=4096)
def pair_plan(geo: Geometry, dst: int, src: int) -> PairPlan:
    """What rank ``dst`` computes with the K/V rows of rank ``src``; blocks of at most ``geo.tile`` rows a side."""
    seq_len, world_size, layout, causal, window = geo.seq_len, geo.world_size, geo.layout, geo.causal, geo.window
    branches, documents, tile = geo.branches, geo.documents, geo.tile
    runs = merged(geo.spans) if geo.spans is not None and causal else []
    dense = len(branches) == 1 and branches[0][1] == 1 and branches[0][0] >= seq_len
    if (documents is not None or runs) and not dense:
        raise ValueError(f"a plan over documents or spans takes the one dense branch (seq_len, 1), got {branches}")
    q_runs = runs_to_local(local_runs(seq_len, dst, world_size, layout))
    k_runs = runs_to_local(local_runs(seq_len, src, world_size, layout))
    tile = default_tile(window) if tile is None else tile
    pieces: List[Piece] = []
    index: Dict[Piece, int] = {}
    blocks: List[Block] = []
    if not q_runs or not k_runs:
        return PairPlan((), ())
    for w, rate in branches:
        wt = min(w, seq_len)
        for offset in range(rate):
            groups = head_groups(geo.hq, geo.hkv, rate, (offset - geo.head_base) % rate)
            if not groups:
                continue
            for seg in _segments(q_runs, wt):
                lo, hi = seg * wt, min(seq_len, (seg + 1) * wt)
                q_progs = [p for p in (_class_prog(r, lo, hi, offset, rate) for r in q_runs) if p]
                if not q_progs:
                    continue
                q_first = min(p.pos for p in q_progs)
                q_last = max(p.last_pos for p in q_progs)
                need_lo = q_first - window + 1 if (causal and window is not None) else lo
                need_hi = q_last if causal else hi - 1
                near = touching(runs, q_first, q_last)
                if near:  # a span reads its later keys, and keys the window leaves out
                    need_lo, need_hi = min(need_lo, near[0][0]), max(need_hi, near[-1][1] - 1)
                for run in k_runs:
                    kp = _class_prog(run, lo, hi, offset, rate)
                    kp = kp.clip(need_lo, need_hi) if kp else None
                    if kp is None:
                        continue
                    if documents is None:
                        found = [(qp, t) for qp in q_progs for t in tiles(qp, kp, causal, window, tile)]
                    else:
                        found = _document_tiles(q_progs, kp, tile, documents, seq_len, causal, window)
                    found += _span_tiles(q_progs, kp, near, window, tile)
                    if found and (documents is not None or near):  # send only the key rows the blocks read
                        kp = kp.clip(min(t[1].pos for _, t in found), max(t[1].last_pos for _, t in found))
                    if not found:
                        continue
                    for q_heads, kv_heads in groups:
                        piece = Piece(kv_heads, kp)
                        if piece not in index:
                            index[piece] = len(pieces)
                            pieces.append(piece)
                        pid = index[piece]
                        for _, (qt, kt, kind) in found:
                            off = (kt.pos - kp.pos) // rate
                            blocks.append(Block(qt, q_heads, pid, off, kt.count, kt.pos, kind))
    if dst == src:  # a rank's own rows are read in place: only a transfer has rows to share
        return PairPlan(tuple(pieces), tuple(blocks))
    pieces, blocks = _cut_to_share(pieces, blocks, causal, window)
    return PairPlan(tuple(_share_rows(pieces)), tuple(blocks))


def _cut_to_share(pieces: List[Piece], blocks: List[Block], causal: bool,
                  window: Optional[int]) -> Tuple[List[Piece], List[Block]]:
    """Cut each piece where a part of it lies within another piece, so that part travels once, as a view.

    A zigzag rank's two chunks are one run of positions, so a long segment's dilated rows span both while a
    shorter segment's rows, at a rate dividing its own, lie in one: neither piece holds the other whole, and the
    rows both read would travel twice. Cut pieces are cut again until no cut is left to make.
    """
    entries = [(i, 0, p.rows.count) for i, p in enumerate(pieces)]  # (piece, first item, count)
    while True:
        made = [Piece(pieces[i].heads, pieces[i].rows.sub(first, count)) for i, first, count in entries]
        spans = [(p.rows.pos, p.rows.last_pos) for p in made]
        cut = []
        for (i, first, _), piece, (lo, hi) in zip(entries, made, spans):
            at = set()
            step = piece.rows.stride
            for other, (o_lo, o_hi) in zip(made, spans):
                if (o_hi < lo or o_lo > hi or (o_lo <= lo and o_hi >= hi)  # apart, or holding all of it
                        or step % other.rows.stride or (lo - o_lo) % other.rows.stride  # its rows are none of ours
                        or piece.heads[0] not in other.heads):
                    continue
                inside = piece.rows.clip(o_lo, o_hi)
                if inside is not None and contains(other, Piece(piece.heads, inside)):
                    at.update((inside.pos, inside.last_pos + 1))
            for part in piece.rows.split(at) if at else [piece.rows]:
                cut.append((i, first + (part.pos - piece.rows.pos) // piece.rows.stride, part.count))
        if len(cut) == len(entries):
            if len(entries) == len(pieces):  # nothing was cut: the blocks stand as planned
                return pieces, blocks
            return made, _recut(blocks, entries, causal, window)
        entries = cut


def _recut(blocks: Sequence[Block], entries: Sequence[Tuple[int, int, int]], causal: bool,
           window: Optional[int]) -> List[Block]:
    """``blocks`` over new pieces, new piece ``j`` being items ``first .. first+count-1`` of old piece ``i``
    (``entries[j] = (i, first, count)``): each block cut to the part of its keys in each and re-classified from
    positions."""
    out = []
    for blk in blocks:
        for new_id, (pid, first, count) in enumerate(entries):
            if pid != blk.piece:
                continue
            lo, hi = max(blk.k_off, first), min(blk.k_off + blk.nk, first + count)
            if lo >= hi:
                continue
            k_pos = blk.k_pos + (lo - blk.k_off) * blk.q.stride
            kind = "span" if blk.kind == "span" else classify(blk.q, Progression(0, k_pos, hi - lo, blk.q.stride),
                                                               causal, window)
            if kind is not None:
                out.append(Block(blk.q, blk.q_heads, new_id, lo - first, hi - lo, k_pos, kind))
    return out


def chunk_pair(plan: PairPlan, budget: int, causal: bool, window: Optional[int]) -> List[PairPlan]:
    """Split what one source sends into messages of at most ``budget`` rows x heads each.

    Visiting K/V, their gradients and the next message in flight are the
    ring's memory beyond a rank's own tensors; bounding each message bounds
    them, whatever the shard size. The sent pieces are cut to fill messages; a
    piece that is a view of another goes, cut alike, with each part of that
    one. Every block is cut to the part of its keys in each message and
    re-classified from positions. Sender and receiver call this with the same
    arguments, so they agree on every message.
    """
    if _size(plan) <= budget:
        return [plan]
    chunks: List[List[Tuple[int, int, int]]] = [[]]  # (piece id, first item, count) of the sent pieces
    room = budget
    for pid, piece in enumerate(plan.pieces):
        if piece.within is not None:
            continue
        width = len(piece.heads)
        start = 0
        while start < piece.rows.count:
            if room < width:
                chunks.append([])
                room = budget
            take = min(piece.rows.count - start, max(1, room // width))
            chunks[-1].append((pid, start, take))
            room -= take * width
            start += take
    out = []
    for chunk in chunks:
        pieces = [Piece(plan.pieces[pid].heads, plan.pieces[pid].rows.sub(first, count)) for pid, first, count in chunk]
        entries = list(chunk)
        for aid, alias in enumerate(plan.pieces):  # views go with the parts of their parent in this message
            if alias.within is None:
                continue
            parent = plan.pieces[alias.within]
            _, items = view_within(parent, alias)
            for new_parent, (pid, first, count) in enumerate(chunk):
                if pid != alias.within:
                    continue
                lo = max(0, -(-(first - items.start) // items.step))
                hi = min(alias.rows.count - 1, (first + count - 1 - items.start) // items.step)
                if lo <= hi:
                    pieces.append(Piece(alias.heads, alias.rows.sub(lo, hi - lo + 1), new_parent))
                    entries.append((aid, lo, hi - lo + 1))
        out.append(PairPlan(tuple(pieces), tuple(_recut(plan.blocks, entries, causal, window))))
    return out


@lru_cache(maxsize=512)
def local_causal(geo: Geometry, rank: int) -> bool:
    """Whether ``rank``'s blocks on its own K/V are, together, exactly the causal mask over its rows in local order.

    A rank's rows ascend in position, so where causality is all that masks
    (no window, no dilation, no documents), key row ``j`` is visible to query
    row ``i`` iff ``j <= i`` locally, and one causal kernel call over all its
    rows replaces the blocks: a zigzag rank's two chunks make three blocks,
    each with its own merge and accumulation, where that call makes none.
    Checked from the blocks themselves, so it holds for whatever the planner
    makes: each is causal on a square of local rows or full with every key
    before its queries, all heads in one call, and together they give each
    row its keys up to itself exactly once.
    """
    rows = sum(b - a for a, b in local_runs(geo.seq_len, rank, geo.world_size, geo.layout))
    own = pair_plan(geo, rank, rank)
    if not geo.causal or rows == 0:
        return False
    given: List[Tuple[int, int, int, Optional[int]]] = []  # per block: its query rows, first key, key end (None: row + 1)
    for blk in own.blocks:
        if blk.kind == "span":  # a span's extra pairs run beside the causal call
            continue
        piece = own.pieces[blk.piece]
        if (blk.q.stride != 1 or piece.rows.stride != 1 or piece.within is not None
                or blk.q_heads != range(geo.hq) or piece.heads != range(geo.hkv)):
            return False
        first_key = piece.rows.local + blk.k_off
        if blk.kind == "causal" and (first_key, blk.nk) == (blk.q.local, blk.q.count):
            given.append((blk.q.local, blk.q.local + blk.q.count, first_key, None))
        elif blk.kind == "full" and first_key + blk.nk - 1 <= blk.q.local:
            given.append((blk.q.local, blk.q.local + blk.q.count, first_key, first_key + blk.nk))
        else:
            return False
    # Each row's key runs must tile its keys 0..i once: a pair given twice (two branches alike) is not the triangle,
    # however the areas add up. Between block edges the runs change only in the causal ones' ends, so the first and
    # last row of each stretch stand for it: the check costs blocks x edges, not the rows.
    edges = {0, rows} | {e for q0, q1, _, _ in given for e in (q0, q1)}
    for i in sorted({e for e in edges if e < rows} | {e - 1 for e in edges if e > 0}):
        end = 0
        for start, stop in sorted((k0, i + 1 if k1 is None else k1) for q0, q1, k0, k1 in given if q0 <= i < q1):
            if start != end:
                return False
            end = stop
        if end != i + 1:
            return False
    return True


MESSAGES_PER_SHARD = 8
"""Messages a shard's K/V travel in: a rank holds about four at once (computed on, in flight, gradients both ways)."""
MIN_MESSAGE_ROWS = 256
"""Fewest rows of a step's largest message: below it each message's own round and wait cost more than it saves."""


def message_budget(seq_len: int, world_size: int, hkv: int) -> int:
    """Rows x heads per message: an eighth of a shard's K/V, but never tiny messages."""
    rows = -(-seq_len // world_size)
    return max(MIN_MESSAGE_ROWS * hkv, -(-rows * hkv // MESSAGES_PER_SHARD))


def _size(plan: PairPlan) -> int:
    """Rows x heads that travel."""
    return sum(len(p.heads) * p.rows.count for p in sent(plan.pieces))


@lru_cache(maxsize=512)
def messages_per_transfer(geo: Geometry, shift: int, budget: int) -> int:
    """How many messages every transfer of ring step ``shift`` is cut into: enough for the largest.

    All transfers of a step are cut alike, so the ranks move in lockstep: a rank that receives twice the rows
    (and computes half the queries against each) gets messages twice the size rather than twice as many,
    which would leave its peer idle for the extra rounds.
    """
    world = geo.world_size
    largest = max(_size(pair_plan(geo, r, (r - shift) % world)) for r in range(world))
    return max(1, -(-largest // budget))


@lru_cache(maxsize=512)
def rank_plan(geo: Geometry, rank: int, budget: Optional[int] = None) -> RankPlan:
    """Every step rank ``rank`` takes part in; step 0 (its own K/V) comes first.

    Each shift's transfers are cut into :func:`messages_per_transfer` messages
    of at most ``budget`` rows x heads (default :func:`message_budget`), each a
    step of its own.
    """
    world, causal, window = geo.world_size, geo.causal, geo.window
    if budget is None:
        budget = message_budget(geo.seq_len, world, geo.hkv)
    steps = [Step(0, rank, rank, pair_plan(geo, rank, rank), ())]
    for s in range(1, world):
        src, dst = (rank - s) % world, (rank + s) % world
        count = messages_per_transfer(geo, s, budget)
        recv_plan, send_plan = pair_plan(geo, rank, src), pair_plan(geo, dst, rank)
        recv = chunk_pair(recv_plan, -(-_size(recv_plan) // count), causal, window)
        send = chunk_pair(send_plan, -(-_size(send_plan) // count), causal, window)
        for i in range(max(len(recv), len(send))):
            r = recv[i] if i < len(recv) else PairPlan((), ())
            snd = send[i].pieces if i < len(send) else ()
            if r.pieces or snd:
                steps.append(Step(s, src, dst, r, snd))
    return RankPlan(rank, world, geo.seq_len, tuple(steps))
