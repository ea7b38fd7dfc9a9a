"""Which global positions each rank holds.

Pure index math: nothing here touches a process group, so every rule can be
tested without spawning ranks. A layout cuts the global sequence into chunks
of near-equal length (the first ``n % c`` chunks are one row longer) and hands
each rank one or more whole chunks, kept in ascending global order.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

LAYOUTS: Tuple[str, ...] = ("zigzag", "contiguous")

Run = Tuple[int, int]
"""A half-open range ``[start, stop)`` of global positions."""


def check_layout(layout: str) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"layout={layout!r} is not supported; use one of {', '.join(map(repr, LAYOUTS))}"
        )
    return layout


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


def local_runs(seq_len: int, rank: int, world_size: int, layout: str = "zigzag") -> List[Run]:
    """The runs of global positions ``rank`` holds, ascending; empty runs are dropped.

    ``zigzag`` gives rank r chunks r and 2p-1-r of 2p chunks, so causal work is
    equal on every rank; ``contiguous`` gives rank r chunk r of p.
    """
    check_layout(layout)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if layout == "contiguous" or world_size == 1:
        runs = [chunk_bounds(seq_len, world_size)[rank]]
    else:
        chunks = chunk_bounds(seq_len, 2 * world_size)
        runs = [chunks[rank], chunks[2 * world_size - 1 - rank]]
    return [r for r in runs if r[1] > r[0]]


def shard_sizes(seq_len: int, world_size: int, layout: str = "zigzag") -> List[int]:
    """Number of rows each rank holds, indexed by rank."""
    return [
        sum(b - a for a, b in local_runs(seq_len, r, world_size, layout)) for r in range(world_size)
    ]


def owner(position: int, seq_len: int, world_size: int, layout: str = "zigzag") -> int:
    """The rank that holds global ``position`` of a ``seq_len``-long sequence."""
    if not 0 <= position < seq_len:
        raise ValueError(f"position must be in [0, {seq_len}), got {position}")
    check_layout(layout)
    chunks = world_size if layout == "contiguous" or world_size == 1 else 2 * world_size
    # Chunk boundaries are those of chunk_bounds: the first seq_len % chunks chunks hold one row more.
    base, extra = divmod(seq_len, chunks)
    long_rows = extra * (base + 1)
    chunk = position // (base + 1) if position < long_rows else extra + (position - long_rows) // base
    return chunk if chunk < world_size else chunks - 1 - chunk


def local_positions(
    seq_len: int, rank: int, world_size: int, layout: str = "zigzag"
) -> torch.Tensor:
    """Global positions held by ``rank``, as an ascending ``LongTensor``."""
    runs = local_runs(seq_len, rank, world_size, layout)
    if not runs:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in runs])


def runs_to_local(runs: Sequence[Run]) -> List[Tuple[int, int, int]]:
    """For each run, ``(local_offset, global_start, length)`` within a rank's rows."""
    out, offset = [], 0
    for a, b in runs:
        out.append((offset, a, b - a))
        offset += b - a
    return out


def infer_seq_len(local_lens: Sequence[int], layout: str = "zigzag") -> int:
    """Global length from every rank's row count; raises if no length gives these shards."""
    world_size = len(local_lens)
    total = int(sum(local_lens))
    expected = shard_sizes(total, world_size, layout)
    if list(local_lens) != expected:
        raise ValueError(
            f"shard sizes {list(local_lens)} do not match layout={layout!r} for any global length "
            f"(a global length of {total} gives {expected}); shard with hf_ring.local_positions"
        )
    return total
