"""What every recurrent hook shares (:mod:`.recurrent`): one layer's call, a kernel's arguments, the segments a
rank runs, and the carry step that passes a scan's states between ranks and corrects each run for its start."""
from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.checkpoint import checkpoint

from hf_ring.engine.gathers import gather
from hf_ring.engine.recurrence import Segment, carried, fold, keeps, segment_starts, segments
from hf_ring.integration.context import CONTEXT_KEY, ShardedForward
from hf_ring.integration.seams import kernel_function, kernel_implementation

Tensor = torch.Tensor


@dataclass
class LayerCall:
    """One layer's call over the shards of ``context``, as the hooks on its kernels see it: ``layer_idx`` (as the
    cache counts layers; None: not known) and the kernels it called, by name."""

    context: ShardedForward
    layer_idx: Optional[int] = None
    calls: List[str] = field(default_factory=list)
    conv_state: Optional[Callable[[Tensor], None]] = None  # given the sequence's last convolution input rows, if set
    tails: Dict[str, Tensor] = field(default_factory=dict)  # a row shift's last input row of the sequence, by name
    # a row shift's state-list entry, by name: given the row before this run, it writes it where the layer reads it
    row_states: Dict[str, Callable[[Tensor], None]] = field(default_factory=dict)


def kernel_arguments(fn: Callable, args: tuple, kwargs: dict, leading: int) -> Tuple[List[Any], Dict[str, Any]]:
    """A kernel call's first ``leading`` arguments (by position: transformers' torch paths, flash-linear-attention
    and mamba-ssm name them differently) and the others by name, defaults filled, its ``**kwargs`` merged in."""
    signature = inspect.signature(kernel_function(fn))  # a kernels function layer's: its function's
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


def linear_kernel(kernel: Optional[Callable]) -> bool:
    """Whether ``kernel`` runs one of :data:`LINEAR_KERNELS`: itself, or as the package function transformers
    resolved its kernel name to at import (:func:`hf_ring.integration.seams.kernel_implementation`)."""
    return kernel is None or getattr(kernel_implementation(kernel), "__module__", "").startswith(LINEAR_KERNELS)


def rank_segments(context: ShardedForward, rows: int, batch: int, kernel: Optional[Callable] = None) -> List[Segment]:
    """What this rank runs, one kernel call each: its runs cut at document starts (:func:`segments`), and for a scan
    ``kernel`` every ``context.scan_rows`` rows, unless it is one of :data:`LINEAR_KERNELS` (transformers' torch
    paths are not linear: :data:`hf_ring.engine.recurrence.SCAN_ROWS`); a placeholder row is run as it is, from
    zero (nothing reads it)."""
    if context.placeholder:
        return [Segment(0, 0, rows, 0, (0,) * batch)]
    limit = None if linear_kernel(kernel) else context.scan_rows
    return segments(context.pieces(), context.documents, batch, limit=limit)


def piece_call(context: ShardedForward, rows: int, kernel: Callable, scan: bool = True,
               fn: Optional[Callable] = None) -> Callable:
    """How ``kernel`` (or ``fn``, which calls it) is called on each segment of this rank's ``rows``: as it is, or,
    over more rows than ``context.scan_rows`` with gradients on, checkpointed, so that what it keeps for the backward
    beyond its inputs
    (a scan's several row-sized tensors per head, a convolution's output before its activation) exists for one
    segment at a time, recomputed in the backward. ``scan``: a scan kernel, whose :data:`LINEAR_KERNELS` run whole
    and keep little, so they are called as they are."""
    fn = kernel if fn is None else fn
    long = context.scan_rows is not None and rows > context.scan_rows and torch.is_grad_enabled()
    if not long or (scan and linear_kernel(kernel)):
        return fn
    return functools.partial(checkpoint, fn, use_reentrant=False)


def by_segment(segments: List[Segment], dim: int, *tensors: Tensor) -> List[Tuple[Tensor, ...]]:
    """Each of ``tensors``' rows (along ``dim``) of each segment. One split per tensor where the segments tile its
    rows in order (they do: a rank's runs, cut): a split's backward joins the pieces' gradients once, where a slice
    per piece adds each into a zero tensor of all the rows, a time that grows with the square of the rows."""
    lengths = [seg.length for seg in segments]
    starts = [0, *itertools.accumulate(lengths)]
    if all(seg.offset == start for seg, start in zip(segments, starts)) and \
            all(starts[-1] == t.shape[dim] for t in tensors):
        return list(zip(*(t.split(lengths, dim=dim) for t in tensors)))
    return [tuple(t.narrow(dim, seg.offset, seg.length) for t in tensors) for seg in segments]


@dataclass
class Runs:
    """What a scan's segments (:func:`rank_segments`) gave, each from a zero state, in the order the rank holds them."""

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


def carry(context: ShardedForward, runs: Runs, anchor: Tensor, scan: Scan, what: str):
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
