"""Hybrid families whose recurrent layers hf_ring computes over shards: one table, hooks on transformers' kernels.

A hybrid (Qwen3.5, Qwen3-Next, Kimi Linear, Nemotron-H, Granite 4, Bamba,
Falcon-H1, LFM2, Jamba, ...) mixes its sequence in a few attention layers,
which the ring computes, and in recurrent layers: a gated delta rule, KDA,
Mamba2 or Mamba scan after a short causal convolution, or the convolution
alone. Their modeling code calls module-level kernel functions
(``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``,
...) that are transformers' torch paths, or flash-linear-attention's and
mamba-ssm's kernels where installed. While one of the family's decoder layers
runs a forward over shards, those names are bound to hooks that run the
layer's own kernel on each of the rank's runs and make the result exact:

- a convolution gets the rows before each run (:func:`hf_ring.engine.recurrence.halo`);
- a scan starts each run from zero, the runs' end states and transitions are
  exchanged, and each run's output is corrected for the state it truly
  starts from (:func:`hf_ring.engine.recurrence.carried`): the delta rules
  (gated delta rule, KDA) run their own kernel once with ``d_k`` extra value
  channels of zero input started at the identity, whose outputs and end state
  are the correction's basis and the run's transition; Mamba2 and Mamba decay
  by a scalar per head or a diagonal, computed from the layer's own ``dt``;
- a fused path that does all of it in one kernel (mamba-ssm's
  ``mamba_split_conv1d_scan_combined``) is declined, so the layer takes its
  split path through the hooks.

Nothing is copied from a layer's forward: it runs as written. Every class
replaced goes through :mod:`.registry`, undone with the rest.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from hf_ring.engine.merge import accumulator_dtype
from hf_ring.engine.recurrence import carried, gather, halo, tied
from hf_ring.integration.context import CONTEXT_KEY, ShardedForward

from . import registry

Tensor = torch.Tensor

CONV, DELTA, MAMBA2, MAMBA, FUSED = "convolution", "delta rule", "Mamba2 scan", "Mamba scan", "fused"


@dataclass(frozen=True)
class Recurrent:
    """A hybrid family: where its classes live, which decoder layers and mixers it has, which kernels they call."""

    model_types: Tuple[str, ...]
    module: str  # transformers.models.<module>.modeling_<module>
    layers: Tuple[str, ...]  # decoder layers: their forward receives model(...)'s keyword arguments
    mixers: Tuple[str, ...]  # the recurrent or convolution layers inside them
    kernels: Tuple[Tuple[str, str], ...]  # (module-level function, kind) the mixers call
    layer_types: Tuple[str, ...]  # the config's names for the mixers' layers
    state: str  # how the state crosses ranks (the README's table)
    attention: Tuple[str, ...] = ()  # attention classes whose names read like a mixer's (Kimi's MLA)

    @property
    def known(self) -> Tuple[str, ...]:
        """Class names of the family that the structure checks take as computed exactly."""
        return self.layers + self.mixers + self.attention

    @property
    def modeling(self) -> str:
        return f"transformers.models.{self.module}.modeling_{self.module}"

    def found(self) -> Optional[Any]:
        """The modeling module, when this release has every layer, mixer and kernel the hooks expect."""
        try:
            module = importlib.import_module(self.modeling)
        except ImportError:
            return None
        names = self.layers + self.mixers + tuple(name for name, _ in self.kernels)
        return module if all(hasattr(module, name) for name in names) else None

    def recurrent(self, layer: torch.nn.Module) -> bool:
        """Whether this decoder layer holds one of the family's mixers (else it attends)."""
        return any(type(child).__name__ in self.mixers for child in layer.children())


_GDN = (("causal_conv1d_fn", CONV), ("torch_chunk_gated_delta_rule", DELTA))
_KDA = (("causal_conv1d_fn", CONV), ("chunk_kimi_delta_attention", DELTA))
_MAMBA2 = (("causal_conv1d_fn", CONV), ("mamba2_chunk_scan", MAMBA2), ("mamba2_split_conv1d_scan_combined", FUSED))
_GDN_STATE = "gated delta rule: each run's end state and d_k x d_k transition per head, one all-gather per layer"
_MAMBA2_STATE = "Mamba2: each run's end state and decay per head, one all-gather per layer"

RECURRENT: Dict[str, Recurrent] = {t: r for r in (
    Recurrent(("qwen3_5_text", "qwen3_5"), "qwen3_5", ("Qwen3_5DecoderLayer",), ("Qwen3_5GatedDeltaNet",), _GDN,
              ("linear_attention",), _GDN_STATE),
    Recurrent(("qwen3_5_moe_text", "qwen3_5_moe"), "qwen3_5_moe", ("Qwen3_5MoeDecoderLayer",),
              ("Qwen3_5MoeGatedDeltaNet",), _GDN, ("linear_attention",), _GDN_STATE),
    Recurrent(("qwen3_next",), "qwen3_next", ("Qwen3NextDecoderLayer",), ("Qwen3NextGatedDeltaNet",), _GDN,
              ("linear_attention",), _GDN_STATE),
    Recurrent(("olmo_hybrid",), "olmo_hybrid", ("OlmoHybridLinearAttentionDecoderLayer",),
              ("OlmoHybridGatedDeltaNet",), _GDN, ("linear_attention",), _GDN_STATE),
    Recurrent(("kimi_linear",), "kimi_linear", ("KimiLinearDecoderLayer",), ("KimiLinearDeltaAttention",), _KDA,
              ("linear_attention",), "KDA: each run's end state and d_k x d_k transition per head, one all-gather",
              ("KimiLinearAttention",)),
    Recurrent(("bailing_hybrid",), "bailing_hybrid", ("BailingHybridDecoderLayer",), ("BailingHybridDeltaAttention",),
              _KDA, ("linear_attention",), "KDA, as Kimi Linear"),
    Recurrent(("nemotron_h",), "nemotron_h", ("NemotronHBlock",), ("NemotronHMamba2Mixer",), _MAMBA2,
              ("linear_attention", "mamba"), _MAMBA2_STATE),
    Recurrent(("granitemoehybrid",), "granitemoehybrid", ("GraniteMoeHybridDecoderLayer",),
              ("GraniteMoeHybridMambaLayer",), _MAMBA2, ("linear_attention", "mamba"), _MAMBA2_STATE),
    Recurrent(("bamba",), "bamba", ("BambaDecoderLayer",), ("BambaMixer",), _MAMBA2, ("linear_attention", "mamba"),
              _MAMBA2_STATE),
    Recurrent(("falcon_h1",), "falcon_h1", ("FalconH1DecoderLayer",), ("FalconH1Mixer",), _MAMBA2, ("hybrid",),
              "Mamba2 beside attention in every layer: as Nemotron-H"),
    Recurrent(("lfm2",), "lfm2", ("Lfm2DecoderLayer",), ("Lfm2ShortConv",), (("causal_conv1d_fn", CONV),),
              ("conv",), "short convolution: each run's last k-1 rows, one all-gather per layer"),
    Recurrent(("lfm2_moe",), "lfm2_moe", ("Lfm2MoeDecoderLayer",), ("Lfm2MoeShortConv",),
              (("causal_conv1d_fn", CONV),), ("conv",), "short convolution, as LFM2"),
    Recurrent(("jamba",), "jamba", ("JambaMambaDecoderLayer",), ("JambaMambaMixer",),
              (("causal_conv1d_fn", CONV), ("mamba_selective_scan", MAMBA), ("mamba_inner_fn", FUSED)),
              ("linear_attention", "mamba"), "Mamba: each run's end state and decay per channel and state"),
) for t in r.model_types}
"""Hybrid families by model type (a multimodal type under its own name and its text model's)."""


def family(model_type: Optional[str]) -> Optional[Recurrent]:
    """The hybrid family of ``model_type`` whose hooks this transformers release can take, or None."""
    found = RECURRENT.get(model_type or "")
    return found if found is not None and found.found() is not None else None




def recurrent_layers(model: torch.nn.Module) -> List[int]:
    """The layer indices (as the cache counts them) of ``model``'s recurrent and convolution layers that hf_ring
    computes over shards (none for a model that is not a hybrid hf_ring hooks)."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if config is not None else None
    found = family(getattr(text, "model_type", None))
    if found is None:
        return []
    return sorted({int(m.layer_idx) for m in model.modules() if type(m).__name__ in found.mixers
                   and isinstance(getattr(m, "layer_idx", None), int)})


WHY = ("binds the family's kernels (convolution, delta rule, Mamba scans) to hooks that compute them exactly over "
       "the sequence shards while one of its decoder layers runs a forward over shards (other calls untouched)")


def apply(found: Recurrent) -> None:
    """Hook the family's decoder layers (idempotent, undone by :func:`hf_ring.patches.revert_all`)."""
    module = found.found()
    if module is None:
        return
    for name in found.layers:
        registry.replace(getattr(module, name), "forward", lambda original: _layer_forward(original, found), WHY)


def _layer_forward(original: Callable, found: Recurrent) -> Callable:
    def forward(self, *args, **kwargs):
        context = kwargs.get(CONTEXT_KEY)
        if not isinstance(context, ShardedForward) or context.world_size == 1 or not found.recurrent(self):
            return original(self, *args, **kwargs)  # one process holds the whole sequence: the layer as it is
        return _over_shards(original, found, context, self, args, kwargs)

    forward.__wrapped__ = original
    return forward


@torch.compiler.disable  # collectives and host-side run lists: outside a compiled graph, on purpose
def _over_shards(original: Callable, found: Recurrent, context: ShardedForward, layer, args, kwargs):
    calls: List[str] = []
    with _bound(found, context, calls):
        out = original(layer, *args, **kwargs)
    if not calls:
        context.fail(ValueError(
            f"the {type(layer).__name__} layer of {found.model_types[0]!r} ran its mixer without calling the kernels "
            f"hf_ring computes over shards ({', '.join(n for n, _ in found.kernels)}): its forward was replaced (a hub "
            "kernel loaded with use_kernels=True?) or differs in this transformers release; load the model without "
            "kernels, or run it in one process"))
    context.mixing()
    return out


@contextlib.contextmanager
def _bound(found: Recurrent, context: ShardedForward, calls: List[str]) -> Iterator[None]:
    """The family's kernels bound to their hooks over ``context`` for the length of one decoder layer's call."""
    module = found.found()
    originals = {name: getattr(module, name) for name, _ in found.kernels}
    for name, kind in found.kernels:
        setattr(module, name, hooked(kind, originals[name], context, calls, name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


def hooked(kind: str, kernel: Callable, context: ShardedForward, calls: Optional[List[str]] = None,
           name: Optional[str] = None) -> Callable:
    """``kernel`` (a convolution, delta rule, Mamba2 or Mamba scan: ``kind``) computed over the shards of
    ``context``, called as the kernel is; ``calls`` records each call by ``name``."""
    return functools.partial(_HOOKS[kind], kernel, context, [] if calls is None else calls, name or kind)


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
    found.pop(CONTEXT_KEY, None)
    names = list(signature.parameters)[:leading]
    return [found.pop(n) for n in names], found


def _refuse(context: ShardedForward, message: str) -> None:
    context.fail(ValueError(message))


def _runs(context: ShardedForward, rows: int) -> List[Tuple[int, int]]:
    """This rank's runs as (offset, length) in its rows; a placeholder row is run as it is (nothing reads it)."""
    return [(0, rows)] if context.placeholder else context.pieces().local()


def _conv(original, context: ShardedForward, calls: List[str], name: str, *args, **kwargs):
    """A causal depthwise convolution over ``(B, C, rows)``: each run convolved after the rows before it."""
    calls.append(name)
    (x,), a = _arguments(original, args, kwargs, 1)
    weight = a["weight"]
    if a.get("seq_idx") is not None or a.get("initial_states") is not None:
        _refuse(context, f"{name} was given seq_idx or initial_states over sequence shards; packed rows and a "
                         "convolution state to start from are not supported there")
    width = weight.shape[-1] - 1
    halos, every = halo(context.pieces(), context.comm, x, width)
    if context.placeholder:
        return tied(original(x, **a), every)
    outs = [original(torch.cat([h, x[..., o:o + n]], dim=-1), **a)[..., width:]
            for (o, n), h in zip(_runs(context, x.shape[-1]), halos)]
    return tied(torch.cat(outs, dim=-1), every)


def _padded(parts: List[Tensor], width: int, like: Tensor) -> Tensor:
    """``parts`` stacked along a new first dim, zero-filled to ``width`` entries."""
    parts = parts + [torch.zeros_like(like) for _ in range(width - len(parts))]
    return torch.stack(parts)


def _exchange(context: ShardedForward, ends: List[Tensor], maps: List[Tensor], anchor: Tensor, what: str):
    """Every rank's runs' end states and transitions, by rank and run (one all-gather, in autograd), and the
    gathered tensor itself, which the caller ties into what it returns (:func:`hf_ring.engine.recurrence.tied`).

    ``anchor`` (a kernel input) ties the exchange into every rank's graph alike, also on a rank whose runs sent
    nothing that needs a gradient (a placeholder row), so every rank joins the exchange's backward.
    """
    pieces = context.pieces()
    ends_t, maps_t = _padded(ends, pieces.width, ends[0]), _padded(maps, pieces.width, maps[0])
    flat = torch.cat([ends_t.flatten(1), maps_t.flatten(1)], dim=1)
    every = gather(context.comm, flat, what, anchor=anchor)
    split = ends_t[0].numel()
    return (every[:, :, :split].reshape((-1,) + ends_t.shape), every[:, :, split:].reshape((-1,) + maps_t.shape),
            every)


def _scan_arguments(original, context: ShardedForward, name: str, args: tuple, kwargs: dict, state: str, final: str,
                    packed: str) -> Tuple[List[Tensor], bool, Dict[str, Any]]:
    """A scan's five leading inputs, whether its end state was asked for (``final``), and its other arguments; a
    state to start from (``state``) or packed rows (``packed``) are refused on every rank."""
    leading, a = _arguments(original, args, kwargs, 5)
    want_final = bool(a.pop(final, False))
    if a.pop(state, None) is not None or a.pop(packed, None) is not None:
        _refuse(context, f"{name} was given a state to start from or packed rows ({packed}) over sequence shards: "
                         "not supported there")
    return leading, want_final, a


def _delta(original, context: ShardedForward, calls: List[str], name: str, *args, **kwargs):
    """A delta rule (gated delta rule, KDA) over ``(B, rows, H, d)`` inputs: each run from a zero state, with ``d_k``
    extra value channels started at the identity, whose outputs and end state give the correction's basis and the
    run's transition."""
    calls.append(name)
    (q, k, v, g, beta), want_final, a = _scan_arguments(original, context, name, args, kwargs, "initial_state",
                                                        "output_final_state", "cu_seqlens")
    b, rows, heads, dv = v.shape
    dk = k.shape[-1]
    acc = accumulator_dtype(v)
    eye = torch.eye(dk, dtype=acc, device=v.device).expand(b, heads, dk, dk)
    start = torch.cat([torch.zeros(b, heads, dk, dv, dtype=acc, device=v.device), eye], dim=-1)
    outs, bases, ends, maps = [], [], [], []
    firsts = [False] if context.placeholder else [a_ == 0 for a_, _ in context.pieces().mine]
    for (o, n), first in zip(_runs(context, rows), firsts):
        s = slice(o, o + n)
        if first:  # the sequence's first rows start from zero: no correction, and nothing reads their transition
            out, state = original(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], output_final_state=True, **a)
            outs.append(out)
            bases.append(None)
            ends.append(state.to(acc))
            maps.append(torch.zeros(b, heads, dk, dk, dtype=acc, device=v.device))
            continue
        extended = torch.cat([v[:, s], v.new_zeros(b, n, heads, dk)], dim=-1)
        out, state = original(q[:, s], k[:, s], extended, g[:, s], beta[:, s], initial_state=start,
                              output_final_state=True, **a)
        outs.append(out[..., :dv])
        bases.append(out[..., dv:])
        ends.append(state[..., :dv].to(acc))
        maps.append(state[..., dv:].to(acc))
    if context.placeholder:
        ends, maps = [ends[0] * 0], [maps[0] * 0]
    every_end, every_map, every = _exchange(context, ends, maps, v, f"the {name} states of each run")
    starts, final = carried(context.pieces(), every_end, every_map, lambda m, s: m @ s)
    if not context.placeholder:
        outs = [out if basis is None else
                (out.to(acc) + torch.einsum("blhk,bhkv->blhv", basis.to(acc), s_in)).to(out.dtype)
                for out, basis, s_in in zip(outs, bases, starts)]
    return tied(torch.cat(outs, dim=1), every), (final if want_final else None)


def _mamba2(original, context: ShardedForward, calls: List[str], name: str, *args, **kwargs):
    """Mamba2's chunked scan over ``(B, rows, H, P)``: each run from a zero state; its decay per head and row, from
    the layer's own ``dt``, gives the correction and the run's transition."""
    calls.append(name)
    (x, dt, A, B, C), want_final, a = _scan_arguments(original, context, name, args, kwargs, "initial_states",
                                                      "return_final_states", "seq_idx")
    heads = x.shape[2]
    acc = accumulator_dtype(x)
    step = dt.to(acc)
    if a.get("dt_bias") is not None:
        step = step + a["dt_bias"].to(acc)
    if a.get("dt_softplus"):
        step = F.softplus(step)
    low, high = a.get("dt_limit", (0.0, float("inf")))
    log_decay = A.to(acc) * torch.clamp(step, min=low, max=high)  # (B, rows, H)
    query = C.to(acc).repeat_interleave(heads // C.shape[2], dim=2)  # (B, rows, H, N)
    outs, bases, ends, maps = [], [], [], []
    for o, n in _runs(context, x.shape[1]):
        s = slice(o, o + n)
        out, state = original(x[:, s], dt[:, s], A, B[:, s], C[:, s], initial_states=None, return_final_states=True,
                              **a)
        cum = log_decay[:, s].cumsum(1)
        outs.append(out)
        bases.append(cum.exp()[..., None] * query[:, s])
        ends.append(state.to(acc))
        maps.append(cum[:, -1].exp())
    if context.placeholder:
        ends, maps = [ends[0] * 0], [maps[0] * 0]
    every_end, every_map, every = _exchange(context, ends, maps, x, f"the {name} states of each run")
    starts, final = carried(context.pieces(), every_end, every_map, lambda m, s: m[..., None, None] * s)
    if not context.placeholder:
        outs = [(out.to(acc) + torch.einsum("blhn,bhpn->blhp", basis, s_in)).to(out.dtype)
                for out, basis, s_in in zip(outs, bases, starts)]
    out = tied(torch.cat(outs, dim=1), every)
    return (out, final) if want_final else out


def _mamba(original, context: ShardedForward, calls: List[str], name: str, *args, **kwargs):
    """Mamba's selective scan over ``(B, D, rows)``: each run from a zero state and ungated; its decay per channel,
    state and row, from the layer's own ``dt``, gives the correction and the run's transition; then the gate."""
    calls.append(name)
    (x, dt, A, B, C), want_final, a = _scan_arguments(original, context, name, args, kwargs, "initial_states",
                                                      "return_last_state", "seq_idx")
    z = a.pop("z", None)
    acc = accumulator_dtype(x)
    step = dt.to(acc)
    if a.get("delta_bias") is not None:
        step = step + a["delta_bias"].to(acc)[..., None]
    if a.get("delta_softplus"):
        step = F.softplus(step)
    outs, cums, ends, maps = [], [], [], []
    for o, n in _runs(context, x.shape[-1]):
        s = slice(o, o + n)
        out, state = original(x[..., s], dt[..., s], A, B[..., s], C[..., s], z=None, return_last_state=True, **a)
        cum = (A.to(acc)[None, :, None, :] * step[..., s, None]).cumsum(2)  # (B, D, rows, N)
        outs.append(out)
        cums.append(cum)
        ends.append(state.to(acc))
        maps.append(cum[:, :, -1].exp())
    if context.placeholder:
        ends, maps = [ends[0] * 0], [maps[0] * 0]
    every_end, every_map, every = _exchange(context, ends, maps, x, f"the {name} states of each run")
    starts, final = carried(context.pieces(), every_end, every_map, lambda m, s: m * s)
    if not context.placeholder:
        runs = _runs(context, x.shape[-1])
        outs = [(out.to(acc) + torch.einsum("bnt,bdtn,bdn->bdt", C[..., o:o + n].to(acc), cum.exp(), s_in)).to(out.dtype)
                for out, cum, s_in, (o, n) in zip(outs, cums, starts, runs)]
    out = tied(torch.cat(outs, dim=-1), every)
    if z is not None:
        out = out * F.silu(z)
    return (out, final) if want_final else out


def _fused(original, context: ShardedForward, calls: List[str], name: str, *args, **kwargs):
    """A kernel fusing the convolution and the scan: declined over shards (None: the layer takes its split path)."""
    return None


_HOOKS: Dict[str, Callable] = {CONV: _conv, DELTA: _delta, MAMBA2: _mamba2, MAMBA: _mamba, FUSED: _fused}
