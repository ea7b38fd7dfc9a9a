"""Hooks that compute a hybrid's recurrent kernels exactly over the sequence shards, one per kind of kernel.

Each hook is called as the kernel it stands for, with the forward's context
bound by :mod:`.hybrids` for one decoder layer's call, and runs that kernel on
each of the rank's runs (:meth:`hf_ring.engine.recurrence.Pieces.local`):

- a convolution, an ``nn.Conv1d`` module or RWKV's row shift gets the rows
  before each run (:mod:`.recurrent_conv`);
- a scan (:class:`.recurrent_runs.Scan`) starts each run from zero, and one
  carry step shared by every kind (:func:`.recurrent_runs.carry`) exchanges
  the runs' end states and transitions, composes them into the state each
  run truly starts from (:func:`hf_ring.engine.recurrence.carried`) and
  corrects each run's output for it. What differs by kind, one module each,
  is how a run yields its transition and its correction: the delta rules
  (:mod:`.recurrent_delta`) run their own kernel once with ``d_k`` extra value
  channels started at the identity; Mamba2 and Mamba (:mod:`.recurrent_mamba`)
  and the RG-LRU (:mod:`.recurrent_rglru`) decay by what the layer's own
  inputs give; lightning attention (:mod:`.recurrent_lightning`) and WKV
  (:mod:`.recurrent_wkv`), whose outputs are not linear in the start state,
  run again from it;
- a kernel fusing the convolution and the scan (mamba-ssm's
  ``mamba_split_conv1d_scan_combined``, ``mamba_inner_fn``) is declined, so
  the layer takes its split path through the other hooks.

States and corrections are kept in float32, float64 for float64 inputs (WKV's in float64).
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from hf_ring.engine.gathers import tied
from hf_ring.integration.seams import kernel_implementation
from hf_ring.versions import parse

from .recurrent_conv import conv_module, convolution, shift
from .recurrent_delta import delta_correct, delta_finish, delta_runs
from .recurrent_lightning import lightning_finish, lightning_runs
from .recurrent_mamba import mamba2_correct, mamba2_finish, mamba2_runs, mamba_correct, mamba_finish, mamba_runs
from .recurrent_rglru import rglru_correct, rglru_finish, rglru_runs
from .recurrent_runs import LayerCall, Scan, carry, kernel_arguments
from .recurrent_wkv import wkv_finish, wkv_runs

CONV, DELTA, MAMBA2, MAMBA, FUSED = "convolution", "delta rule", "Mamba2 scan", "Mamba scan", "fused"
RGLRU, CONV_MODULE, LIGHTNING = "RG-LRU scan", "convolution module", "lightning attention"
SHIFT, WKV = "time shift", "WKV"


def hooked(kind: str, kernel: Callable, call: Any, name: Optional[str] = None) -> Callable:
    """``kernel`` (one of the kinds above: ``kind``) computed over the shards of ``call``
    (a :class:`LayerCall`, or a forward's context for a call of its own), called as the kernel is, and recorded
    in ``call.calls`` by ``name``."""
    call = call if isinstance(call, LayerCall) else LayerCall(call)
    return functools.partial(_HOOKS[kind], kernel, call, name or kind)


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


def _scan(scan: Scan, kernel, call: LayerCall, name: str, *args, **kwargs):
    """A scan over the shards: its runs from zero, then :func:`carry`; returned as the kernel returns it."""
    context = call.context
    call.calls.append(name)
    inputs, rest = kernel_arguments(kernel, args, kwargs, scan.inputs)
    want_final = bool(rest.pop(scan.final, False))
    start = rest.pop(scan.state, None) if scan.state else None  # a zero state given (RecurrentGemma's prefill) is
    # where the runs start anyway
    given = start is not None and bool(start.any())
    if given and context.comm is None and context.documents is None:
        return kernel(*args, **kwargs)  # one process, one document: whole from that state, as without hf_ring
    if given or (scan.packed and rest.pop(scan.packed, None) is not None):
        context.fail(ValueError(f"{name} was given a state to start from or packed rows ({scan.packed}) over "
                                "sequence shards: not supported there"))
    runs = scan.runs(kernel, context, inputs, rest, scan)
    outs, final, every = carry(context, runs, inputs[0], scan, f"the {name} states of each run")
    return scan.finish(tied(torch.cat(outs, dim=scan.rows_dim), every), final, want_final, rest)


SCANS: Dict[str, Scan] = {
    DELTA: Scan(state="initial_state", final="output_final_state", packed="cu_seqlens", rows_dim=1, runs=delta_runs,
                compose=lambda m, s: m @ s, chain=lambda m2, m1: m2 @ m1, correct=delta_correct,
                finish=delta_finish),
    MAMBA2: Scan(state="initial_states", final="return_final_states", packed="seq_idx", rows_dim=1,
                 runs=mamba2_runs, compose=lambda m, s: m[..., None, None] * s, chain=lambda m2, m1: m2 * m1,
                 correct=mamba2_correct, finish=mamba2_finish),
    MAMBA: Scan(state="initial_states", final="return_last_state", packed="seq_idx", rows_dim=-1, runs=mamba_runs,
                compose=lambda m, s: m * s, chain=lambda m2, m1: m2 * m1, correct=mamba_correct,
                finish=mamba_finish),
    RGLRU: Scan(state="recurrent_states", final="", packed="", rows_dim=1, runs=rglru_runs,
                compose=lambda m, s: m * s, chain=lambda m2, m1: m2 * m1, correct=rglru_correct,
                finish=rglru_finish, inputs=3),
    LIGHTNING: Scan(state="", final="", packed="", rows_dim=1, runs=lightning_runs, compose=lambda m, s: m * s,
                    chain=lambda m2, m1: m2 * m1, correct=lambda out, again, start: again(start),
                    finish=lightning_finish, inputs=3),
    WKV: Scan(state="", final="return_state", packed="", rows_dim=1, runs=wkv_runs, compose=lambda m, s: m * s,
              chain=lambda m2, m1: m2 * m1, correct=lambda out, again, start: again(start), finish=wkv_finish,
              inputs=4),
}
"""The scan kinds, by the kind the family table names: transformers' torch paths' keywords."""


def _fused(kernel, call: LayerCall, name: str, *args, **kwargs):
    """A kernel fusing the convolution and the scan: declined over shards (None: the layer takes its split path)."""
    return None


_HOOKS: Dict[str, Callable] = {CONV: convolution, CONV_MODULE: conv_module, SHIFT: shift, FUSED: _fused,
                               **{kind: functools.partial(_scan, scan) for kind, scan in SCANS.items()}}
