"""Layers that carry a state along the sequence, computed over shards exactly: state passing and convolution halos.

A recurrent layer (gated delta rule, KDA, Mamba, Mamba2) reads its rows in
position order. A rank holds one or more runs of the sequence (:class:`Pieces`:
two under ``zigzag``), and the state a run ends with is affine in the state it
starts from::

    S_end = M · S_in + S_ext

``S_ext`` is what the run reaches from a zero state and ``M`` the run's
transition: a ``d_k × d_k`` matrix per head for the delta rules, a decay per
head (Mamba2) or per channel and state (Mamba) for the others. Every run is
computed from a zero state at once; the ``(S_ext, M)`` of every run travel in
one all-gather (:func:`gather`, part of autograd: its backward sums each
run's gradients over the ranks that read them), every rank composes them in
position order into the true starting state of each of its runs
(:func:`carried`), and a run's outputs are corrected for that state by a term
linear in it (the layer's own: see :mod:`hf_ring.patches.recurrent`). The end
state of the whole sequence comes out of the same walk, on every rank.

A short causal convolution (width ``k``) reads the ``k - 1`` rows before each
row: every run's last ``k - 1`` rows travel in one all-gather, and each run
is convolved after the rows before it (:func:`halo`). Rows before position 0
are zeros, as the layer's own left padding.

Everything here is pure index math or torch collectives: no model code.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .comm import RingComm
from .gathers import gather
from .layout import Run, local_runs, runs_to_local

Tensor = torch.Tensor


@dataclass(frozen=True)
class Pieces:
    """The runs of the sequence every rank of a group holds (ascending per rank), and which rank this is."""

    runs: Tuple[Tuple[Run, ...], ...]
    rank: int

    @classmethod
    def of(cls, seq_len: int, world_size: int, layout: str, ulysses: int, rank: int) -> "Pieces":
        return cls(tuple(tuple(local_runs(seq_len, r, world_size, layout, ulysses)) for r in range(world_size)), rank)

    @property
    def mine(self) -> Tuple[Run, ...]:
        return self.runs[self.rank]

    @property
    def width(self) -> int:
        """Runs per rank in an exchange: the most any rank holds (at least one, so every rank sends something)."""
        return max(1, max(len(r) for r in self.runs))

    def local(self) -> List[Tuple[int, int]]:
        """``(offset, length)`` of each of this rank's runs within its rows."""
        return [(offset, length) for offset, _, length in runs_to_local(self.mine)]

    def order(self) -> List[Tuple[int, int]]:
        """``(rank, index)`` of every run, in position order."""
        found = [(start, r, i) for r, runs in enumerate(self.runs) for i, (start, _) in enumerate(runs)]
        return [(r, i) for _, r, i in sorted(found)]


def carried(pieces: Pieces, ends: Tensor, maps: Tensor, step: Callable[[Tensor, Tensor], Tensor],
            initial: Optional[Tensor] = None) -> Tuple[List[Tensor], Tensor]:
    """The state each of this rank's runs starts from, and the state the sequence ends with.

    ``ends[r, i]`` / ``maps[r, i]``: run ``i`` of rank ``r`` ends in ``step(maps[r, i], S_in) + ends[r, i]`` from
    ``S_in`` (its ``M`` and ``S_ext``; :func:`gather`'s output). The first run starts from ``initial`` (None:
    zeros). Walked in position order; runs after this rank's last are composed only for the end state.
    """
    state = torch.zeros_like(ends[0, 0]) if initial is None else initial
    starts = {}
    for r, i in pieces.order():
        if r == pieces.rank:
            starts[i] = state
        state = step(maps[r, i], state) + ends[r, i]
    return [starts[i] for i in range(len(pieces.mine))], state


SCAN_ROWS = 1024
"""The most rows one call of a torch-path scan kernel runs in a hybrid's recurrent layer under hf_ring.
transformers' torch delta rule is not linear in its rows (its time per row grows with the row), and Mamba2's
torch chunk scan relates every pair of its chunks; in pieces of 512 to 1024 rows, each starting from the state the
one before ended in, the delta rule's time per row stays flat at every length (``python -m bench hybrid
--scan-rows``). The pieces' states compose exactly, so the layer's time grows linearly with its rows."""


@dataclass(frozen=True)
class Segment:
    """A stretch of this rank's rows that one kernel call runs: one of its runs, or part of one cut at a document
    start (packed rows). A document start is a run whose incoming state is zero, and a convolution sees no row of an
    earlier document."""

    run: int  # the index of the run (:meth:`Pieces.local`) it lies in
    offset: int  # its first row, among this rank's rows
    length: int
    start: int  # its first row, in the sequence
    origins: Tuple[int, ...]  # per batch row: where the document that holds its first row starts (0: the sequence)

    @property
    def fresh(self) -> Tuple[bool, ...]:
        """Per batch row: it starts from a zero state (its first row starts a document, or the sequence)."""
        return tuple(origin == self.start for origin in self.origins)


def segments(pieces: Pieces, documents: Optional[Sequence[Sequence[int]]], batch: int,
             local: Optional[Sequence[Tuple[int, int]]] = None, limit: Optional[int] = None) -> List[Segment]:
    """This rank's runs cut at every document start of any batch row (``documents``: per batch row, the ascending
    global rows where a document starts, beginning with 0; None: one sequence per row), in the order it holds them.
    ``local``: the runs as ``(offset, length)`` in its rows (default :meth:`Pieces.local`); ``limit``: also cut
    every ``limit`` rows from each run's start (None: no such cut), so no segment is longer."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit}: a segment holds at least one row; pass a positive length, or None")
    starts = [tuple(row) for row in documents] if documents is not None else [(0,)] * batch
    cuts = sorted({s for row in starts for s in row})
    out = []
    for i, ((offset, length), (a, _)) in enumerate(zip(local if local is not None else pieces.local(), pieces.mine)):
        bounded = [] if limit is None else list(range(a + limit, a + length, limit))
        edges = [a] + sorted(set(c for c in cuts if a < c < a + length) | set(bounded)) + [a + length]
        for lo, hi in zip(edges, edges[1:]):
            origins = tuple(row[bisect_right(row, lo) - 1] for row in starts)
            out.append(Segment(i, offset + lo - a, hi - lo, lo, origins))
    return out


def _per_row(keep: Tensor, like: Tensor) -> Tensor:
    return keep.to(like.dtype).view((-1,) + (1,) * (like.dim() - 1))


def keeps(segment: Segment, device) -> Optional[Tensor]:
    """``(B,)``: 1 for the batch rows that carry their state into ``segment``, 0 for those whose document starts at
    its first row; None when every row carries it."""
    fresh = segment.fresh
    if not any(fresh):
        return None
    return torch.tensor([0.0 if f else 1.0 for f in fresh], device=device)


def restarted(segment: Segment, state: Tensor) -> Tensor:
    """``state`` (batch rows first), the state a known segment before ``segment`` ended in, as ``segment`` starts
    from it: zeroed for the batch rows whose document starts at its first row."""
    kept = keeps(segment, state.device)
    return state if kept is None else state * _per_row(kept, state)


def fold(ends: Sequence[Tensor], maps: Sequence[Tensor], kept: Sequence[Optional[Tensor]],
         step: Callable[[Tensor, Tensor], Tensor], chain: Callable[[Tensor, Tensor], Tensor]) -> Tuple[Tensor, Tensor]:
    """A run's ``(S_ext, M)`` from its segments', in order: segment ``s`` ends in ``step(maps[s], k_s * S) +
    ends[s]`` from the state ``S`` the one before it ended in (``k_s``: ``kept[s]``, per batch row; None: all 1),
    so the run ends in ``step(M, S_in) + S_ext``; ``chain(M2, M1)`` is the transition of ``M1`` then ``M2``."""
    end, transition = ends[0], maps[0] if kept[0] is None else maps[0] * _per_row(kept[0], maps[0])
    for e, m, k in zip(ends[1:], maps[1:], kept[1:]):
        carried_end = end if k is None else end * _per_row(k, end)
        end = step(m, carried_end) + e
        transition = chain(m, transition if k is None else transition * _per_row(k, transition))
    return end, transition


def segment_starts(start: Tensor, ends: Sequence[Tensor], maps: Sequence[Tensor], kept: Sequence[Optional[Tensor]],
                   step: Callable[[Tensor, Tensor], Tensor]) -> List[Tensor]:
    """The state each segment of a run starts from, the run starting from ``start`` (see :func:`fold`)."""
    out = []
    state = start
    for e, m, k in zip(ends, maps, kept):
        state = state if k is None else state * _per_row(k, state)
        out.append(state)
        state = step(m, state) + e
    return out


def halo_sources(pieces: Pieces, width: int, kept: Optional[int] = None) -> List[List[Optional[Tuple[int, int, int]]]]:
    """For each of this rank's runs, where each of the ``width`` rows before it lies in the exchanged tails:
    ``(rank, run, row of that run's tail)``, or None before position 0. A tail holds a run's last ``kept`` rows
    (``width`` unless given; fewer for a shorter run, right-aligned)."""
    kept = width if kept is None else kept
    ends = {}
    for r, runs in enumerate(pieces.runs):
        for i, (a, b) in enumerate(runs):
            ends[r, i] = (a, b)
    out = []
    for start, _ in pieces.mine:
        sources: List[Optional[Tuple[int, int, int]]] = []
        for p in range(start - width, start):
            if p < 0:
                sources.append(None)
                continue
            (r, i), (a, b) = next(((key, ab) for key, ab in ends.items() if ab[0] <= p < ab[1]))
            sources.append((r, i, kept - (b - p)))  # a tail is right-aligned: its last row is the run's last
        out.append(sources)
    return out


def _tails(pieces: Pieces, x: Tensor, width: int) -> Tensor:
    """Each of this rank's runs' last ``width`` rows of ``x``, right-aligned, ``(..., runs, width)``."""
    tails = x.new_zeros(x.shape[:-1] + (pieces.width, width))
    for i, (offset, length) in enumerate(pieces.local()):
        kept = min(length, width)
        if kept:
            tails[..., i, width - kept:] = x[..., offset + length - kept:offset + length]
    return tails


def _rows_from(every: Tensor, sources: List[Optional[Tuple[int, int, int]]], like: Tensor) -> Tensor:
    """``(..., len(sources))``: the exchanged rows ``sources`` names, zeros where it names none."""
    rows = [like.new_zeros(like.shape[:-1]) if s is None else every[s[0]][..., s[1], s[2]] for s in sources]
    return torch.stack(rows, dim=-1) if rows else like.new_zeros(like.shape[:-1] + (0,))


def halo(pieces: Pieces, comm: Optional[RingComm], x: Tensor, width: int,
         tail: int = 0) -> Tuple[List[Tensor], Optional[Tensor], Tensor]:
    """For each of this rank's runs, the ``width`` rows of ``x`` (``(..., rows)``, this rank's rows last) that come
    before it in the sequence, ``(..., width)``, zeros before position 0; with ``tail``, also the last ``tail`` rows
    of the whole sequence on every rank (what a convolution keeps as its state after a prefill; None without).
    Differentiable: one all-gather, whose result is returned too, for the caller to tie into what it returns (see
    :func:`hf_ring.engine.gathers.tied`)."""
    kept = max(width, tail)
    every = gather(comm, _tails(pieces, x, kept), "the rows before each run (a convolution's halo)", anchor=x)
    halos = [_rows_from(every, sources, x) for sources in halo_sources(pieces, width, kept)]
    if not tail:
        return halos, None, every
    end = max(b for runs in pieces.runs for _, b in runs) if any(pieces.runs) else 0
    beyond = Pieces(pieces.runs + (((end, end + 1),),), len(pieces.runs))  # a run that starts where the rows end
    return halos, _rows_from(every, halo_sources(beyond, tail, kept)[0], x), every
