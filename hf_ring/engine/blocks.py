"""Blocks: which (query rows, key rows) pairs are computed, and how.

Pure index math. Progression are arithmetic progressions of positions on one rank
(stride 1 for dense attention, the dilation rate for a dilated branch). A
block is ``full`` (every pair allowed), ``causal`` (both sides hold the same
positions: the kernel's top-left causal mask is exact) or ``mask`` (a boolean
mask built from positions when it runs). Blocks with no allowed pair are never
made, so blocks in the future or outside a sliding window cost nothing.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch


@dataclass(frozen=True)
class Progression:
    """``count`` rows of one rank: local rows ``local + i·stride`` hold positions ``pos + i·stride``."""

    local: int
    pos: int
    count: int
    stride: int = 1

    @property
    def last_pos(self) -> int:
        return self.pos + (self.count - 1) * self.stride

    @property
    def slice(self) -> slice:
        """The local rows, to index a tensor's row dimension without a copy."""
        return slice(self.local, self.local + (self.count - 1) * self.stride + 1, self.stride)

    def sub(self, start: int, count: int) -> "Progression":
        """Items ``start .. start+count-1`` of this progression."""
        return Progression(self.local + start * self.stride, self.pos + start * self.stride, count, self.stride)

    def split(self, cuts) -> List["Progression"]:
        """The progression in consecutive parts, a new one starting at each position of ``cuts`` (empty parts
        dropped)."""
        parts, lo = [], self.pos
        for cut in sorted(cuts) + [self.last_pos + 1]:
            part = self.clip(lo, cut - 1) if cut > lo else None
            if part is not None:
                parts.append(part)
            lo = max(lo, cut)
        return parts

    def clip(self, lo: int, hi: int) -> Optional["Progression"]:
        """The items whose positions lie in ``[lo, hi]``, or None."""
        first = 0 if lo <= self.pos else -(-(lo - self.pos) // self.stride)
        last = self.count - 1 if hi >= self.last_pos else (hi - self.pos) // self.stride
        if hi < self.pos or first > last:
            return None
        return self.sub(first, last - first + 1)


def allowed_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: Optional[int]) -> torch.Tensor:
    """Bool ``(len(q_pos), len(k_pos))``: the query at ``q`` may see the key at ``k``.

    The one mask rule of the library: ``k <= q`` when causal and ``k > q - window``
    under a sliding window, from global positions.
    """
    q, k = q_pos[:, None], k_pos[None, :]
    allowed = k <= q if causal else torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device)
    if window is not None:
        allowed = allowed & (k > q - window)
    return allowed


def band_of(q: Progression, k_pos: int, causal: bool, window: Optional[int]) -> Tuple[Optional[int], int]:
    """The mask rule on a block of progressions as a band of item offsets: key item j is allowed for query item i
    iff ``lo <= j - i <= hi`` (``lo=None``: no lower bound).

    Both progressions share the stride and the residue (a dilated branch's rows
    of one offset), so ``k <= q`` and ``k > q - window`` are bounds on ``j - i``.
    Only for a partially visible causal block (kind ``"mask"``).
    """
    if not causal:
        raise ValueError("a band describes a causal block; a non-causal block is full")
    delta, rem = divmod(q.pos - k_pos, q.stride)
    if rem:
        raise ValueError(f"query and key progressions of one block must share their residue, got {q} and {k_pos}")
    lo = None if window is None else -((window - 1 - (q.pos - k_pos)) // q.stride)
    return lo, delta


def band_mask(sq: int, sk: int, lo: Optional[int], hi: int, device=None) -> torch.Tensor:
    """Bool ``(sq, sk)``: ``lo <= j - i <= hi`` (the band of :func:`band_of` as a mask)."""
    i = torch.arange(sq, device=device).unsqueeze(1)  # comparisons broadcast straight to bool: no (sq, sk) ints
    j = torch.arange(sk, device=device).unsqueeze(0)
    allowed = j <= i + hi
    return allowed if lo is None else allowed & (j >= i + lo)


def block_mask(q: Progression, k_pos: int, nk: int, kind: str, causal: bool, window: Optional[int],
               device=None) -> torch.Tensor:
    """Bool ``(q.count, nk)`` of the block of ``q`` against ``nk`` keys from ``k_pos`` (stride ``q.stride``):
    its kind (:func:`classify`) as a mask, for a kernel call that also needs padding or documents."""
    if kind == "full":
        return torch.ones(q.count, nk, dtype=torch.bool, device=device)
    if kind == "causal":
        return torch.ones(q.count, nk, dtype=torch.bool, device=device).tril()
    return band_mask(q.count, nk, *band_of(q, k_pos, causal, window), device=device)


def classify(q: Progression, k: Progression, causal: bool, window: Optional[int]) -> Optional[str]:
    """Kind of the block ``q x k``, or None when no pair in it is allowed."""
    if q.count <= 0 or k.count <= 0:
        return None
    if not causal:
        return "full"
    if k.pos > q.last_pos:
        return None
    if window is not None and k.last_pos <= q.pos - window:
        return None
    if k.last_pos <= q.pos and (window is None or k.pos > q.last_pos - window):
        return "full"
    same = (q.pos, q.count, q.stride) == (k.pos, k.count, k.stride)
    if same and (window is None or q.last_pos - q.pos < window):
        return "causal"
    return "mask"


def tiles(q: Progression, k: Progression, causal: bool, window: Optional[int],
          tile: int) -> List[Tuple[Progression, Progression, str]]:
    """Split ``q x k`` into classified tiles of at most ``tile`` rows a side, dropping empty ones.

    Under a sliding window (stride 1) each query tile is cut against the keys
    ``[t1-window, t0]`` that all its rows see and the two partial bands beside
    them, so masks stay ``tile x tile`` while the work stays linear in n.
    """
    out: List[Tuple[Progression, Progression, str]] = []
    for qi in range(0, q.count, tile):
        qt = q.sub(qi, min(tile, q.count - qi))
        if window is not None and causal:
            t0, t1 = qt.pos, qt.last_pos + 1
            cuts = sorted([t0 - window + 1, t1 - window, t0, t1])
            ranges = [(a, b - 1) for a, b in zip(cuts, cuts[1:]) if b > a]
        else:
            ranges = [(k.pos, k.last_pos)]
        for lo, hi in ranges:
            kr = k.clip(lo, hi)
            if kr is None:
                continue
            for ki in range(0, kr.count, tile):
                kt = kr.sub(ki, min(tile, kr.count - ki))
                kind = classify(qt, kt, causal, window)
                if kind is not None:
                    out.append((qt, kt, kind))
    return out


def default_tile(window: Optional[int]) -> int:
    """Forward tile: whole blocks without a window; about the window size with one."""
    return 1 << 30 if window is None else max(128, min(window, 2048))


class KeyValidity:
    """Which keys of a run of key rows may be attended, answered for any range of them without a sync.

    Built once per piece of K/V rows from its ``(B, n)`` key mask: the runs of keys of one state over the batch
    (``"all"`` rows valid, ``"none"``, or ``"mixed"``) come to the host in one transfer, and the running count of
    valid keys of every batch row in a second, only when a range is asked about per row (rows padded
    differently). A range of keys is then ``"all"`` valid (the unmasked kernel runs), ``"none"`` (skipped: a
    padded key adds nothing to any softmax) or ``"some"`` (only such a range pays for a mask).
    """

    def __init__(self, mask: torch.Tensor):
        self._mask = mask
        column = mask.all(0).to(torch.int8) * 2 + mask.any(0).to(torch.int8)  # 3 all, 1 mixed, 0 none
        starts = torch.nonzero(torch.diff(column, prepend=column[:1] - 1)).flatten()
        names = {3: "all", 1: "mixed", 0: "none"}
        self._starts = starts.tolist()
        self._states = [names[int(c)] for c in column[starts].tolist()]

    def state(self, start: int, stop: int) -> str:
        """``"all"``, ``"none"`` or ``"some"`` for keys ``start .. stop-1`` over every batch row."""
        states = set(self._row_states(start, stop))
        return states.pop() if len(states) == 1 else "some"

    def key_runs(self, start: int, stop: int) -> List[Tuple[int, int, str]]:
        """The keys ``start .. stop-1`` as runs ``(first, end, state)`` of one state over the batch: ``"all"``,
        ``"none"`` or ``"mixed"`` (valid in some batch rows only)."""
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        out = []
        while i < len(self._starts) and self._starts[i] < stop:
            end = self._starts[i + 1] if i + 1 < len(self._starts) else stop
            out.append((max(self._starts[i], start), min(end, stop), self._states[i]))
            i += 1
        return out

    def runs(self, start: int, stop: int) -> List[Tuple[slice, str]]:
        """Runs of consecutive batch rows of one state for keys ``start .. stop-1``: ``(rows, state)``, so that
        rows whose keys are all valid (or all padding) are not masked because another row's are not."""
        out: List[Tuple[slice, str]] = []
        for b, st in enumerate(self._row_states(start, stop)):
            if out and out[-1][1] == st:
                out[-1] = (slice(out[-1][0].start, b + 1), st)
            else:
                out.append((slice(b, b + 1), st))
        return out

    @functools.cached_property
    def _counts(self) -> List[List[int]]:
        return torch.nn.functional.pad(self._mask.to(torch.int32).cumsum(1), (1, 0)).cpu().tolist()

    def all_valid(self) -> bool:
        """Whether every key of the piece is valid in every row."""
        return self._states == ["all"]

    def _row_states(self, start: int, stop: int) -> List[str]:
        valid = [row[stop] - row[start] for row in self._counts]
        return ["all" if n == stop - start else "none" if n == 0 else "some" for n in valid]


def padding_parts(q: Progression, keys: Progression, kind: str, causal: bool, window: Optional[int],
                  valid: Optional[KeyValidity], mask: Optional[torch.Tensor], tile: Optional[int], padded_tile: int,
                  split_rows: bool
                  ) -> Iterator[Tuple[slice, Progression, Progression, str, slice, Optional[torch.Tensor]]]:
    """What the block ``q x keys`` of kind ``kind`` computes under key padding: ``(batch rows, query rows, key
    rows, kind, the keys' slice of their piece, key mask or None)`` per kernel call.

    ``keys`` are items ``keys.local // stride ..`` of a piece whose :class:`KeyValidity` is ``valid`` and whose
    ``(B, n)`` mask is ``mask`` (both None: every key valid). With every key valid, the block itself (``tile``:
    in tiles of that side). With padding, the keys are cut where their validity over the batch changes (and
    causal queries at the same positions, so a diagonal part stays one causal call): keys padded in every row
    are skipped, keys valid in every row run unmasked, and keys valid in some rows only go in tiles of at most
    ``padded_tile``, where (``split_rows``) the batch rows whose keys are all valid run unmasked, those whose keys
    are all padding not at all, and only the others carry a mask.
    """
    stride, every = q.stride, slice(None)
    spanned = kind == "span"  # a span's extra pairs: no causal cut, and every part keeps its kind
    if spanned:
        causal, window = False, None
    whole = (keys.local // stride, keys.local // stride + keys.count)
    runs = [(*whole, "all")] if valid is None else valid.key_runs(*whole)
    if runs == [(*whole, "all")] and tile is None:
        yield every, q, keys, kind, slice(*whole), None
        return
    cuts = [keys.pos + (first - whole[0]) * stride for first, _, _ in runs[1:]] if causal else []
    queries = q.split(cuts)
    for first, end, state in runs:
        if state == "none":
            continue
        kr = keys.sub(first - whole[0], end - first)
        for qr in queries:
            if state == "all" and tile is None:
                part_kind = classify(qr, kr, causal, window)
                if part_kind is not None:
                    yield every, qr, kr, "span" if spanned else part_kind, slice(first, end), None
                continue
            side = tile if state == "all" else min(tile or padded_tile, padded_tile)
            for qt, kt, part_kind in tiles(qr, kr, causal, window, side):
                part_kind = "span" if spanned else part_kind
                start = kt.local // stride
                ks = slice(start, start + kt.count)
                if state == "all":
                    yield every, qt, kt, part_kind, ks, None
                    continue
                parts = valid.runs(ks.start, ks.stop) if split_rows else [(every, valid.state(ks.start, ks.stop))]
                for rows, part in parts:
                    if part != "none":
                        yield rows, qt, kt, part_kind, ks, None if part == "all" else mask[rows, ks]
