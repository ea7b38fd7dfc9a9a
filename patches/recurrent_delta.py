"""The delta rules' runs (gated delta rule, KDA; :mod:`.recurrent`): the basis and the transition from the kernel
itself, run with ``d_k`` extra value channels started at the identity."""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Tuple

import torch

from hf_ring.engine.merge import accumulator_dtype
from hf_ring.engine.recurrence import restarted
from hf_ring.integration.context import ShardedForward

from .recurrent_runs import Runs, Scan, by_segment, piece_call, rank_segments

Tensor = torch.Tensor


def delta_runs(kernel, context: ShardedForward, inputs: List[Tensor], rest: Dict[str, Any], scan: Scan) -> Runs:
    """A delta rule (gated delta rule, KDA) over ``(B, rows, H, d)`` inputs: each segment from a zero state, with
    ``d_k`` extra value channels started at the identity, whose outputs and end state give the basis and the
    transition; a segment every batch row starts a document (or the sequence) at needs neither."""
    q, k, v, g, beta = inputs
    b, rows, heads, dv = v.shape
    dk = k.shape[-1]
    acc = accumulator_dtype(v)
    identity = torch.cat([torch.zeros(b, heads, dk, dv, dtype=acc, device=v.device),
                          torch.eye(dk, dtype=acc, device=v.device).expand(b, heads, dk, dk)], dim=-1)
    runs = Runs(rank_segments(context, rows, b, kernel))
    call = piece_call(context, rows, kernel)
    call_extended = piece_call(context, rows, kernel, fn=functools.partial(_delta_extended, kernel, scan, rest))
    known = None  # in one process: the state the segment before ended in, which the next starts from
    for seg, inputs in zip(runs.segments, by_segment(runs.segments, 1, q, k, v, g, beta)):
        if all(seg.fresh) or known is not None:
            start = None if all(seg.fresh) else restarted(seg, known)
            out, state = call(*inputs, **{scan.state: start, scan.final: True}, **rest)
            runs.add(out, None, state.to(acc), torch.zeros(b, heads, dk, dk, dtype=acc, device=v.device))
            known = state if context.world_size == 1 else None
            continue
        out, basis, state = call_extended(*inputs, identity)
        runs.add(out, basis, state[..., :dv].to(acc), state[..., dv:].to(acc))
    return runs


def _delta_extended(kernel, scan: Scan, rest: Dict[str, Any], q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                    beta: Tensor, identity: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """A delta rule's segment from a zero state with ``d_k`` extra value channels of zero input started at the
    identity: its output, their outputs (the basis) and the end state of both. The extended values are made here
    and the parts come back apart, so a checkpointed call keeps neither the extension nor the whole output."""
    b, rows, heads, dv = v.shape
    extended = torch.cat([v, v.new_zeros(b, rows, heads, k.shape[-1])], dim=-1)
    out, state = kernel(q, k, extended, g, beta, **{scan.state: identity, scan.final: True}, **rest)
    return out[..., :dv].contiguous(), out[..., dv:].contiguous(), state


def delta_correct(out: Tensor, basis: Tensor, start: Tensor) -> Tensor:
    return (out.to(start.dtype) + torch.einsum("blhk,bhkv->blhv", basis.to(start.dtype), start)).to(out.dtype)


def delta_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    return out, (final if want_final else None)
