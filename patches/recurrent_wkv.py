"""RWKV's WKV runs (:mod:`.recurrent`): a numerator and a denominator per channel, composed in float64, and a run
that does not start the sequence rerun from its true start."""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, List

import torch

from hf_ring.integration.context import ShardedForward

from .recurrent_runs import Runs, Scan, by_segment, rank_segments

Tensor = torch.Tensor


WKV_EMPTY = -1e38
"""The log scale of an empty WKV state, as transformers' kernel starts one (its ratio and weight are zero)."""


def _wkv_linear(state: List[Tensor]) -> Tensor:
    """A WKV state as the kernel keeps it (ratio ``num / e^max``, weight ``den / e^max`` and the log scale ``max``,
    each ``(B, C)``) as ``(B, 2, C)``: its numerator and denominator, in float64, where they compose linearly (float32
    would overflow at ``e^89``; float64 holds ``e^709``)."""
    num, den, scale = (t.double() for t in state)
    weight = scale.clamp(min=-745.0).exp()
    return torch.stack([num * weight, den * weight], dim=1)


def _wkv_state(linear: Tensor, dtype: torch.dtype) -> List[Tensor]:
    """A numerator and denominator ``(B, 2, C)`` as the kernel keeps them: their ratio, a weight of 1 and the log of
    the denominator (an empty state where the denominator is zero)."""
    num, den = linear.unbind(1)
    some = den > 0
    safe = torch.where(some, den, torch.ones_like(den))
    ratio = torch.where(some, num / safe, torch.zeros_like(num))
    scale = torch.where(some, safe.log(), torch.full_like(den, WKV_EMPTY))
    return [ratio.to(dtype), some.to(dtype), scale.to(dtype)]


def wkv_runs(kernel, context: ShardedForward, inputs: List[Tensor], rest: Dict[str, Any], scan: Scan) -> Runs:
    """RWKV's WKV over ``(B, rows, C)``: a numerator and a denominator per channel, each decayed by ``e^w`` per row
    (``w = -exp(time_decay)``), and an output that is their ratio (with the current row weighted ``e^{u + k}``), so a
    start state cannot be added to a run's output afterwards. Each segment runs from an empty state for its end
    state; one that does not start the sequence (or, per batch row, a document) runs again from its true start,
    given as the kernel's ``state``. The transition is ``e^{w · rows}`` per channel."""
    time_decay, time_first, key, value = inputs
    given = rest.pop("state", None)
    if given is not None and bool(torch.stack([given[0], given[1]]).any()):
        context.fail(ValueError("the WKV kernel over sequence shards was given a state to start from: a sharded "
                                "forward starts from an empty state"))
    rest[_GIVEN] = given is not None
    kernel = wkv_kernel(kernel, torch.is_grad_enabled())
    log_decay = -time_decay.double().exp()  # (C,)
    b = key.shape[0]
    runs = Runs(rank_segments(context, key.shape[1], b))  # the kernel is linear in its rows: each run whole
    for seg, (k_s, v_s) in zip(runs.segments, by_segment(runs.segments, 1, key, value)):
        out, state = kernel(time_decay, time_first, k_s, v_s, state=None, return_state=True)
        again = None if all(seg.fresh) else functools.partial(_wkv_from, kernel, time_decay, time_first, k_s, v_s)
        runs.add(out, again, _wkv_linear(state), (log_decay * seg.length).exp().expand(b, 1, -1))
    return runs


def wkv_kernel(kernel: Callable, gradients: bool) -> Callable:
    """The WKV function the runs call: ``kernel``, or under ``gradients`` its modeling module's torch path where that
    module has loaded transformers' CUDA kernel, whose backward passes no gradient to a start or an end state and
    computes the others as if the run started from zero (right in one process, where no run starts elsewhere)."""
    module = sys.modules.get(getattr(kernel, "__module__", None) or "")
    torch_path = getattr(module, "rwkv_linear_attention_cpu", None)
    if gradients and torch_path is not None and getattr(module, "rwkv_cuda_kernel", None) is not None:
        return torch_path
    return kernel


def _wkv_from(kernel, time_decay: Tensor, time_first: Tensor, key: Tensor, value: Tensor, start: Tensor) -> Tensor:
    out, _ = kernel(time_decay, time_first, key, value, state=_wkv_state(start, torch.float32), return_state=False)
    return out


_GIVEN = "_state_given"
"""Where :func:`wkv_runs` tells :func:`wkv_finish` that the layer passed a (zero) state, which the kernel then
returns."""


def wkv_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    return out, (_wkv_state(final, torch.float32) if want_final or rest.get(_GIVEN) else None)
