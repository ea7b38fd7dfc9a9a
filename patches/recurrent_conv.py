"""The hooks of the kernels that mix neighbouring rows (:mod:`.recurrent`): a causal convolution, an ``nn.Conv1d``
module, RWKV's row shift. Each run is convolved after the rows before it, which one all-gather brings."""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from hf_ring.engine.gathers import tied
from hf_ring.engine.recurrence import Segment, halo
from hf_ring.integration.context import ShardedForward

from .recurrent_runs import LayerCall, by_segment, kernel_arguments, piece_call, rank_segments

Tensor = torch.Tensor


def convolution(kernel, call: LayerCall, name: str, *args, **kwargs):
    """A causal depthwise convolution over ``(B, C, rows)``: each segment convolved after the rows before it, those
    of an earlier document zeroed (as the layer's own left padding); in a prefill, the sequence's last rows kept as
    the layer's state, from the same exchange."""
    context = call.context
    call.calls.append(name)
    (x,), rest = kernel_arguments(kernel, args, kwargs, 1)
    if rest.get("seq_idx") is not None or rest.get("initial_states") is not None:
        context.fail(ValueError(f"{name} was given seq_idx or initial_states over sequence shards; packed rows and a "
                                "convolution state to start from are not supported there"))
    width = rest["weight"].shape[-1] - 1
    awaited = (width, call.conv_state) if call.conv_state is not None else context.awaited_conv_state(call.layer_idx)
    return convolved(kernel, context, x, rest, width, awaited)


def convolved(kernel, context: ShardedForward, x: Tensor, rest: Dict[str, Any], width: int,
              awaited: Optional[Tuple[int, Callable[[Tensor], None]]]) -> Tensor:
    """:func:`convolution` once its arguments are read (``kernel(window, **rest)`` for each segment's ``width`` rows
    before it and its rows): ``awaited`` ``(rows, keep)`` is given the sequence's last rows."""
    pieces = context.pieces()
    halos, tail, every = halo(pieces, context.comm, x, width, 0 if awaited is None else awaited[0])
    if awaited is not None:
        awaited[1](tail.detach())
    if context.placeholder:
        return tied(kernel(x, **rest), every)
    convolve = piece_call(context, x.shape[-1], kernel, scan=False)
    segments = rank_segments(context, x.shape[-1], x.shape[0])
    outs, window = [], None
    for i, (seg, (rows,)) in enumerate(zip(segments, by_segment(segments, -1, x))):
        # The rows before a segment: its run's halo, or the last of the window before it in the same run (a slice of
        # that window, not of x: a slice's backward fills a zero tensor of what it was cut from)
        fresh_run = i == 0 or segments[i - 1].run != seg.run
        before = halos[seg.run] if fresh_run else window[..., window.shape[-1] - width:]
        window = torch.cat([before, rows], dim=-1)
        outs.append(convolve(_from_document_start(window, seg, width), **rest)[..., width:])
    return tied(torch.cat(outs, dim=-1), every)


def _from_document_start(window: Tensor, seg: Segment, width: int) -> Tensor:
    """``window`` ``(B, C, width + rows)``: the ``width`` rows before a segment, then its rows; the rows before each
    batch row's document start zeroed, so the convolution reads none of an earlier document."""
    first = seg.start - width  # the global row of the window's first column
    if all(origin <= first for origin in seg.origins):
        return window
    rows = torch.arange(first, seg.start, device=window.device)
    origins = torch.tensor(seg.origins, device=window.device)
    keep = (rows[None, :] >= origins[:, None]).to(window.dtype)[:, None, :]  # (B, 1, width)
    return torch.cat([window[..., :width] * keep, window[..., width:]], dim=-1)


def causal_conv(conv: torch.nn.Conv1d) -> Callable:
    """A depthwise ``nn.Conv1d`` padded ``k - 1`` on both sides whose layer keeps its first outputs (RecurrentGemma's
    ``conv_1d``), as a kernel of :func:`convolution`'s contract: ``(x, weight, bias) -> (B, C, rows)`` for ``x``
    ``(B, C, rows)``, computed by the module's own convolution."""
    if conv.padding != (conv.kernel_size[0] - 1,) or conv.groups != conv.in_channels or conv.stride != (1,) or \
            conv.dilation != (1,):
        raise ValueError(f"{conv} is not a causal depthwise convolution padded kernel_size - 1 rows")

    def kernel(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return conv._conv_forward(x, weight, bias)[..., :x.shape[-1]]

    return kernel


def conv_module(kernel, call: LayerCall, name: str, x: Tensor) -> Tensor:
    """An ``nn.Conv1d``'s forward (``kernel`` the module) over the shards: :func:`convolution` on :func:`causal_conv`.
    Returns the rows' outputs, which the layer's slice of its first ``rows`` outputs keeps whole."""
    return convolution(causal_conv(kernel), call, name, x, weight=kernel.weight, bias=kernel.bias)


def _previous_row(x: Tensor) -> Tensor:
    """Each row of ``x`` ``(B, C, rows)`` replaced by the row before it, zeros before the first: a causal convolution
    of width 2 whose weights are (1, 0)."""
    return F.pad(x, (1, 0))[..., :-1]


def shift(kernel, call: LayerCall, name: str, x: Tensor) -> Tensor:
    """RWKV's time shift (``kernel`` an ``nn.ZeroPad2d((0, 0, 1, -1))``: each row of ``(B, rows, C)`` replaced by the
    one before) over the shards: :func:`convolution` on :func:`_previous_row`, so a run's first row is the row before it
    (zero at a document start); the sequence's last row is kept in ``call.tails``."""
    call.calls.append(name)
    if tuple(kernel.padding) != (0, 0, 1, -1):
        call.context.fail(ValueError(f"{name} pads {tuple(kernel.padding)}, not one row before each (0, 0, 1, -1): "
                                     "not a time shift hf_ring knows over sequence shards"))
    keep = functools.partial(call.tails.__setitem__, name)  # the layer keeps it as its state (hybrids.py)
    out = convolved(_previous_row, call.context, x.transpose(1, 2), {}, 1, (1, keep)).transpose(1, 2)
    given = call.row_states.get(name)
    if given is not None:  # a layer given a state list writes its entry over the first row: the row before this run
        given(out[:, 0])
        if torch.is_grad_enabled():
            out = out.clone()  # written in place there, which autograd forbids on what the exchange's tie returned
    return out
