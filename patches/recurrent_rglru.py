"""RecurrentGemma's RG-LRU runs (:mod:`.recurrent`): a diagonal decay from the layer's gate, zero across a
position 0."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from hf_ring.engine.merge import accumulator_dtype
from hf_ring.integration.context import ShardedForward

from .recurrent_runs import Runs, Scan, by_segment, piece_call, rank_segments

Tensor = torch.Tensor


def rglru_runs(kernel, context: ShardedForward, inputs: List[Tensor], rest: Dict[str, Any], scan: Scan) -> Runs:
    """RG-LRU's diagonal recurrence over ``(B, rows, W)``: ``h_t = a_t h_{t-1} + x_t`` with ``a_t`` zeroed where
    ``reset`` (a position 0); each run from a zero state, its decay per channel and row gives the basis (the
    products of ``a`` from the run's start) and the run's transition (their last)."""
    x, gate, reset = inputs
    acc = accumulator_dtype(x)
    decay = gate.to(acc) * ~reset  # as the kernel multiplies it
    runs = Runs(rank_segments(context, x.shape[1], x.shape[0], kernel))
    call = piece_call(context, x.shape[1], kernel)
    for x_s, gate_s, reset_s, decay_s in by_segment(runs.segments, 1, x, gate, reset, decay):
        out, state = call(x_s, gate_s, reset_s, **{**rest, scan.state: None})
        cum = decay_s.cumprod(1)
        runs.add(out, cum, state.to(acc), cum[:, -1])
    return runs


def rglru_correct(out: Tensor, basis: Tensor, start: Tensor) -> Tensor:
    return (out.to(start.dtype) + basis * start[:, None]).to(out.dtype)


def rglru_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    return out, final.to(rest.get("acc_dtype") or final.dtype)
