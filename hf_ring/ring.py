"""Ring attention: K/V rotate rank to rank, partial results merge by log-sum-exp.

Forward: at step ``s`` rank ``r`` holds the K/V shard of rank ``r - s``; the
next shard's transfer is posted before the current one is used, so
communication overlaps compute. Backward walks the same ring: dQ stays home,
dK/dV travel with their shard and are handed back to its owner at the end.
Each block's backward uses the merged output and LSE, so gradients are exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .blocks import Block, RingPlan, ring_plan, split_block
from .comm import RingComm
from .kernels import block_backward, block_forward, default_scale
from .layout import check_layout, infer_seq_len, local_positions, shard_sizes

Tensor = torch.Tensor


def _block_mask(blk: Block, q_pos: Tensor, k_pos: Tensor, window: Optional[int]) -> Tensor:
    qp = q_pos[blk.q0 : blk.q0 + blk.nq, None]
    kp = k_pos[None, blk.k0 : blk.k0 + blk.nk]
    keep = kp <= qp
    if window is not None:
        keep &= kp > qp - window
    return keep


@dataclass
class _Ctx:
    comm: Optional[RingComm]
    plan: RingPlan
    layout: str
    scale: float
    causal: bool
    window: Optional[int]
    positions: dict = field(default_factory=dict)  # rank -> its global positions, built on demand


def _positions(ctx: _Ctx, rank: int, device) -> Tensor:
    cached = ctx.positions.get(rank)
    if cached is None:
        cached = local_positions(ctx.plan.seq_len, rank, ctx.plan.world_size, ctx.layout).to(device)
        ctx.positions[rank] = cached
    return cached


def _kernel_args(ctx: _Ctx, blk: Block, step: int, device):
    if blk.kind != "mask":
        return {"causal": blk.kind == "causal", "mask": None}
    q_pos = _positions(ctx, ctx.plan.rank, device)
    k_pos = _positions(ctx, ctx.plan.source(step), device)
    return {"causal": False, "mask": _block_mask(blk, q_pos, k_pos, ctx.window)}


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rows(x: Tensor, start: int, n: int) -> Tensor:
    return x[:, :, start : start + n]


BACKWARD_TILE = 1024
"""Rows per side of the tiles the backward works on; bounds its temporaries."""


def _merge_into(out: Tensor, lse: Tensor, blk: Block, o_blk: Tensor, l_blk: Tensor) -> None:
    """In-place log-sum-exp merge of one block's result into the accumulators' rows."""
    sl = slice(blk.q0, blk.q0 + blk.nq)
    o_acc, l_acc = out[:, :, sl], lse[:, :, sl]
    new = torch.logaddexp(l_acc, l_blk)
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    o_blk = o_blk.to(out.dtype) if o_blk.dtype != out.dtype else o_blk
    o_acc.mul_(torch.exp(l_acc - safe).unsqueeze(-1))
    o_acc.add_(o_blk.mul_(torch.exp(l_blk - safe).unsqueeze(-1)))
    l_acc.copy_(new)


def _kv_like(plan: RingPlan, step: int, k: Tensor, dtype: torch.dtype):
    """Shapes of the K/V-sized tensors that arrive for ``step``."""
    b, h, _, d = k.shape
    return [(torch.Size((b, h, plan.shard_sizes[plan.source(step)], d)), dtype)] * 2


def ring_forward(q: Tensor, k: Tensor, v: Tensor, ctx: _Ctx) -> Tuple[Tensor, Tensor]:
    plan, comm = ctx.plan, ctx.comm
    b, hq, s, d = q.shape
    only = plan.steps[0][0] if plan.num_steps == 1 and len(plan.steps[0]) == 1 else None
    if only is not None and only.nq == s and only.nk == k.shape[2]:
        # One block covers everything (one process, no window): the kernel's result is final.
        return block_forward(q, k, v, scale=ctx.scale, **_kernel_args(ctx, only, 0, q.device))
    out = torch.zeros(b, hq, s, d, dtype=_acc_dtype(q), device=q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=torch.float32, device=q.device)
    kv = (k, v)
    for step in range(plan.num_steps):
        pending = None
        if step + 1 < plan.num_steps:
            pending = comm.exchange(kv, comm.next, _kv_like(plan, step + 1, k, k.dtype), comm.prev, tag=0)
        for blk in plan.steps[step]:
            o_blk, l_blk = block_forward(
                _rows(q, blk.q0, blk.nq), _rows(kv[0], blk.k0, blk.nk), _rows(kv[1], blk.k0, blk.nk),
                scale=ctx.scale, **_kernel_args(ctx, blk, step, q.device),
            )
            _merge_into(out, lse, blk, o_blk, l_blk)
        if pending is not None:
            kv = tuple(pending.wait())
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, ctx: _Ctx) -> Tuple[Tensor, Tensor, Tensor]:
    plan, comm = ctx.plan, ctx.comm
    acc = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = (k, v)
    pending_dkv = None
    for step in range(plan.num_steps):
        pending_kv = None
        if step + 1 < plan.num_steps:
            pending_kv = comm.exchange(kv, comm.next, _kv_like(plan, step + 1, k, k.dtype), comm.prev, tag=0)
        if pending_dkv is None:
            dk = torch.zeros(kv[0].shape, dtype=acc, device=q.device)
            dv = torch.zeros_like(dk)
        else:
            # Accumulate straight into the partial sums that arrived with this shard.
            dk, dv = pending_dkv.wait()
        for big in plan.steps[step]:
            for blk in split_block(big, BACKWARD_TILE, ctx.causal, ctx.window):
                qs, ks = slice(blk.q0, blk.q0 + blk.nq), slice(blk.k0, blk.k0 + blk.nk)
                dq_b, dk_b, dv_b = block_backward(
                    dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs], lse[:, :, qs],
                    scale=ctx.scale, **_kernel_args(ctx, blk, step, q.device),
                )
                dq[:, :, qs] += dq_b
                dk[:, :, ks] += dk_b
                dv[:, :, ks] += dv_b
                del dq_b, dk_b, dv_b
        if plan.num_steps == 1:
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        last = step + 1 == plan.num_steps
        if last:
            kv = None  # free the visiting shard before its gradient's buffers arrive
        # The last hop hands each shard's gradient straight back to its owner.
        send_to = plan.source(step) if last else comm.next
        recv_from = (plan.rank + step) % plan.world_size if last else comm.prev
        like = _kv_like(plan, 0 if last else step + 1, k, acc)
        pending_dkv = comm.exchange((dk, dv), send_to, like, recv_from, tag=2)
        del dk, dv
        if pending_kv is not None:
            kv = tuple(pending_kv.wait())
    dk, dv = pending_dkv.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves ``(q, k, v, out, lse)`` and runs the ring backward."""

    @staticmethod
    def forward(ctx, q, k, v, rctx: _Ctx):
        out, lse = ring_forward(q, k, v, rctx)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rctx = rctx
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.rctx)
        return dq, dk, dv, None


# ---------------------------------------------------------------- validation


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got q={q.device}, k={k.device}, v={v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k={tuple(k.shape)}, v={tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch size differs: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head_dim differs: q has {q.shape[3]}, k/v have {k.shape[3]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q has {q.shape[2]} local rows but k/v have {k.shape[2]}; ring attention needs each rank's "
            "own rows of q, k and v (for decoding with a cache use hf_ring.generation)"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )


def _check_window(window, causal: bool) -> Optional[int]:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window must be a positive int or None, got {window!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1 (query t sees keys t-window < k <= t), got {window}")
    if not causal:
        raise ValueError("window is a causal sliding window; pass causal=True with window")
    return window


def _resolve_group(group) -> Optional[RingComm]:
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
    elif not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group was given but torch.distributed is not initialised; call init_process_group first")
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the given group; "
            "call ring_attention only on the group's ranks"
        )
    return RingComm(group)


def resolve_seq_len(comm: Optional[RingComm], local_len: int, seq_len: Optional[int], layout: str) -> int:
    """The global length, checked against every rank's shard size.

    One all-gather of a single integer per rank per call: every rank sees the
    same sizes, so a mismatch raises the same error on all of them instead of
    leaving some waiting in the ring.
    """
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0):
        raise ValueError(f"seq_len must be a non-negative int or None, got {seq_len!r}")
    if comm is None or comm.world_size == 1:
        if seq_len is not None and seq_len != local_len:
            raise ValueError(f"seq_len={seq_len} but this single process holds {local_len} rows")
        return local_len
    lens = comm.all_gather_ints(local_len, "the shard-size check")
    if seq_len is None:
        return infer_seq_len(lens, layout)
    expected = shard_sizes(seq_len, comm.world_size, layout)
    if lens != expected:
        raise ValueError(
            f"seq_len={seq_len} with layout={layout!r} over {comm.world_size} ranks needs shard sizes "
            f"{expected}, but the ranks hold {lens}; shard with hf_ring.local_positions"
        )
    return seq_len


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
    seq_len: Optional[int] = None,
    causal: bool = True,
    window: Optional[int] = None,
    pattern=None,
    scale: Optional[float] = None,
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    ``q`` is ``(B, Hq, S_local, D)``, ``k``/``v`` are ``(B, Hkv, S_local, D)``
    holding this rank's rows in ``local_positions`` order; returns this rank's
    rows of the output, ``(B, Hq, S_local, D)``. ``window=W`` lets query t see
    keys ``t-W < k <= t``. ``pattern`` selects dilated attention
    (:class:`hf_ring.DilatedPattern`); ``None`` is exact dense attention.
    Without a group and without torch.distributed it runs as one process.
    """
    _check_qkv(q, k, v)
    check_layout(layout)
    window = _check_window(window, causal)
    if scale is None:
        scale = default_scale(q.shape[-1])
    comm = _resolve_group(group)
    if pattern is not None:
        from .dilated import dilated_attention

        return dilated_attention(q, k, v, comm=comm, layout=layout, seq_len=seq_len, causal=causal,
                                 window=window, pattern=pattern, scale=scale)
    n = resolve_seq_len(comm, q.shape[2], seq_len, layout)
    rank, world = (0, 1) if comm is None else (comm.rank, comm.world_size)
    plan = ring_plan(n, rank, world, layout if world > 1 else "contiguous", bool(causal), window)
    rctx = _Ctx(comm, plan, layout if world > 1 else "contiguous", float(scale), bool(causal), window)
    return RingAttentionFunction.apply(q, k, v, rctx)
