"""Hooks that compute a hybrid's recurrent kernels exactly over the sequence shards, one per kind of kernel.

Each hook is called as the kernel it stands for, with the forward's context
bound by :mod:`.hybrids` for one decoder layer's call, and runs that kernel on
each of the rank's runs (:meth:`hf_ring.engine.recurrence.Pieces.local`):

- a convolution gets the rows before each run
  (:func:`hf_ring.engine.recurrence.halo`);
- a scan (:class:`Scan`: the delta rules, gated or KDA; Mamba2's chunked scan;
  Mamba's selective scan) starts each run from zero, and one carry step shared
  by every kind (:func:`_carry`) exchanges the runs' end states and
  transitions, composes them into the state each run truly starts from
  (:func:`hf_ring.engine.recurrence.carried`) and corrects each run's output
  for it by a term linear in that state. What differs by kind is how a run
  yields its transition and its output's basis: the delta rules run their own
  kernel once with ``d_k`` extra value channels of zero input started at the
  identity, whose outputs and end state are the basis and the transition;
  Mamba2 and Mamba decay by a scalar per head or a diagonal, computed from the
  layer's own ``dt``;
- a kernel fusing the convolution and the scan (mamba-ssm's
  ``mamba_split_conv1d_scan_combined``, ``mamba_inner_fn``) is declined, so
  the layer takes its split path through the other hooks.

States and corrections are kept in float32, float64 for float64 inputs.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hf_ring.engine.gathers import gather, tied
from hf_ring.engine.merge import accumulator_dtype
from hf_ring.engine.recurrence import Segment, carried, fold, halo, keeps, restarted, segment_starts, segments
from hf_ring.integration.context import CONTEXT_KEY, ShardedForward
from hf_ring.integration.seams import kernel_implementation
from hf_ring.versions import parse

Tensor = torch.Tensor

CONV, DELTA, MAMBA2, MAMBA, FUSED = "convolution", "delta rule", "Mamba2 scan", "Mamba scan", "fused"
RGLRU, CONV_MODULE, LIGHTNING = "RG-LRU scan", "convolution module", "lightning attention"
SHIFT, WKV = "time shift", "WKV"


@dataclass
class LayerCall:
    """One layer's call over the shards of ``context``, as the hooks on its kernels see it: ``layer_idx`` (as the
    cache counts layers; None: not known) and the kernels it called, by name."""

    context: ShardedForward
    layer_idx: Optional[int] = None
    calls: List[str] = field(default_factory=list)
    conv_state: Optional[Callable[[Tensor], None]] = None  # given the sequence's last convolution input rows, if set
    tails: Dict[str, Tensor] = field(default_factory=dict)  # a row shift's last input row of the sequence, by name
    row_states: Dict[str, Callable[[Tensor], None]] = field(default_factory=dict)  # sets the state a row shift's
    # layer reads its first row from, by the shift's name (RWKV given a state list)


def hooked(kind: str, kernel: Callable, call: Any, name: Optional[str] = None) -> Callable:
    """``kernel`` (a convolution, delta rule, Mamba2 or Mamba scan: ``kind``) computed over the shards of ``call``
    (a :class:`LayerCall`, or a forward's context for a call of its own), called as the kernel is, and recorded
    in ``call.calls`` by ``name``."""
    call = call if isinstance(call, LayerCall) else LayerCall(call)
    return functools.partial(_HOOKS[kind], kernel, call, name or kind)


def _arguments(fn: Callable, args: tuple, kwargs: dict, leading: int) -> Tuple[List[Any], Dict[str, Any]]:
    """A kernel call's first ``leading`` arguments (by position: transformers' torch paths, flash-linear-attention
    and mamba-ssm name them differently) and the others by name, defaults filled, its ``**kwargs`` merged in."""
    signature = inspect.signature(fn)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    found = dict(bound.arguments)
    for name, p in signature.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            found.update(found.pop(name, {}))
    found.pop(CONTEXT_KEY, None)  # a mixer that hands its keyword arguments on passes the context bound here
    names = list(signature.parameters)[:leading]
    return [found.pop(n) for n in names], found


LINEAR_KERNELS = ("fla.", "mamba_ssm.")
"""Modules whose scan kernels are linear in their rows (flash-linear-attention's, mamba-ssm's): run whole."""


def _linear(kernel: Optional[Callable]) -> bool:
    """Whether ``kernel`` runs one of :data:`LINEAR_KERNELS`: itself, or as the package function transformers
    resolved its kernel name to at import (:func:`hf_ring.integration.seams.kernel_implementation`)."""
    return kernel is None or getattr(kernel_implementation(kernel), "__module__", "").startswith(LINEAR_KERNELS)


PACKAGE_FLOORS: Dict[str, Tuple[str, str, str]] = {
    "fla.ops.kda.": ("0.5.2", "flash-linear-attention", "its KDA returned a wrong gradient for the state a run starts "
                     "from before 0.5.2 (fla-org/flash-linear-attention#1115), and the hooks start runs from given "
                     "states"),
}
"""Kernel packages' releases the hooks cannot run on, by the kernel's module: (first good release, distribution,
why)."""


def package_problem(kernel: Callable) -> Optional[str]:
    """Why the package function behind ``kernel`` (:func:`hf_ring.integration.seams.kernel_implementation`) cannot
    run under the hooks (a release below :data:`PACKAGE_FLOORS`), or None."""
    found = kernel_implementation(kernel)
    module = getattr(found, "__module__", None) or ""
    for prefix, (floor, distribution, why) in PACKAGE_FLOORS.items():
        if module.startswith(prefix):
            version = getattr(sys.modules.get(module.split(".")[0]), "__version__", None)
            if version is None or parse(version) < parse(floor):
                return (f"{module}.{getattr(found, '__name__', found)} comes from {distribution} {version}: {why}; "
                        f"install {distribution}>={floor}, or run the model in one process")
    return None


def _segments(context: ShardedForward, rows: int, batch: int, kernel: Optional[Callable] = None) -> List[Segment]:
    """What this rank runs, one kernel call each: its runs cut at document starts (:func:`segments`), and for a scan
    ``kernel`` every ``context.scan_rows`` rows, unless it is one of :data:`LINEAR_KERNELS` (transformers' torch
    paths are not linear: :data:`hf_ring.engine.recurrence.SCAN_ROWS`); a placeholder row is run as it is, from
    zero (nothing reads it)."""
    if context.placeholder:
        return [Segment(0, 0, rows, 0, (0,) * batch)]
    return segments(context.pieces(), context.documents, batch, limit=None if _linear(kernel) else context.scan_rows)


def _piece_call(context: ShardedForward, rows: int, kernel: Callable, scan: bool = True,
                fn: Optional[Callable] = None) -> Callable:
    """How ``kernel`` (or ``fn``, which calls it) is called on each segment of this rank's ``rows``: as it is, or,
    over more rows than ``context.scan_rows`` with gradients on, checkpointed, so that what it keeps for the backward
    beyond its inputs
    (a scan's several row-sized tensors per head, a convolution's output before its activation) exists for one
    segment at a time, recomputed in the backward. ``scan``: a scan kernel, whose :data:`LINEAR_KERNELS` run whole
    and keep little, so they are called as they are."""
    fn = kernel if fn is None else fn
    long = context.scan_rows is not None and rows > context.scan_rows and torch.is_grad_enabled()
    if not long or (scan and _linear(kernel)):
        return fn
    return functools.partial(checkpoint, fn, use_reentrant=False)


def _conv(kernel, call: LayerCall, name: str, *args, **kwargs):
    """A causal depthwise convolution over ``(B, C, rows)``: each segment convolved after the rows before it, those
    of an earlier document zeroed (as the layer's own left padding); in a prefill, the sequence's last rows kept as
    the layer's state, from the same exchange."""
    context = call.context
    call.calls.append(name)
    (x,), rest = _arguments(kernel, args, kwargs, 1)
    if rest.get("seq_idx") is not None or rest.get("initial_states") is not None:
        context.fail(ValueError(f"{name} was given seq_idx or initial_states over sequence shards; packed rows and a "
                                "convolution state to start from are not supported there"))
    width = rest["weight"].shape[-1] - 1
    awaited = (width, call.conv_state) if call.conv_state is not None else context.awaited_conv_state(call.layer_idx)
    return _convolved(kernel, context, x, rest, width, awaited)


def _convolved(kernel, context: ShardedForward, x: Tensor, rest: Dict[str, Any], width: int,
               awaited: Optional[Tuple[int, Callable[[Tensor], None]]]) -> Tensor:
    """:func:`_conv` once its arguments are read: ``awaited`` ``(rows, keep)`` is given the sequence's last rows."""
    pieces = context.pieces()
    halos, tail, every = halo(pieces, context.comm, x, width, 0 if awaited is None else awaited[0])
    if awaited is not None:
        awaited[1](tail.detach())
    if context.placeholder:
        return tied(kernel(x, **rest), every)
    runs = pieces.local()
    extended = [torch.cat([before, x[..., o:o + n]], dim=-1) for (o, n), before in zip(runs, halos)]
    convolve = _piece_call(context, x.shape[-1], kernel, scan=False)
    outs = []
    for seg in _segments(context, x.shape[-1], x.shape[0]):
        at = seg.offset - runs[seg.run][0]
        window = extended[seg.run][..., at:at + width + seg.length]
        outs.append(convolve(_from_document_start(window, seg, width), **rest)[..., width:])
    return tied(torch.cat(outs, dim=-1), every)


def _by_segment(segments: List[Segment], dim: int, *tensors: Tensor) -> List[Tuple[Tensor, ...]]:
    """Each of ``tensors``' rows (along ``dim``) of each segment. One split per tensor where the segments tile its
    rows in order (they do: a rank's runs, cut): a split's backward joins the pieces' gradients once, where a slice
    per piece adds each into a zero tensor of all the rows, a time that grows with the square of the rows."""
    lengths = [seg.length for seg in segments]
    starts = [0, *itertools.accumulate(lengths)]
    if all(seg.offset == start for seg, start in zip(segments, starts)) and \
            all(starts[-1] == t.shape[dim] for t in tensors):
        return list(zip(*(t.split(lengths, dim=dim) for t in tensors)))
    return [tuple(t.narrow(dim, seg.offset, seg.length) for t in tensors) for seg in segments]


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


@dataclass
class Runs:
    """What a scan's segments (:func:`_segments`) gave, each from a zero state, in the order the rank holds them."""

    segments: List[Segment]
    outs: List[Tensor] = field(default_factory=list)  # the segment's output
    bases: List[Any] = field(default_factory=list)  # what its output gains per unit of its start state (None: none)
    ends: List[Tensor] = field(default_factory=list)  # its end state (S_ext)
    maps: List[Tensor] = field(default_factory=list)  # its transition (M): it ends in M·S_in + S_ext from S_in

    def add(self, out: Tensor, basis: Any, end: Tensor, transition: Tensor) -> None:
        self.outs.append(out)
        self.bases.append(basis)
        self.ends.append(end)
        self.maps.append(transition)


@dataclass(frozen=True)
class Scan:
    """One kind of scan kernel: its keywords, how its runs are computed, and how a state crosses a run's start."""

    state: str  # the keyword of a state to start from
    final: str  # the keyword that asks for the end state ("": the kernel always returns it)
    packed: str  # the keyword of packed rows ("": it takes none)
    rows_dim: int  # where the rows lie in its output
    runs: Callable[..., Runs]  # (kernel, context, inputs, rest, scan) -> each run from zero
    compose: Callable[[Tensor, Tensor], Tensor]  # (M, S_in) -> M·S_in
    chain: Callable[[Tensor, Tensor], Tensor]  # (M2, M1) -> the transition of M1, then M2
    correct: Callable[[Tensor, Any, Tensor], Tensor]  # (output from zero, basis, S_in) -> the true output
    finish: Callable[[Tensor, Tensor, bool, Dict[str, Any]], Any]  # (output, end state, asked for it, rest) -> result
    inputs: int = 5  # its leading arguments, taken by position


def _scan(scan: Scan, kernel, call: LayerCall, name: str, *args, **kwargs):
    """A scan over the shards: its runs from zero, then :func:`_carry`; returned as the kernel returns it."""
    context = call.context
    call.calls.append(name)
    inputs, rest = _arguments(kernel, args, kwargs, scan.inputs)
    want_final = bool(rest.pop(scan.final, False))
    start = rest.pop(scan.state, None) if scan.state else None  # a zero state given (RecurrentGemma's prefill) is
    # where the runs start anyway
    if (start is not None and bool(start.any())) or (scan.packed and rest.pop(scan.packed, None) is not None):
        context.fail(ValueError(f"{name} was given a state to start from or packed rows ({scan.packed}) over "
                                "sequence shards: not supported there"))
    runs = scan.runs(kernel, context, inputs, rest, scan)
    outs, final, every = _carry(context, runs, inputs[0], scan, f"the {name} states of each run")
    return scan.finish(tied(torch.cat(outs, dim=scan.rows_dim), every), final, want_final, rest)


def _carry(context: ShardedForward, runs: Runs, anchor: Tensor, scan: Scan, what: str):
    """The step every scan shares: each of this rank's runs' end state and transition, from its segments' (a
    document start cuts the state: :func:`hf_ring.engine.recurrence.fold`), exchanged with every rank's (one
    all-gather, in autograd), composed in position order into the state each run starts from, and each segment's
    output corrected for the state it starts from. Returns the outputs, the sequence's end state, and the exchanged
    tensor, which the caller ties into what it returns (:func:`hf_ring.engine.gathers.tied`).

    ``anchor`` (a kernel input) ties the exchange into every rank's graph alike, also on a rank whose runs sent
    nothing that needs a gradient (a placeholder row), so every rank joins the exchange's backward.
    """
    kept = [keeps(seg, anchor.device) for seg in runs.segments]
    by_run: Dict[int, List[int]] = {}
    for i, seg in enumerate(runs.segments):
        by_run.setdefault(seg.run, []).append(i)
    folded = [fold([runs.ends[i] for i in idx], [runs.maps[i] for i in idx], [kept[i] for i in idx], scan.compose,
                   scan.chain) for idx in by_run.values()]
    ends, maps = [end for end, _ in folded], [transition for _, transition in folded]
    if context.placeholder:  # its one run is nobody's: it sends zeros, and nothing reads its output
        ends, maps = [ends[0] * 0], [maps[0] * 0]
    pieces = context.pieces()
    ends_t, maps_t = _padded(ends, pieces.width), _padded(maps, pieces.width)
    every = gather(context.comm, torch.cat([ends_t.flatten(1), maps_t.flatten(1)], dim=1), what, anchor=anchor)
    split = ends_t[0].numel()
    every_end = every[:, :, :split].reshape((-1,) + ends_t.shape)
    every_map = every[:, :, split:].reshape((-1,) + maps_t.shape)
    run_starts, final = carried(pieces, every_end, every_map, scan.compose)
    if context.placeholder:
        return runs.outs, final, every
    outs = list(runs.outs)
    for run, idx in by_run.items():
        starts = segment_starts(run_starts[run], [runs.ends[i] for i in idx], [runs.maps[i] for i in idx],
                                [kept[i] for i in idx], scan.compose)
        for i, start in zip(idx, starts):
            if runs.bases[i] is not None:
                outs[i] = scan.correct(runs.outs[i], runs.bases[i], start)
    return outs, final, every


def _padded(parts: List[Tensor], width: int) -> Tensor:
    """``parts`` stacked along a new first dim, zero-filled to ``width`` entries."""
    return torch.stack(parts + [torch.zeros_like(parts[0]) for _ in range(width - len(parts))])


def _delta_runs(kernel, context: ShardedForward, inputs: List[Tensor], rest: Dict[str, Any], scan: Scan) -> Runs:
    """A delta rule (gated delta rule, KDA) over ``(B, rows, H, d)`` inputs: each segment from a zero state, with
    ``d_k`` extra value channels started at the identity, whose outputs and end state give the basis and the
    transition; a segment every batch row starts a document (or the sequence) at needs neither."""
    q, k, v, g, beta = inputs
    b, rows, heads, dv = v.shape
    dk = k.shape[-1]
    acc = accumulator_dtype(v)
    identity = torch.cat([torch.zeros(b, heads, dk, dv, dtype=acc, device=v.device),
                          torch.eye(dk, dtype=acc, device=v.device).expand(b, heads, dk, dk)], dim=-1)
    runs = Runs(_segments(context, rows, b, kernel))
    call = _piece_call(context, rows, kernel)
    call_extended = _piece_call(context, rows, kernel, fn=functools.partial(_delta_extended, kernel, scan, rest))
    known = None  # in one process: the state the segment before ended in, which the next starts from
    for seg, inputs in zip(runs.segments, _by_segment(runs.segments, 1, q, k, v, g, beta)):
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


def _delta_correct(out: Tensor, basis: Tensor, start: Tensor) -> Tensor:
    return (out.to(start.dtype) + torch.einsum("blhk,bhkv->blhv", basis.to(start.dtype), start)).to(out.dtype)


def _step_size(dt: Tensor, bias: Optional[Tensor], softplus: bool, acc: torch.dtype) -> Tensor:
    """A Mamba layer's step from its ``dt``, as its kernel computes it (bias added, then softplus)."""
    step = dt.to(acc) if bias is None else dt.to(acc) + bias.to(acc)
    return F.softplus(step) if softplus else step


def _mamba2_runs(kernel, context: ShardedForward, inputs: List[Tensor], rest: Dict[str, Any], scan: Scan) -> Runs:
    """Mamba2's chunked scan over ``(B, rows, H, P)``: each run from a zero state; its decay per head and row, from
    the layer's own ``dt``, gives the basis and the run's transition."""
    x, dt, A, B, C = inputs
    heads = x.shape[2]
    acc = accumulator_dtype(x)
    low, high = rest.get("dt_limit", (0.0, float("inf")))
    step = _step_size(dt, rest.get("dt_bias"), bool(rest.get("dt_softplus")), acc)
    log_decay = A.to(acc) * torch.clamp(step, min=low, max=high)  # (B, rows, H)
    query = C.to(acc).repeat_interleave(heads // C.shape[2], dim=2)  # (B, rows, H, N)
    runs = Runs(_segments(context, x.shape[1], x.shape[0], kernel))
    call = _piece_call(context, x.shape[1], kernel)
    known = None  # in one process: the state the segment before ended in, which the next starts from
    for seg, (x_s, dt_s, b_s, c_s, decay_s, query_s) in zip(
            runs.segments, _by_segment(runs.segments, 1, x, dt, B, C, log_decay, query)):
        start = None if known is None or all(seg.fresh) else restarted(seg, known)
        out, state = call(x_s, dt_s, A, b_s, c_s, **{scan.state: start, scan.final: True}, **rest)
        known = state if context.world_size == 1 else None
        if known is not None:  # its start is known: it needs no correction
            runs.add(out, None, state.to(acc), torch.zeros_like(log_decay[:, 0]))
            continue
        cum = decay_s.cumsum(1)
        runs.add(out, cum.exp()[..., None] * query_s, state.to(acc), cum[:, -1].exp())
    return runs


def _mamba2_correct(out: Tensor, basis: Tensor, start: Tensor) -> Tensor:
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


def _mamba_runs(kernel, context: ShardedForward, inputs: List[Tensor], rest: Dict[str, Any], scan: Scan) -> Runs:
    """Mamba's selective scan over ``(B, D, rows)``: each run from a zero state and ungated (the gate ``z`` is
    applied once the runs are corrected), its end state read by :func:`_state_probes`; its decay per channel, state
    and row, from the layer's own ``dt``, gives the basis and the run's transition."""
    x, dt, A, B, C = inputs
    acc = accumulator_dtype(x)
    bias = rest.get("delta_bias")
    step = _step_size(dt, None if bias is None else bias[..., None], bool(rest.get("delta_softplus")), acc)
    ungated = {**rest, "z": None}
    runs = Runs(_segments(context, x.shape[-1], x.shape[0], kernel))
    call = _piece_call(context, x.shape[-1], kernel)
    for x_s, dt_s, b_s, c_s, step_s in _by_segment(runs.segments, -1, x, dt, B, C, step):
        x_p, dt_p, b_p, c_p = _state_probes(x_s, dt_s, b_s, c_s, rest)
        got = call(x_p, dt_p, A, b_p, c_p, **ungated)
        probed = got[0] if isinstance(got, tuple) else got
        out, state = probed[..., :x_s.shape[-1]], probed[..., x_s.shape[-1]:]
        cum = (A.to(acc)[None, :, None, :] * step_s[..., None]).cumsum(2)  # (B, D, rows, N)
        runs.add(out, (c_s, cum), state.to(acc), cum[:, :, -1].exp())
    return runs


def _mamba_correct(out: Tensor, basis: Tuple[Tensor, Tensor], start: Tensor) -> Tensor:
    query, cum = basis
    return (out.to(start.dtype) + torch.einsum("bnt,bdtn,bdn->bdt", query.to(start.dtype), cum.exp(), start)).to(
        out.dtype)


def _rglru_runs(kernel, context: ShardedForward, inputs: List[Tensor], rest: Dict[str, Any], scan: Scan) -> Runs:
    """RG-LRU's diagonal recurrence over ``(B, rows, W)``: ``h_t = a_t h_{t-1} + x_t`` with ``a_t`` zeroed where
    ``reset`` (a position 0); each run from a zero state, its decay per channel and row gives the basis (the
    products of ``a`` from the run's start) and the run's transition (their last)."""
    x, gate, reset = inputs
    acc = accumulator_dtype(x)
    decay = gate.to(acc) * ~reset  # as the kernel multiplies it
    runs = Runs(_segments(context, x.shape[1], x.shape[0], kernel))
    call = _piece_call(context, x.shape[1], kernel)
    for x_s, gate_s, reset_s, decay_s in _by_segment(runs.segments, 1, x, gate, reset, decay):
        out, state = call(x_s, gate_s, reset_s, **{**rest, scan.state: None})
        cum = decay_s.cumprod(1)
        runs.add(out, cum, state.to(acc), cum[:, -1])
    return runs


def _rglru_correct(out: Tensor, basis: Tensor, start: Tensor) -> Tensor:
    return (out.to(start.dtype) + basis * start[:, None]).to(out.dtype)


def _rglru_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    return out, final.to(rest.get("acc_dtype") or final.dtype)


class _LinearState:
    """The cache a lightning attention layer is given to start from ``state`` (its ``get_linear_cache``), keeping
    nothing it is given."""

    def __init__(self, state: Tensor):
        self.state = state

    def get_linear_cache(self, layer_idx: int) -> Tensor:
        return self.state

    def set_linear_cache(self, layer_idx: int, state: Tensor) -> None:
        pass


def _lightning_runs(forward, context: ShardedForward, inputs: List[Any], rest: Dict[str, Any], scan: Scan) -> Runs:
    """MiniMax's lightning attention, the layer's own ``forward`` (whose output passes a norm and a gate, so a start
    state cannot be added to it afterwards): each segment from a zero state gives its end state (the layer returns
    it); a segment that does not start the sequence (or, per batch row, a document) runs once more from its true
    start, given through the layer's cache. The transition is the decay ``exp(-slope)`` per head to the power of the
    segment's rows."""
    hidden, position_embeddings, mask = inputs
    cache, layer_idx = rest.pop("cache", None), forward.__self__.layer_idx
    if cache is not None:  # a prefill's: it keeps the whole sequence's end state (_lightning_finish)
        if cache.get_linear_cache(layer_idx) is not None:
            context.fail(ValueError("lightning attention over sequence shards was given a cache holding a state to "
                                    "start from: a sharded prefill starts from an empty cache"))
        rest[_KEEP] = functools.partial(cache.set_linear_cache, layer_idx)
    decay = torch.exp(-forward.__self__.slope_rate.to(accumulator_dtype(hidden)))  # (H, 1, 1)
    b = hidden.shape[0]
    runs = Runs(_segments(context, hidden.shape[1], b, forward))
    masks = [None] * len(runs.segments) if mask is None else [m for (m,) in _by_segment(runs.segments, 1, mask)]
    given = {k: v for k, v in rest.items() if k != _KEEP}
    for seg, (h_s,), m_s in zip(runs.segments, _by_segment(runs.segments, 1, hidden), masks):
        out, state = forward(h_s, position_embeddings, m_s, **given)
        again = None if all(seg.fresh) else functools.partial(_lightning_from, forward, h_s, position_embeddings, m_s,
                                                               given)
        runs.add(out, again, state.to(decay.dtype), decay.pow(seg.length).expand(b, -1, -1, -1))
    return runs


_KEEP = "_keep_state"
"""Where :func:`_lightning_runs` leaves :func:`_lightning_finish` what keeps a prefill's end state in the cache."""


def _lightning_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    keep = rest.get(_KEEP)
    if keep is not None:
        keep(final.to(out.dtype))
    return out, final


def _lightning_from(forward, hidden: Tensor, position_embeddings: Any, mask: Optional[Tensor], rest: Dict[str, Any],
                    start: Tensor) -> Tensor:
    out, _ = forward(hidden, position_embeddings, mask, **{**rest, "cache": _LinearState(start.to(hidden.dtype))})
    return out


def causal_conv(conv: torch.nn.Conv1d) -> Callable:
    """A depthwise ``nn.Conv1d`` padded ``k - 1`` on both sides whose layer keeps its first outputs (RecurrentGemma's
    ``conv_1d``), as a kernel of :func:`_conv`'s contract: ``(x, weight, bias) -> (B, C, rows)`` for ``x``
    ``(B, C, rows)``, computed by the module's own convolution."""
    if conv.padding != (conv.kernel_size[0] - 1,) or conv.groups != conv.in_channels or conv.stride != (1,) or \
            conv.dilation != (1,):
        raise ValueError(f"{conv} is not a causal depthwise convolution padded kernel_size - 1 rows")

    def kernel(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return conv._conv_forward(x, weight, bias)[..., :x.shape[-1]]

    return kernel


def _conv_module(kernel, call: LayerCall, name: str, x: Tensor) -> Tensor:
    """An ``nn.Conv1d``'s forward (``kernel`` the module) over the shards: :func:`_conv` on :func:`causal_conv`.
    Returns the rows' outputs, which the layer's slice of its first ``rows`` outputs keeps whole."""
    return _conv(causal_conv(kernel), call, name, x, weight=kernel.weight, bias=kernel.bias)


def _previous_row(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Each row of ``x`` ``(B, C, rows)`` replaced by the row before it, zeros before the first: a causal convolution
    of width 2 whose weights are (1, 0), as a kernel of :func:`_conv`'s contract (``weight`` gives the width)."""
    return F.pad(x, (1, 0))[..., :-1]


def _shift(kernel, call: LayerCall, name: str, x: Tensor) -> Tensor:
    """RWKV's time shift (``kernel`` an ``nn.ZeroPad2d((0, 0, 1, -1))``: each row of ``(B, rows, C)`` replaced by the
    one before) over the shards: :func:`_conv` on :func:`_previous_row`, so a run's first row is the row before it
    (zero at a document start); the sequence's last row is kept in ``call.tails``."""
    call.calls.append(name)
    if tuple(kernel.padding) != (0, 0, 1, -1):
        call.context.fail(ValueError(f"{name} pads {tuple(kernel.padding)}, not one row before each (0, 0, 1, -1): "
                                     "not a time shift hf_ring knows over sequence shards"))
    keep = functools.partial(call.tails.__setitem__, name)  # the layer keeps it as its state (hybrids.py)
    out = _convolved(_previous_row, call.context, x.transpose(1, 2), {"weight": x.new_empty(1, 1, 2)}, 1,
                     (1, keep)).transpose(1, 2)
    given = call.row_states.get(name)
    if given is not None:  # a layer given a state list writes its entry over the first row: the row before this run
        given(out[:, 0])
    return out


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


def _wkv_runs(kernel, context: ShardedForward, inputs: List[Tensor], rest: Dict[str, Any], scan: Scan) -> Runs:
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
    runs = Runs(_segments(context, key.shape[1], b))  # the kernel is linear in its rows: each run whole
    for seg, (k_s, v_s) in zip(runs.segments, _by_segment(runs.segments, 1, key, value)):
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
"""Where :func:`_wkv_runs` tells :func:`_wkv_finish` that the layer passed a (zero) state, which the kernel then
returns."""


def _wkv_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    return out, (_wkv_state(final, torch.float32) if want_final or rest.get(_GIVEN) else None)


def _delta_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    return out, (final if want_final else None)


def _mamba2_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    return (out, final) if want_final else out


def _mamba_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    z = rest.get("z")
    gated = out if z is None else out * F.silu(z)
    return (gated, final) if want_final else gated


SCANS: Dict[str, Scan] = {
    DELTA: Scan(state="initial_state", final="output_final_state", packed="cu_seqlens", rows_dim=1, runs=_delta_runs,
                compose=lambda m, s: m @ s, chain=lambda m2, m1: m2 @ m1, correct=_delta_correct,
                finish=_delta_finish),
    MAMBA2: Scan(state="initial_states", final="return_final_states", packed="seq_idx", rows_dim=1,
                 runs=_mamba2_runs, compose=lambda m, s: m[..., None, None] * s, chain=lambda m2, m1: m2 * m1,
                 correct=_mamba2_correct, finish=_mamba2_finish),
    MAMBA: Scan(state="initial_states", final="return_last_state", packed="seq_idx", rows_dim=-1, runs=_mamba_runs,
                compose=lambda m, s: m * s, chain=lambda m2, m1: m2 * m1, correct=_mamba_correct,
                finish=_mamba_finish),
    RGLRU: Scan(state="recurrent_states", final="", packed="", rows_dim=1, runs=_rglru_runs,
                compose=lambda m, s: m * s, chain=lambda m2, m1: m2 * m1, correct=_rglru_correct,
                finish=_rglru_finish, inputs=3),
    LIGHTNING: Scan(state="", final="", packed="", rows_dim=1, runs=_lightning_runs, compose=lambda m, s: m * s,
                    chain=lambda m2, m1: m2 * m1, correct=lambda out, again, start: again(start),
                    finish=_lightning_finish, inputs=3),
    WKV: Scan(state="", final="return_state", packed="", rows_dim=1, runs=_wkv_runs, compose=lambda m, s: m * s,
              chain=lambda m2, m1: m2 * m1, correct=lambda out, again, start: again(start), finish=_wkv_finish,
              inputs=4),
}
"""The scan kinds, by the kind the family table names: transformers' torch paths' keywords."""


def _fused(kernel, call: LayerCall, name: str, *args, **kwargs):
    """A kernel fusing the convolution and the scan: declined over shards (None: the layer takes its split path)."""
    return None


_HOOKS: Dict[str, Callable] = {CONV: _conv, CONV_MODULE: _conv_module, SHIFT: _shift, FUSED: _fused,
                               **{kind: functools.partial(_scan, scan) for kind, scan in SCANS.items()}}
