"""Which (query rows, key rows) blocks a rank computes at each ring step.

Pure index math. A block is either ``full`` (every pair allowed), ``causal``
(the diagonal block: the same positions on both sides) or ``mask`` (anything
else, built from positions when it runs). Blocks with no allowed pair are
never produced, so future blocks and blocks outside a sliding window cost
nothing. Under a window, query runs are cut into tiles so that a mask never
grows beyond ``tile x tile``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

from .layout import local_runs, runs_to_local

LocalRun = Tuple[int, int, int]  # (local offset, global start, length)


@dataclass(frozen=True)
class Block:
    """Rows ``[q0, q0+nq)`` of the local queries against rows ``[k0, k0+nk)`` of a K/V shard."""

    q0: int
    nq: int
    k0: int
    nk: int
    q_pos: int  # global position of local query row q0
    k_pos: int  # global position of K/V row k0
    kind: str  # "full" | "causal" | "mask"


def allowed(q_pos: int, k_pos: int, causal: bool, window: Optional[int]) -> bool:
    """Whether query position ``q_pos`` may see key position ``k_pos``."""
    if not causal:
        return True
    return k_pos <= q_pos and (window is None or k_pos > q_pos - window)


def _classify(qa: int, nq: int, ka: int, nk: int, causal: bool, window: Optional[int]) -> Optional[str]:
    if nq <= 0 or nk <= 0:
        return None
    if not causal:
        return "full"
    q_last, k_last = qa + nq - 1, ka + nk - 1
    if ka > q_last:
        return None
    if window is not None and k_last <= qa - window:
        return None
    if k_last <= qa and (window is None or ka > q_last - window):
        return "full"
    if qa == ka and nq == nk and (window is None or nq <= window):
        return "causal"
    return "mask"


def _pieces(qa: int, nq: int, ka: int, nk: int, causal: bool, window: Optional[int], tile: int):
    """Split one (query run, key run) pair into classified pieces ``(qa, nq, ka, nk, kind)``."""
    if not causal or window is None:
        kind = _classify(qa, nq, ka, nk, causal, window)
        return [] if kind is None else [(qa, nq, ka, nk, kind)]
    out = []
    k_end = ka + nk
    for t0 in range(qa, qa + nq, tile):
        t1 = min(t0 + tile, qa + nq)  # query tile [t0, t1)
        # keys [t1-window, t0] are seen by every query of the tile; the bands on
        # either side are partially seen and get small masks.
        cuts = sorted([t0 - window + 1, t1 - window, t0, t1])
        edges = [max(ka, c) for c in cuts]
        edges = [min(k_end, e) for e in edges]
        for a, b in zip(edges, edges[1:]):
            kind = _classify(t0, t1 - t0, a, b - a, causal, window)
            if kind is not None:
                out.append((t0, t1 - t0, a, b - a, kind))
    return out


def _coalesce(blocks: List[Block]) -> List[Block]:
    """Merge adjacent full blocks so the kernel gets fewer, larger calls."""
    def merge(items, same, adjacent, join):
        items = list(items)
        merged: List[Block] = []
        for blk in items:
            prev = merged[-1] if merged else None
            if prev is not None and prev.kind == blk.kind == "full" and same(prev, blk) and adjacent(prev, blk):
                merged[-1] = join(prev, blk)
            else:
                merged.append(blk)
        return merged

    by_q = sorted(blocks, key=lambda b: (b.q0, b.nq, b.k0))
    step1 = merge(
        by_q,
        lambda a, b: (a.q0, a.nq) == (b.q0, b.nq),
        lambda a, b: a.k0 + a.nk == b.k0,
        lambda a, b: Block(a.q0, a.nq, a.k0, a.nk + b.nk, a.q_pos, a.k_pos, "full"),
    )
    by_k = sorted(step1, key=lambda b: (b.k0, b.nk, b.q0))
    return merge(
        by_k,
        lambda a, b: (a.k0, a.nk) == (b.k0, b.nk),
        lambda a, b: a.q0 + a.nq == b.q0,
        lambda a, b: Block(a.q0, a.nq + b.nq, a.k0, a.nk, a.q_pos, a.k_pos, "full"),
    )


def plan_blocks(
    q_runs: Sequence[LocalRun],
    kv_runs: Sequence[LocalRun],
    *,
    causal: bool,
    window: Optional[int] = None,
    tile: Optional[int] = None,
) -> List[Block]:
    """All blocks between a rank's query runs and a shard's key runs, each allowed pair exactly once."""
    if tile is None:
        tile = default_tile(window)
    blocks = []
    for qo, qg, qn in q_runs:
        for ko, kg, kn in kv_runs:
            for qa, nq, ka, nk, kind in _pieces(qg, qn, kg, kn, causal, window, tile):
                blocks.append(Block(qo + qa - qg, nq, ko + ka - kg, nk, qa, ka, kind))
    return _coalesce(blocks)


def default_tile(window: Optional[int]) -> int:
    return 1 << 30 if window is None else max(128, min(window, 2048))


@dataclass(frozen=True)
class RingPlan:
    """The blocks one rank computes, per ring step; step ``s`` holds K/V of rank ``rank - s``."""

    rank: int
    world_size: int
    seq_len: int
    shard_sizes: Tuple[int, ...]
    steps: Tuple[Tuple[Block, ...], ...]

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def source(self, step: int) -> int:
        return (self.rank - step) % self.world_size


def _rank_steps(seq_len, rank, world_size, layout, causal, window) -> List[List[Block]]:
    q_runs = runs_to_local(local_runs(seq_len, rank, world_size, layout))
    steps = []
    for s in range(world_size):
        src = (rank - s) % world_size
        kv_runs = runs_to_local(local_runs(seq_len, src, world_size, layout))
        steps.append(plan_blocks(q_runs, kv_runs, causal=causal, window=window))
    return steps


@lru_cache(maxsize=256)
def ring_plan(
    seq_len: int, rank: int, world_size: int, layout: str, causal: bool, window: Optional[int]
) -> RingPlan:
    """The plan for ``rank``; its step count is the same on every rank (the last step anyone needs)."""
    all_steps = [_rank_steps(seq_len, r, world_size, layout, causal, window) for r in range(world_size)]
    needed = [max((s + 1 for s, blks in enumerate(steps) if blks), default=1) for steps in all_steps]
    num_steps = max(needed)
    sizes = tuple(
        sum(n for _, _, n in runs_to_local(local_runs(seq_len, r, world_size, layout)))
        for r in range(world_size)
    )
    mine = tuple(tuple(b) for b in all_steps[rank][:num_steps])
    return RingPlan(rank, world_size, seq_len, sizes, mine)


def split_block(blk: Block, tile: int, causal: bool, window: Optional[int]) -> List[Block]:
    """Cut a block into tiles of at most ``tile`` rows per side, dropping tiles with no allowed pair.

    The backward uses this to bound its per-block temporaries (dQ, dK, dV of
    one tile) whatever the shard size. ``mask`` blocks cover contiguous
    positions, so their tiles are re-classified from positions.
    """
    if blk.nq <= tile and blk.nk <= tile:
        return [blk]
    out = []
    for i in range(0, blk.nq, tile):
        ni = min(tile, blk.nq - i)
        for j in range(0, blk.nk, tile):
            nj = min(tile, blk.nk - j)
            if blk.kind == "full":
                kind = "full"
            elif blk.kind == "causal":
                kind = None if j > i else ("causal" if i == j else "full")
            else:
                kind = _classify(blk.q_pos + i, ni, blk.k_pos + j, nj, causal, window)
            if kind is not None:
                out.append(Block(blk.q0 + i, ni, blk.k0 + j, nj, blk.q_pos + i, blk.k_pos + j, kind))
    return out
