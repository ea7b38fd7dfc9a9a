"""Head parallelism (Ulysses), alone or inside the ring (USP): sequence shards become head shards and back.

The sequence-parallel ranks form head-parallel groups of ``u`` consecutive
ranks, each member holding a contiguous piece of its group's ring shard (see
:mod:`hf_ring.layout`). One all-to-all per layer turns every member's
``(all heads, its rows)`` into ``(its heads, the group's rows)``; attention then
runs over the group's rows for those heads, as the ring over the ``p/u``
groups, or alone when ``u = p``. A second all-to-all takes the output back to
``(all heads, its rows)``, and the backward makes the same two exchanges in
reverse. Nothing else changes: causality, windows, dilation, documents,
padding, soft-capping and sinks are the ring's, read from global positions
and global head indices, so every mode computes the same attention.

Each member sends ``(u-1)/u`` of its Q, K, V and output rows: the exchange
moves ``2·(Hq + Hkv)·S_local·D`` numbers per rank per layer forward, whatever
``u``, where the ring moves K/V around the whole ring. K/V heads fewer than
``u`` (grouped-query attention) are repeated only as far as ``u`` needs: each
member gets the one K/V head its query heads use.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch.autograd.function import once_differentiable

from .comm import RingComm
from .layout import HeadSplit
from .ring import run
from .spec import AttentionSpec

Tensor = torch.Tensor


def _to_heads(comm: RingComm, parts: Sequence[Tensor], sizes: Sequence[int]) -> List[Tensor]:
    """``(B, u·w, S_mine, D)`` tensors to ``(B, w, S_group, D)``: member ``i`` gets head block ``i`` of every rank's rows."""
    u, mine = len(sizes), sizes[comm.rank]
    b, d = parts[0].shape[0], parts[0].shape[-1]
    widths = [p.shape[1] // u for p in parts]
    total_w = sum(widths)
    send = parts[0].new_empty(u, mine, b, total_w, d)  # piece i: the rows of this rank, head block i of every part
    at = 0
    for p, w in zip(parts, widths):
        send[:, :, :, at:at + w] = p.view(b, u, w, mine, d).permute(1, 3, 0, 2, 4)
        at += w
    recv = send.new_empty(sum(sizes), b, total_w, d)  # rows of member i arrive as rows sizes[:i]..
    comm.all_to_all(recv, send.view(u * mine, b, total_w, d), sizes, [mine] * u,
                    "the head-parallel exchange (sequence shards to head shards)")
    out, at = [], 0
    for w in widths:
        out.append(recv[:, :, at:at + w].permute(1, 2, 0, 3))  # (B, w, S_group, D), rows-major storage
        at += w
    return out


def _to_rows(comm: RingComm, parts: Sequence[Tensor], sizes: Sequence[int]) -> List[Tensor]:
    """``(B, w, S_group, D)`` tensors back to ``(B, u·w, S_mine, D)``: the inverse of :func:`_to_heads`."""
    u, mine = len(sizes), sizes[comm.rank]
    b, d = parts[0].shape[0], parts[0].shape[-1]
    widths = [p.shape[1] for p in parts]
    total_w = sum(widths)
    send = parts[0].new_empty(sum(sizes), b, total_w, d)
    at = 0
    for p, w in zip(parts, widths):
        send[:, :, at:at + w] = p.permute(2, 0, 1, 3)
        at += w
    recv = send.new_empty(u * mine, b, total_w, d)
    comm.all_to_all(recv, send, [mine] * u, sizes, "the head-parallel exchange (head shards to sequence shards)")
    got = recv.view(u, mine, b, total_w, d)
    out, at = [], 0
    for w in widths:
        # (B, S_mine, u, w, D) storage: the (B, S, H·D) order the model reads, so its reshape is a view.
        whole = got.new_empty(b, mine, u, w, d)
        whole.copy_(got[:, :, :, at:at + w].permute(2, 1, 0, 3, 4))
        out.append(whole.view(b, mine, u * w, d).transpose(1, 2))
        at += w
    return out


class _HeadExchange(torch.autograd.Function):
    """One all-to-all of several tensors at once; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, comm: RingComm, sizes: Tuple[int, ...], to_heads: bool, *parts: Tensor):
        ctx.comm, ctx.sizes, ctx.to_heads = comm, sizes, to_heads
        out = (_to_heads if to_heads else _to_rows)(comm, parts, sizes)
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in out]
        return tuple(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: Optional[Tensor]):
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                 for g, (shape, dtype, device) in zip(grads, ctx.shapes)]
        back = (_to_rows if ctx.to_heads else _to_heads)(ctx.comm, grads, ctx.sizes)
        return (None, None, None, *back)


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
    index = split.kv_index()
    if index is not None:
        index = index.to(k.device)
        k, v = k.index_select(1, index), v.index_select(1, index)
    qh, kh, vh = _HeadExchange.apply(head_comm, sizes, True, q, k, v)
    heads = split.q_heads(head_comm.rank)
    sinks = None if spec.sinks is None else spec.sinks[heads.start:heads.stop]
    ring = ring_comm if ring_comm is not None and ring_comm.world_size > 1 else None
    out = run(qh, kh, vh, ring, spec.at(sinks=sinks, head_base=spec.head_base + heads.start))
    (back,) = _HeadExchange.apply(head_comm, sizes, False, out)
    return back
