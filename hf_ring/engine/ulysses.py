"""Head parallelism (Ulysses), alone or inside the ring (USP): sequence shards become head shards and back.

The sequence-parallel ranks form head-parallel groups of ``u`` consecutive
ranks, each member holding a contiguous piece of its group's ring shard (see
:mod:`hf_ring.engine.layout`). An all-to-all turns every member's ``(all heads, its
rows)`` into ``(its heads, the group's rows)``; attention then runs over the
group's rows for those heads, as the ring over the ``p/u`` groups, or alone
when ``u = p``, and a second all-to-all takes the output back to ``(all
heads, its rows)``. Nothing else changes: causality, windows, dilation,
documents, padding, soft-capping and sinks are the ring's, read from global
positions and global head indices, so every mode computes the same attention.

A member's heads go in chunks of whole K/V heads (:func:`chunks`), one
exchange each, so the next chunk travels while this one's attention runs and
only a chunk of the group's rows is ever held in the head layout. Nothing in
the head layout is kept for the backward: it exchanges the chunk's Q, K, V
and output again beside dO (the forward's inputs and output are alive in the
model anyway), so per rank the layer's memory is its own rows' plus one
chunk's. Each member sends ``(u-1)/u`` of the rows it exchanges: ``2·(Hq +
Hkv)·S_local·D`` numbers per rank per layer forward, ``(4·Hq + 4·Hkv)·S_local·D``
backward. K/V heads fewer than ``u`` (grouped-query attention) are repeated
only as far as ``u`` needs: each member gets the one K/V head its query heads
use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch.autograd.function import once_differentiable

from .comm import Pending, RingComm
from .layout import HeadSplit
from .merge import sinks_backward
from .ring import RingCall, plan, ring_backward, ring_forward, rows_major
from .spec import AttentionSpec

Tensor = torch.Tensor

MAX_CHUNKS = 4
"""Most exchanges a member's heads are cut into per direction: more chunks hold fewer rows in the head
layout at once, but each one is another all-to-all and shorter kernel calls."""


@dataclass(frozen=True)
class Chunk:
    """One exchange's heads: per member, the query heads and the K/V heads (indices of every rank's K/V)."""

    q: Tuple[range, ...]
    kv: Tuple[range, ...]


def chunks(split: HeadSplit) -> List[Chunk]:
    """A member's heads cut into whole-K/V-head chunks, at most :data:`MAX_CHUNKS` of them, the same on every member.

    Chunk ``c`` of member ``m`` holds the ``c``-th slice of ``m``'s query
    heads and the K/V heads they read; a K/V head shared by several members
    (``hkv < u``) makes one chunk.
    """
    u = split.ulysses
    kv_width = len(split.kv_heads(0))
    count = max(c for c in range(1, min(MAX_CHUNKS, kv_width) + 1) if kv_width % c == 0)
    qc, kc = split.q_per_rank // count, kv_width // count
    out = []
    for c in range(count):
        q = tuple(range(split.q_heads(m).start + c * qc, split.q_heads(m).start + (c + 1) * qc) for m in range(u))
        kv = tuple(range(split.kv_heads(m).start + c * kc, split.kv_heads(m).start + (c + 1) * kc) for m in range(u))
        out.append(Chunk(q, kv))
    return out


def _offsets(sizes: Sequence[int]) -> List[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def _post_to_heads(comm: RingComm, sources: Sequence[Tensor], heads: Sequence[Tuple[range, ...]],
                   sizes: Sequence[int]) -> Pending:
    """Send every other member the rows of ``sources[t][:, heads[t][member]]``; receive their rows of mine.

    ``sources``: ``(B, H_t, S_mine, D)``; what arrives from member ``i`` is,
    tensor after tensor, ``(B, w_t, S_i, D)`` (see :func:`_assemble_heads`).
    A member's own rows never travel.
    """
    me, u = comm.rank, len(sizes)
    b = sources[0].shape[0]
    # elements per row of every piece (widths are equal on all members; V's head size may differ from Q's and K's)
    per_row = [b * len(h[me]) * x.shape[-1] for x, h in zip(sources, heads)]
    send_splits = [0 if j == me else sizes[me] * sum(per_row) for j in range(u)]
    recv_splits = [0 if i == me else sizes[i] * sum(per_row) for i in range(u)]
    send = sources[0].new_empty(sum(send_splits))
    at = 0
    for j in range(u):
        if j == me:
            continue
        for x, h in zip(sources, heads):
            d = x.shape[-1]
            n = b * len(h[j]) * sizes[me] * d
            send[at:at + n].view(b, len(h[j]), sizes[me], d).copy_(x[:, h[j].start:h[j].stop])
            at += n
    recv = send.new_empty(sum(recv_splits))
    return comm.post_all_to_all(recv, send, recv_splits, send_splits,
                                "the head-parallel exchange (sequence shards to head shards)")


def _assemble_heads(got: Tensor, sources: Sequence[Tensor], heads: Sequence[Tuple[range, ...]],
                    sizes: Sequence[int], me: int) -> List[Tensor]:
    """Per source, my heads over the group's rows, ``(B, w_t, S_group, D)`` contiguous (the kernels' fastest)."""
    b = sources[0].shape[0]
    offs = _offsets(sizes)
    out = [x.new_empty(b, len(h[me]), offs[-1], x.shape[-1]) for x, h in zip(sources, heads)]
    at = 0
    for i in range(len(sizes)):
        for x, h, o in zip(sources, heads, out):
            rows = o[:, :, offs[i]:offs[i + 1]]
            if i == me:
                rows.copy_(x[:, h[me].start:h[me].stop])
                continue
            d = x.shape[-1]
            n = b * len(h[me]) * sizes[i] * d
            rows.copy_(got[at:at + n].view(b, len(h[me]), sizes[i], d))
            at += n
    return out


def _post_to_rows(comm: RingComm, parts: Sequence[Tensor], sizes: Sequence[int]) -> Pending:
    """Send each other member its rows of ``parts`` ``(B, w_t, S_group, D)``; receive mine of their heads."""
    me, u = comm.rank, len(sizes)
    b = parts[0].shape[0]
    offs = _offsets(sizes)
    per_row = sum(b * p.shape[1] * p.shape[-1] for p in parts)
    send_splits = [0 if j == me else sizes[j] * per_row for j in range(u)]
    recv_splits = [0 if i == me else sizes[me] * per_row for i in range(u)]
    send = parts[0].new_empty(sum(send_splits))
    at = 0
    for j in range(u):
        if j == me:
            continue
        for p in parts:
            d = p.shape[-1]
            n = b * p.shape[1] * sizes[j] * d
            send[at:at + n].view(b, p.shape[1], sizes[j], d).copy_(p[:, :, offs[j]:offs[j + 1]])
            at += n
    recv = send.new_empty(sum(recv_splits))
    return comm.post_all_to_all(recv, send, recv_splits, send_splits,
                                "the head-parallel exchange (head shards to sequence shards)")


def _write_own(parts: Sequence[Tensor], dests: Sequence[Tensor], heads: Sequence[Tuple[range, ...]],
               sizes: Sequence[int], me: int, add: Sequence[bool]) -> None:
    """Write (or add, where members share K/V heads) my rows of my heads' ``parts`` into ``dests``."""
    offs = _offsets(sizes)
    for p, dest, h, summed in zip(parts, dests, heads, add):
        target, piece = dest[:, h[me].start:h[me].stop], p[:, :, offs[me]:offs[me + 1]]
        target.add_(piece) if summed else target.copy_(piece)


def _write_received(got: Tensor, dests: Sequence[Tensor], heads: Sequence[Tuple[range, ...]],
                    sizes: Sequence[int], me: int, add: Sequence[bool]) -> None:
    """Write (or add) the rows of mine every other member sent back for its heads into ``dests``."""
    b = dests[0].shape[0]
    at = 0
    for i in range(len(sizes)):
        if i == me:
            continue
        for dest, h, summed in zip(dests, heads, add):
            d = dest.shape[-1]
            n = b * len(h[i]) * sizes[me] * d
            target, piece = dest[:, h[i].start:h[i].stop], got[at:at + n].view(b, len(h[i]), sizes[me], d)
            target.add_(piece) if summed else target.copy_(piece)
            at += n


@dataclass
class _Setup:
    head_comm: RingComm
    sizes: Tuple[int, ...]
    chunks: List[Chunk]
    rings: List[RingCall]
    shared_kv: bool  # members share K/V heads (hkv < u): their gradients add up


def _chunk_sinks(sinks: Optional[Tensor], heads: range) -> Optional[Tensor]:
    return None if sinks is None else sinks[heads.start:heads.stop]


class _HeadParallelAttention(torch.autograd.Function):
    """The exchange, the attention of every chunk and the exchange back, forward and backward in one node."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], setup: _Setup):
        comm, sizes, me = setup.head_comm, setup.sizes, setup.head_comm.rank
        b, hq, s, _ = q.shape
        out = rows_major(b, hq, s, v.shape[-1], q.dtype, q.device)
        lses: List[Tensor] = []
        heads = lambda c: (c.q, c.kv, c.kv)  # noqa: E731
        incoming = _post_to_heads(comm, (q, k, v), heads(setup.chunks[0]), sizes)
        returning: Optional[Tuple[Chunk, Pending]] = None
        for i, (chunk, ring) in enumerate(zip(setup.chunks, setup.rings)):
            qh, kh, vh = _assemble_heads(incoming.wait()[0], (q, k, v), heads(chunk), sizes, me)
            incoming = None  # its buffer goes before the next chunk's arrives
            if i + 1 < len(setup.chunks):
                incoming = _post_to_heads(comm, (q, k, v), heads(setup.chunks[i + 1]), sizes)
            oh, lse = ring_forward(qh, kh, vh, ring, _chunk_sinks(sinks, chunk.q[me]))
            del qh, kh, vh
            lses.append(lse)
            if returning is not None:
                _write_received(returning[1].wait()[0], [out], [returning[0].q], sizes, me, [False])
            returning = (chunk, _post_to_rows(comm, [oh], sizes))
            _write_own([oh], [out], [chunk.q], sizes, me, [False])
            del oh
        _write_received(returning[1].wait()[0], [out], [returning[0].q], sizes, me, [False])
        ctx.setup = setup
        ctx.save_for_backward(q, k, v, out, sinks, *lses)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor):
        setup = ctx.setup
        comm, sizes, me = setup.head_comm, setup.sizes, setup.head_comm.rank
        q, k, v, out, sinks, *lses = ctx.saved_tensors
        dq, dk, dv = (rows_major(*x.shape, x.dtype, x.device) for x in (q, k, v))
        dsinks = None if sinks is None else torch.zeros_like(sinks)
        sources = (q, k, v, out, dout)
        heads = lambda c: (c.q, c.kv, c.kv, c.q, c.q)  # noqa: E731
        incoming = _post_to_heads(comm, sources, heads(setup.chunks[0]), sizes)
        dests, add = [dq, dk, dv], [False, setup.shared_kv, setup.shared_kv]
        for i, (chunk, ring, lse) in enumerate(zip(setup.chunks, setup.rings, lses)):
            if i:
                incoming = _post_to_heads(comm, sources, heads(chunk), sizes)
            qh, kh, vh, oh, doh = _assemble_heads(incoming.wait()[0], sources, heads(chunk), sizes, me)
            incoming = None
            grads = list(ring_backward(doh, qh, kh, vh, oh, lse, ring))
            if dsinks is not None:
                mine = chunk.q[me]
                dsinks[mine.start:mine.stop] = sinks_backward(doh, oh, lse, sinks[mine.start:mine.stop])
            del qh, kh, vh, oh, doh
            pending = _post_to_rows(comm, grads, sizes)
            _write_own(grads, dests, (chunk.q, chunk.kv, chunk.kv), sizes, me, add)
            del grads
            _write_received(pending.wait()[0], dests, (chunk.q, chunk.kv, chunk.kv), sizes, me, add)
        return dq, dk, dv, dsinks, None


def group_rows(comm: RingComm, rows: Tensor, sizes: Sequence[int]) -> Tensor:
    """A per-row tensor ``(B, S_mine)`` of every member, joined into the group's rows ``(B, S_group)`` (no gradient)."""
    longest = max(sizes)
    padded = rows.new_zeros(rows.shape[0], longest)
    padded[:, :rows.shape[1]] = rows
    parts = comm.all_gather(padded, "the head-parallel exchange of the key padding mask")
    return torch.cat([parts[i, :, :n] for i, n in enumerate(sizes)], dim=1)


def head_parallel(q: Tensor, k: Tensor, v: Tensor, head_comm: RingComm, ring_comm: Optional[RingComm],
                  split: HeadSplit, sizes: Sequence[int], spec: AttentionSpec) -> Tensor:
    """Attention of this rank's rows ``(B, Hq, S_mine, D)`` by head parallelism (and the ring over the groups).

    ``sizes``: the rows each member of the head-parallel group holds;
    ``spec.key_mask`` ``(B, S_group)``: the group's rows (see
    :func:`group_rows`), None when no rank is padded; ``ring_comm``: the ring
    over the groups, None when one group holds the whole sequence. The spec
    is checked and agreed.
    """
    sizes = tuple(int(s) for s in sizes)
    parts = chunks(split)
    ring = ring_comm if ring_comm is not None and ring_comm.world_size > 1 else None
    me = head_comm.rank
    rings = [plan(len(c.q[me]), len(c.kv[me]), ring,
                  spec.at(sinks=None, head_base=spec.head_base + c.q[me].start)) for c in parts]
    setup = _Setup(head_comm, sizes, parts, rings, split.hkv < split.ulysses)
    return _HeadParallelAttention.apply(q, k, v, spec.sinks, setup)
