"""Log-sum-exp merging of partial attention results, and attention sinks joined to a finished result.

Each block of a ring (or a rank's part of a decode step) returns its output and
LSE over the keys it saw; merging by ``L = log Σ exp(L_i)``,
``O = Σ exp(L_i - L)·O_i`` gives exactly the attention over all of them, with
weights that sum to one. Rows no partial saw a key stay ``(0, -inf)``.
"""
from __future__ import annotations

from typing import Tuple

import torch

Tensor = torch.Tensor


def accumulator_dtype(x: Tensor) -> torch.dtype:
    """Partial results and merges run in fp32 whatever the input, fp64 for fp64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def merge_stacked(outs: Tensor, lses: Tensor) -> Tuple[Tensor, Tensor]:
    """Log-sum-exp merge of stacked partial results ``outs`` ``(P, ..., D)``, ``lses`` ``(P, ...)``, out of place.

    ``L = log Σ exp(L_i)``, ``O = Σ exp(L_i - L)·O_i``; rows no partial saw a
    key come out ``(0, -inf)``. :func:`merge_into` is the same rule in place,
    for two partials.
    """
    top = lses.amax(0)
    safe_top = top.masked_fill(torch.isneginf(top), 0.0)
    weights = torch.exp(lses - safe_top)
    total = weights.sum(0)
    merged = (weights.unsqueeze(-1) * outs).sum(0)
    out = merged / torch.where(total == 0, torch.ones_like(total), total).unsqueeze(-1)
    return out, safe_top + torch.log(total)  # log 0 = -inf: no partial saw a key


def merge_into(out: Tensor, lse: Tensor, o_blk: Tensor, l_blk: Tensor) -> None:
    """In-place log-sum-exp merge of one block's result into views of the accumulators.

    ``L = logaddexp(L1, L2)``, ``O = exp(L1-L)·O1 + exp(L2-L)·O2``; rows where
    neither side saw a key stay ``(0, -inf)`` instead of turning NaN.
    """
    new = torch.logaddexp(lse, l_blk)
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    o_blk = o_blk.to(out.dtype) if o_blk.dtype != out.dtype else o_blk
    out.mul_(torch.exp(lse - safe).unsqueeze(-1))
    out.add_(o_blk.mul_(torch.exp(l_blk - safe).unsqueeze(-1)))
    lse.copy_(new)


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tuple[Tensor, Tensor]:
    """Join one sink logit per query head to the softmax denominator, with a zero value vector.

    ``out`` ``(B, H, S, D)`` and ``lse`` ``(B, H, S)`` are a finished (merged)
    attention; returns ``exp(L - L')·out`` and ``L' = logaddexp(L, sink_h)``
    in ``out``'s dtype and fp32 (fp64 for fp64). A row with no key gets 0.
    """
    acc = accumulator_dtype(out)
    sink = sinks.to(device=lse.device, dtype=acc).view(1, -1, 1)
    new = torch.logaddexp(lse.to(acc), sink)
    return (out.to(acc) * torch.exp(lse.to(acc) - new).unsqueeze(-1)).to(out.dtype), new.to(lse.dtype)


def sinks_backward(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Gradient of the sink logits over these rows: ``-Σ_{b,t} exp(sink_h - L') · rowsum(dO·O')``.

    ``out`` and ``lse`` are the results *with* the sinks joined.
    """
    acc = accumulator_dtype(out)
    p_sink = torch.exp(sinks.to(device=lse.device, dtype=acc).view(1, -1, 1) - lse.to(acc))
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    return -(p_sink * delta).sum((0, 2)).to(device=sinks.device, dtype=sinks.dtype)
