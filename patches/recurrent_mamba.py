"""Mamba2's and Mamba's runs (:mod:`.recurrent`): decays computed from the layer's own ``dt``, ``A`` and ``C``; a
Mamba run's end state read through the kernel's output."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from hf_ring.engine.merge import accumulator_dtype
from hf_ring.engine.recurrence import restarted
from hf_ring.integration.context import ShardedForward

from .recurrent_runs import Runs, Scan, by_segment, piece_call, rank_segments

Tensor = torch.Tensor


def _step_size(dt: Tensor, bias: Optional[Tensor], softplus: bool, acc: torch.dtype) -> Tensor:
    """A Mamba layer's step from its ``dt``, as its kernel computes it (bias added, then softplus)."""
    step = dt.to(acc) if bias is None else dt.to(acc) + bias.to(acc)
    return F.softplus(step) if softplus else step


def mamba2_runs(kernel, context: ShardedForward, inputs: List[Tensor], rest: Dict[str, Any], scan: Scan) -> Runs:
    """Mamba2's chunked scan over ``(B, rows, H, P)``: each run from a zero state; its decay per head and row, from
    the layer's own ``dt``, gives the basis and the run's transition."""
    x, dt, A, B, C = inputs
    heads = x.shape[2]
    acc = accumulator_dtype(x)
    low, high = rest.get("dt_limit", (0.0, float("inf")))
    step = _step_size(dt, rest.get("dt_bias"), bool(rest.get("dt_softplus")), acc)
    log_decay = A.to(acc) * torch.clamp(step, min=low, max=high)  # (B, rows, H)
    query = C.to(acc).repeat_interleave(heads // C.shape[2], dim=2)  # (B, rows, H, N)
    runs = Runs(rank_segments(context, x.shape[1], x.shape[0], kernel))
    call = piece_call(context, x.shape[1], kernel)
    known = None  # in one process: the state the segment before ended in, which the next starts from
    for seg, (x_s, dt_s, b_s, c_s, decay_s, query_s) in zip(
            runs.segments, by_segment(runs.segments, 1, x, dt, B, C, log_decay, query)):
        start = None if known is None or all(seg.fresh) else restarted(seg, known)
        out, state = call(x_s, dt_s, A, b_s, c_s, **{scan.state: start, scan.final: True}, **rest)
        known = state if context.world_size == 1 else None
        if known is not None:  # its start is known: it needs no correction
            runs.add(out, None, state.to(acc), torch.zeros_like(log_decay[:, 0]))
            continue
        cum = decay_s.cumsum(1)
        runs.add(out, cum.exp()[..., None] * query_s, state.to(acc), cum[:, -1].exp())
    return runs


def mamba2_correct(out: Tensor, basis: Tensor, start: Tensor) -> Tensor:
    return (out.to(start.dtype) + torch.einsum("blhn,bhpn->blhp", basis, start)).to(out.dtype)


NO_STEP = -1e4
"""A step input whose softplus is exactly 0 in float32 and float64 (and whose gradient is 0): a row that moves no
state."""


def _state_probes(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, rest: Dict[str, Any]) -> Tuple[Tensor, ...]:
    """A selective scan's segment ``(B, D, rows)`` with one row appended per state channel, whose outputs are the
    segment's end state: no input (``x`` and ``B`` zero), no step (``dt`` made 0 after the bias and softplus) and
    ``C`` the channel's unit vector. The state is then read through the kernel's output, which every
    implementation differentiates; mamba-ssm's ``selective_scan_fn`` returns an end state whose gradient it drops."""
    probes = B.shape[-2]
    bias = rest.get("delta_bias")
    if rest.get("delta_softplus"):
        no_step = dt.new_full((*dt.shape[:-1], probes), NO_STEP)
    elif bias is not None:
        no_step = (-bias.to(dt.dtype))[None, :, None].expand(*dt.shape[:-1], probes)
    else:
        no_step = dt.new_zeros(*dt.shape[:-1], probes)
    unit = torch.eye(probes, dtype=C.dtype, device=C.device).expand(*C.shape[:-1], probes)
    return (torch.cat([x, x.new_zeros(*x.shape[:-1], probes)], dim=-1), torch.cat([dt, no_step], dim=-1),
            torch.cat([B, B.new_zeros(*B.shape[:-1], probes)], dim=-1), torch.cat([C, unit], dim=-1))


def mamba_runs(kernel, context: ShardedForward, inputs: List[Tensor], rest: Dict[str, Any], scan: Scan) -> Runs:
    """Mamba's selective scan over ``(B, D, rows)``: each run from a zero state and ungated (the gate ``z`` is
    applied once the runs are corrected), its end state read by :func:`_state_probes`; its decay per channel, state
    and row, from the layer's own ``dt``, gives the basis and the run's transition."""
    x, dt, A, B, C = inputs
    acc = accumulator_dtype(x)
    bias = rest.get("delta_bias")
    step = _step_size(dt, None if bias is None else bias[..., None], bool(rest.get("delta_softplus")), acc)
    ungated = {**rest, "z": None}
    runs = Runs(rank_segments(context, x.shape[-1], x.shape[0], kernel))
    call = piece_call(context, x.shape[-1], kernel)
    for x_s, dt_s, b_s, c_s, step_s in by_segment(runs.segments, -1, x, dt, B, C, step):
        x_p, dt_p, b_p, c_p = _state_probes(x_s, dt_s, b_s, c_s, rest)
        got = call(x_p, dt_p, A, b_p, c_p, **ungated)
        probed = got[0] if isinstance(got, tuple) else got
        out, state = probed[..., :x_s.shape[-1]], probed[..., x_s.shape[-1]:]
        cum = (A.to(acc)[None, :, None, :] * step_s[..., None]).cumsum(2)  # (B, D, rows, N)
        runs.add(out, (c_s, cum), state.to(acc), cum[:, :, -1].exp())
    return runs


def mamba_correct(out: Tensor, basis: Tuple[Tensor, Tensor], start: Tensor) -> Tensor:
    query, cum = basis
    return (out.to(start.dtype) + torch.einsum("bnt,bdtn,bdn->bdt", query.to(start.dtype), cum.exp(), start)).to(
        out.dtype)


def mamba2_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    return (out, final) if want_final else out


def mamba_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    z = rest.get("z")
    gated = out if z is None else out * F.silu(z)
    return (gated, final) if want_final else gated
