"""Which global positions each rank holds.

Pure index math: nothing here touches a process group, so every rule can be
tested without spawning ranks. A layout cuts the global sequence into chunks
of near-equal length (the first ``n % c`` chunks are one row longer) and hands
each rank one or more whole chunks, kept in ascending global order.

With head parallelism (``ulysses > 1``) the sequence-parallel ranks form
groups of ``ulysses`` consecutive ranks. The layout splits the sequence over
the ``world_size // ulysses`` groups as if each were one ring rank, and each
group's rows are cut into ``ulysses`` contiguous pieces, one per member in
order. The all-to-all of head parallelism then hands every member exactly
its group's ring shard, in the order the ring expects, and
:func:`head_split` says which query and K/V heads each member attends for.

``balanced`` chooses the rows per batch from its documents
(:mod:`hf_ring.engine.balance`): a :class:`Plan` holds what each ring group
takes, and stands wherever a layout does. Without documents (one per row)
``balanced`` is zigzag.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from .arguments import positive_int

LAYOUTS: Tuple[str, ...] = ("zigzag", "contiguous", "balanced")

Run = Tuple[int, int]
"""A half-open range ``[start, stop)`` of global positions."""


@dataclass(frozen=True)
class Plan:
    """The ``balanced`` layout of one batch: per ring group, the ascending runs of global rows it holds (they
    cover ``range(seq_len)`` once); made by :func:`hf_ring.engine.balance.plan_documents`."""

    seq_len: int
    runs: Tuple[Tuple[Run, ...], ...]

    def __repr__(self) -> str:  # a plan of many documents would fill an error message
        held = ", ".join(str(sum(b - a for a, b in r)) for r in self.runs)
        return f"Plan(seq_len={self.seq_len}, rows by group: {held})"


Layout = Union[str, Plan]
"""A layout's name, or the plan ``balanced`` chose for a batch."""


def check_layout(layout: Layout) -> Layout:
    if isinstance(layout, Plan):
        return layout
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"layout={layout!r} is not supported; use one of {', '.join(map(repr, LAYOUTS))}"
        )
    return layout


def layout_name(layout: Layout) -> str:
    """The setting a layout comes from (``balanced`` for a plan)."""
    return "balanced" if isinstance(layout, Plan) else layout


def chunk_bounds(seq_len: int, num_chunks: int) -> List[Run]:
    """Split ``range(seq_len)`` into ``num_chunks`` contiguous runs whose lengths differ by at most one."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    base, extra = divmod(seq_len, num_chunks)
    bounds, start = [], 0
    for i in range(num_chunks):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def check_ulysses_size(value: Any) -> int:
    """``ulysses_size``, ranks per head-parallel group, as a positive int (the one place it is type-checked)."""
    return positive_int(value, "ulysses_size", "ranks per head-parallel group")


def check_ulysses(world_size: int, ulysses: int) -> int:
    """``ulysses``: ranks per head-parallel group, a divisor of ``world_size``."""
    check_ulysses_size(ulysses)
    if world_size % ulysses:
        raise ValueError(
            f"ulysses_size={ulysses} does not divide the {world_size} sequence-parallel ranks; choose a divisor "
            f"of {world_size} (1: the ring alone, {world_size}: head parallelism alone, between: both)"
        )
    return ulysses


def _ring_runs(seq_len: int, rank: int, world_size: int, layout: Layout) -> List[Run]:
    if isinstance(layout, Plan):
        if layout.seq_len != seq_len or len(layout.runs) != world_size:
            raise ValueError(f"{layout!r} was made for another batch: this one has {seq_len} rows over "
                             f"{world_size} ring groups")
        return list(layout.runs[rank])
    if layout == "contiguous" or world_size == 1:
        return [chunk_bounds(seq_len, world_size)[rank]]
    chunks = chunk_bounds(seq_len, 2 * world_size)
    return [chunks[rank], chunks[2 * world_size - 1 - rank]]


def _cut_runs(runs: Sequence[Run], start: int, stop: int) -> List[Run]:
    """Rows ``[start, stop)`` of the concatenation of ``runs``, as runs."""
    out, offset = [], 0
    for a, b in runs:
        lo, hi = max(a, a + start - offset), min(b, a + stop - offset)
        if hi > lo:
            out.append((lo, hi))
        offset += b - a
    return out


def local_runs(seq_len: int, rank: int, world_size: int, layout: Layout = "zigzag", ulysses: int = 1) -> List[Run]:
    """The runs of global positions ``rank`` holds, ascending; empty runs are dropped, adjacent ones joined.

    ``zigzag`` gives rank r chunks r and 2p-1-r of 2p chunks, so causal work is
    equal on every rank; ``contiguous`` gives rank r chunk r of p. With
    ``ulysses > 1`` that split is over the head-parallel groups, and each
    member takes its contiguous piece of its group's rows (module notes).
    """
    check_layout(layout)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    check_ulysses(world_size, ulysses)
    group, member = divmod(rank, ulysses)
    runs = _ring_runs(seq_len, group, world_size // ulysses, layout)
    if ulysses > 1:
        start, stop = chunk_bounds(sum(b - a for a, b in runs), ulysses)[member]
        runs = _cut_runs(runs, start, stop)
    joined: List[Run] = []
    for a, b in runs:
        if b <= a:
            continue
        if joined and joined[-1][1] == a:  # the middle zigzag rank's two chunks are one run: one block, not three
            joined[-1] = (joined[-1][0], b)
        else:
            joined.append((a, b))
    return joined


def shard_sizes(seq_len: int, world_size: int, layout: Layout = "zigzag", ulysses: int = 1) -> List[int]:
    """Number of rows each rank holds, indexed by rank."""
    return [
        sum(b - a for a, b in local_runs(seq_len, r, world_size, layout, ulysses)) for r in range(world_size)
    ]


def owner(position: int, seq_len: int, world_size: int, layout: Layout = "zigzag", ulysses: int = 1) -> int:
    """The rank that holds global ``position`` of a ``seq_len``-long sequence."""
    if not 0 <= position < seq_len:
        raise ValueError(f"position must be in [0, {seq_len}), got {position}")
    check_layout(layout)
    check_ulysses(world_size, ulysses)
    if isinstance(layout, Plan):
        for r in range(world_size):
            if any(a <= position < b for a, b in local_runs(seq_len, r, world_size, layout, ulysses)):
                return r
        raise AssertionError("unreachable: a plan's runs cover every row")
    groups = world_size // ulysses
    chunks = groups if layout == "contiguous" or groups == 1 else 2 * groups
    # Chunk boundaries are those of chunk_bounds: the first seq_len % chunks chunks hold one row more.
    base, extra = divmod(seq_len, chunks)
    long_rows = extra * (base + 1)
    chunk = position // (base + 1) if position < long_rows else extra + (position - long_rows) // base
    group = chunk if chunk < groups else chunks - 1 - chunk
    if ulysses == 1:
        return group
    runs = _ring_runs(seq_len, group, groups, layout)
    before = sum(min(b, position) - a for a, b in runs if a <= position)  # the group's rows ahead of it
    for member, (start, stop) in enumerate(chunk_bounds(sum(b - a for a, b in runs), ulysses)):
        if start <= before < stop:
            return group * ulysses + member
    raise AssertionError("unreachable: every row of a group belongs to one member")


def local_positions(
    seq_len: int, rank: int, world_size: int, layout: Layout = "zigzag", ulysses: int = 1
) -> torch.Tensor:
    """Global positions held by ``rank``, as an ascending ``LongTensor``."""
    runs = local_runs(seq_len, rank, world_size, layout, ulysses)
    if not runs:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in runs])


def in_global_order(parts: torch.Tensor, seq_len: int, world_size: int, layout: Layout = "zigzag",
                    ulysses: int = 1) -> torch.Tensor:
    """``(seq_len, ...)`` from ``parts`` ``(world_size, longest, ...)``: each rank's rows, padded to the longest
    shard as an all-gather stacks them, put at their global positions."""
    out = parts.new_empty((seq_len,) + tuple(parts.shape[2:]))
    for r in range(world_size):
        rows = local_positions(seq_len, r, world_size, layout, ulysses).to(parts.device)
        out[rows] = parts[r, : len(rows)]
    return out


def runs_to_local(runs: Sequence[Run]) -> List[Tuple[int, int, int]]:
    """For each run, ``(local_offset, global_start, length)`` within a rank's rows."""
    out, offset = [], 0
    for a, b in runs:
        out.append((offset, a, b - a))
        offset += b - a
    return out


def totals_before(runs_by_rank: Sequence[Sequence[Run]], totals: torch.Tensor, rank: int) -> torch.Tensor:
    """Per run of ``rank``, the sum of ``totals`` over every run (of any rank) that lies before it.

    ``totals[r, ..., i]`` belongs to run ``i`` of rank ``r`` (runs padded to
    the longest list, extra entries ignored); the result is ``(..., runs of
    rank)``. Runs never overlap, so a run lies before another when it starts
    earlier: what a count along the sequence (a cumulative sum) adds to a run
    from the rows other ranks hold.
    """
    mine = runs_by_rank[rank]
    out = totals.new_zeros(totals.shape[1:-1] + (len(mine),))
    for r, runs in enumerate(runs_by_rank):
        for i, (start, _) in enumerate(runs):
            for j, (mine_start, _) in enumerate(mine):
                if start < mine_start:
                    out[..., j] += totals[r, ..., i]
    return out


def infer_seq_len(local_lens: Sequence[int], layout: Layout = "zigzag", ulysses: int = 1) -> int:
    """Global length from every rank's row count; raises if no length gives these shards."""
    world_size = len(local_lens)
    total = int(sum(local_lens))
    expected = shard_sizes(total, world_size, layout, ulysses)
    if list(local_lens) != expected:
        raise ValueError(
            f"shard sizes {list(local_lens)} do not match layout={layout!r} for any global length "
            f"(a global length of {total} gives {expected}); shard with hf_ring.local_positions"
        )
    return total


@dataclass(frozen=True)
class HeadSplit:
    """How ``hq`` query and ``hkv`` K/V heads are shared by the ``ulysses`` members of a head-parallel group."""

    ulysses: int
    hq: int
    hkv: int

    @property
    def q_per_rank(self) -> int:
        return self.hq // self.ulysses

    def q_heads(self, member: int) -> range:
        """The global query heads member ``member`` attends for."""
        return range(member * self.q_per_rank, (member + 1) * self.q_per_rank)

    def kv_heads(self, member: int) -> range:
        """The global K/V heads its query heads use (one head, repeated over members, when ``hkv < ulysses``)."""
        if self.hkv >= self.ulysses:
            per = self.hkv // self.ulysses
            return range(member * per, (member + 1) * per)
        first = self.q_heads(member).start // (self.hq // self.hkv)
        return range(first, first + 1)

    def kv_index(self) -> Optional[torch.Tensor]:
        """K/V heads in the order the exchange sends them; None when that is every head once, in order."""
        if self.hkv >= self.ulysses:
            return None
        return torch.tensor([self.kv_heads(m).start for m in range(self.ulysses)], dtype=torch.long)


def head_split(hq: int, hkv: int, ulysses: int, holder: str = "the model's", other_fix: str = "") -> HeadSplit:
    """The heads each member of a group of ``ulysses`` ranks holds; refuses splits that cannot be exact and even.

    ``holder`` names whose heads these are in the errors (tensor parallelism hands a rank a slice of the
    model's); ``other_fix`` is appended to the fix they name."""
    if ulysses == 1:
        return HeadSplit(1, hq, hkv)
    if hq % ulysses:
        raise ValueError(
            f"ulysses_size={ulysses} does not divide {holder} {hq} query heads: head parallelism gives each "
            f"rank of a group the same number of heads. Choose a ulysses_size that divides {hq} (1 runs the ring "
            f"alone){other_fix}"
        )
    if hkv % ulysses and ulysses % hkv:
        raise ValueError(
            f"ulysses_size={ulysses} and {holder} {hkv} key/value heads neither divide the other, so some rank's "
            f"query heads would use parts of several K/V heads. Choose a ulysses_size that divides {hkv} or is a "
            f"multiple of it (1 runs the ring alone){other_fix}"
        )
    return HeadSplit(ulysses, hq, hkv)
