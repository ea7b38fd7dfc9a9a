"""Hybrid families whose recurrent layers hf_ring computes over shards: found by their kernels, and hooks on their
decoder layers.

A hybrid (Qwen3.5, Qwen3-Next, Kimi Linear, Nemotron-H, Granite 4, Bamba,
Falcon-H1, LFM2, Jamba, ...) mixes its sequence in a few attention layers,
which the ring computes, and in recurrent layers: a gated delta rule, KDA,
Mamba2 or Mamba scan after a short causal convolution, or the convolution
alone. Their modeling code calls module-level kernel functions
(``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``,
...) that are transformers' torch paths, or flash-linear-attention's and
mamba-ssm's kernels where installed. A family's layers, mixers and kernels are
read from its modeling module by the names transformers resolves its kernels
under (:func:`found_family`); :data:`HYBRIDS` holds what the code does not show.
While one of the family's decoder layers
runs a forward over shards, those names are bound to the hooks of
:mod:`.recurrent`, which run the layer's own kernel on each of the rank's runs
and make the result exact. Nothing is copied from a layer's forward: it runs as
written. Every change goes through :mod:`.registry`: the decoder layers'
``forward`` (and a state-space model's CausalLM ``forward``, which hands its
layers the forward's context) until :func:`hf_ring.patches.revert_all`, the
kernels' names for one layer's call.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import operator
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

import torch
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from hf_ring.integration.context import CONTEXT_KEY, ShardedForward
from hf_ring.integration.seams import as_layer_forward, kernel_function, kernel_name, layer_forward_inside

from . import kernel_source, registry
from .recurrent import (CONV, CONV_MODULE, DELTA, FUSED, LIGHTNING, MAMBA, MAMBA2, RGLRU, SCANS, SHIFT, WKV,
                        LayerCall, hooked, package_problem)


@dataclass(frozen=True)
class HybridFamily:
    """A hybrid family: where its classes live, which decoder layers and mixers it has, which kernels they call."""

    model_types: Tuple[str, ...]  # a multimodal type beside its text model's
    module: str  # transformers.models.<module>.modeling_<module>
    layer_types: Tuple[str, ...]  # the config's names for the mixers' layers
    state: str  # how the state crosses ranks (the README's table)
    layers: Tuple[str, ...] = ()  # decoder layers: their forward receives model(...)'s keyword arguments
    mixers: Tuple[str, ...] = ()  # the recurrent or convolution layers inside them
    kernels: Tuple[Tuple[str, str], ...] = ()  # (module-level function, kind of hook) the mixers call
    attention: Tuple[str, ...] = ()  # attention classes whose names read like a mixer's (Kimi's MLA)
    tiled: Tuple[str, ...] = ()  # CausalLM, MLP, RMSNorm and gated norm classes the sequence tiling fits (empty: none)
    plain: Tuple[str, ...] = ()  # classes named like a mixer that mix no tokens (a state-space model's model, norms)
    entry: Tuple[str, ...] = ()  # CausalLM classes that do not hand model(...)'s keyword arguments to the layers
    modeling_path: str = ""  # the modeling module's full name, where it is not transformers' (code of its own)
    conv_state: str = ""  # a mixer attribute that holds its convolution's last input rows after a prefill
    own_cache: str = ""  # a cache class of its own the model's forward insists on (hf_ring.generate mixes it in)
    row_states: Tuple[Tuple[str, int], ...] = ()  # (row shift, entry of the state list a layer is given as ``state``)
    # where the layer reads the row before its first and keeps its last input row (RWKV): hf_ring's rows there
    needs: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()  # (mixer, the kinds of kernel its forward runs), where found;
    # a mixer not listed runs every kind of the family's kernels

    @property
    def known(self) -> Tuple[str, ...]:
        """Class names of the family that the structure checks take as computed exactly."""
        return self.layers + self.mixers + self.attention + self.plain

    @property
    def modeling(self) -> str:
        return self.modeling_path or _transformers_modeling(self.module)

    def modeling_module(self) -> Optional[ModuleType]:
        """The modeling module, when this release has every layer, mixer and kernel the hooks expect."""
        try:
            module = importlib.import_module(self.modeling)
        except ImportError:
            return None
        names = self.layers + self.mixers + tuple(name for name, _ in self.kernels if not name.startswith("."))
        return module if all(kernel_owner(module, name) is not None for name in names) else None

    def mixer(self, layer: torch.nn.Module) -> Optional[torch.nn.Module]:
        """This decoder layer's recurrent or convolution mixer, or None (it attends)."""
        return next((child for child in layer.children() if type(child).__name__ in self.mixers), None)

    def recurrent(self, layer: torch.nn.Module) -> bool:
        """Whether this decoder layer holds one of the family's mixers (else it attends)."""
        return self.mixer(layer) is not None

    def needed(self, layer: torch.nn.Module) -> FrozenSet[str]:
        """The kinds of kernel a call of this decoder layer must run through the hooks: those its mixers' forwards
        call (:data:`needs`), a fused kernel aside (declined: the layer then takes its split path)."""
        listed = dict(self.needs)
        every = tuple(kind for _, kind in self.kernels)
        kinds = {kind for m in layer.modules() if type(m).__name__ in self.mixers
                 for kind in listed.get(type(m).__name__, every)}
        return frozenset(kinds - {FUSED})

    def kind_of(self, called: str) -> Optional[str]:
        """The kind of the kernel a hook recorded by ``called`` (a name of :attr:`kernels`, a module path without its
        leading dot)."""
        return next((kind for name, kind in self.kernels if name.lstrip(".") == called), None)


MAMBA2_MIXER = (("causal_conv1d_fn", CONV), ("mamba2_chunk_scan", MAMBA2),
                ("mamba2_split_conv1d_scan_combined", FUSED))
_GDN_STATE = "gated delta rule: each run's end state and d_k x d_k transition per head, one all-gather per layer"
_MAMBA2_STATE = "Mamba2: each run's end state and decay per head, one all-gather per layer"

HYBRIDS: Dict[str, HybridFamily] = {t: family for family in (
    HybridFamily(model_types=("qwen3_5_text", "qwen3_5"), module="qwen3_5", layer_types=("linear_attention",),
                 state=_GDN_STATE, tiled=("Qwen3_5ForCausalLM", "Qwen3_5MLP", "Qwen3_5RMSNorm",
                                                         "Qwen3_5RMSNormGated")),
    HybridFamily(model_types=("qwen3_5_moe_text", "qwen3_5_moe"), module="qwen3_5_moe",
                 layer_types=("linear_attention",), state=_GDN_STATE),
    HybridFamily(model_types=("qwen3_next",), module="qwen3_next", layer_types=("linear_attention",),
                 state=_GDN_STATE),
    HybridFamily(model_types=("olmo_hybrid",), module="olmo_hybrid", layer_types=("linear_attention",),
                 state=_GDN_STATE),
    HybridFamily(model_types=("kimi_linear",), module="kimi_linear", layer_types=("linear_attention",),
                 state="KDA: each run's end state and d_k x d_k transition per head, one all-gather",
                 attention=("KimiLinearAttention",)),
    HybridFamily(model_types=("bailing_hybrid",), module="bailing_hybrid", layer_types=("linear_attention",),
                 state="KDA, as Kimi Linear"),
    # Its block builds the mixer through a mapping of mixer names to classes, which the code does not show.
    HybridFamily(model_types=("nemotron_h",), module="nemotron_h", layers=("NemotronHBlock",),
                 mixers=("NemotronHMamba2Mixer",), kernels=MAMBA2_MIXER, layer_types=("linear_attention", "mamba"),
                 state=_MAMBA2_STATE),
    HybridFamily(model_types=("granitemoehybrid",), module="granitemoehybrid", layer_types=("linear_attention", "mamba"),
                 state=_MAMBA2_STATE),
    HybridFamily(model_types=("bamba",), module="bamba", layer_types=("linear_attention", "mamba"), state=_MAMBA2_STATE),
    HybridFamily(model_types=("falcon_h1",), module="falcon_h1", layer_types=("hybrid",),
                 state="Mamba2 beside attention in every layer: as Nemotron-H"),
    HybridFamily(model_types=("lfm2",), module="lfm2", layer_types=("conv",),
                 state="short convolution: each run's last k-1 rows, one all-gather per layer"),
    HybridFamily(model_types=("lfm2_moe",), module="lfm2_moe", layer_types=("conv",), state="short convolution, as LFM2"),
    HybridFamily(model_types=("mamba",), module="mamba", layer_types=("linear_attention", "mamba"),
                 state="Mamba, as Jamba: a state-space model with no attention",
                 plain=("MambaForCausalLM", "MambaModel", "MambaRMSNorm"), entry=("MambaForCausalLM",)),
    HybridFamily(model_types=("falcon_mamba",), module="falcon_mamba", layer_types=("linear_attention", "mamba"),
                 state="Mamba, as Jamba: a state-space model with no attention",
                 plain=("FalconMambaForCausalLM", "FalconMambaModel", "FalconMambaRMSNorm"),
                 entry=("FalconMambaForCausalLM",)),
    HybridFamily(model_types=("mamba2",), module="mamba2", layer_types=("linear_attention", "mamba"),
                 state="Mamba2, as Nemotron-H: a state-space model with no attention",
                 plain=("Mamba2ForCausalLM", "Mamba2Model", "Mamba2RMSNorm"), entry=("Mamba2ForCausalLM",)),
    HybridFamily(model_types=("jamba",), module="jamba", layer_types=("linear_attention", "mamba"),
                 state="Mamba: each run's end state and decay per channel and state"),
    HybridFamily(model_types=("zamba",), module="zamba", layer_types=("linear_attention", "mamba", "hybrid"),
                 state="Mamba, as Jamba; its hybrid layers run an attention block shared across depths, then Mamba"),
    HybridFamily(model_types=("zamba2",), module="zamba2", layer_types=("linear_attention", "mamba", "hybrid"),
                 state="Mamba2, as Nemotron-H; its hybrid layers run attention blocks shared across depths, then Mamba2"),
    # Its lightning attention is computed inside the layer's forward, which is the kernel hooked.
    HybridFamily(model_types=("minimax",), module="minimax", layer_types=("linear_attention",),
                 state="lightning attention: each run's end state, and its decay per head, one all-gather per layer; "
                       "a run that does not start the sequence runs again from its true start",
                 layers=("MiniMaxDecoderLayer",), mixers=("MiniMaxLightningAttention",),
                 kernels=(("MiniMaxLightningAttention.forward", LIGHTNING),), own_cache="MiniMaxCache"),
    # Its recurrence is a method and its convolution a module, neither a kernel function the code can be read for.
    HybridFamily(model_types=("recurrent_gemma",), module="recurrent_gemma",
                 layer_types=("linear_attention", "recurrent", "attention"),  # before transformers 5.2x: the last two
                 state="RG-LRU: each run's end state and decay per channel, one all-gather per layer",
                 layers=("RecurrentGemmaDecoderLayer",), mixers=("RecurrentGemmaRecurrentBlock",),
                 kernels=(("RecurrentGemmaRglru._rnn_scan", RGLRU), (".temporal_block.conv_1d", CONV_MODULE)),
                 conv_state="conv1d_state",
                 attention=("RecurrentGemmaAttention",),
                 plain=("RecurrentGemmaForCausalLM", "RecurrentGemmaModel", "RecurrentGemmaRMSNorm",
                        "RecurrentGemmaMlp", "RecurrentGemmaRotaryEmbedding")),
    # Its mixing is a kernel function and two row shifts (nn.ZeroPad2d), in the attention and the feed-forward block;
    # its blocks are called without model(...)'s keyword arguments.
    HybridFamily(model_types=("rwkv",), module="rwkv", layer_types=(),
                 state="WKV: each run's numerator and denominator per channel and their decay, one all-gather per "
                       "layer; a run that does not start the sequence runs again from its true start; the time shifts "
                       "get the row before each run",
                 layers=("RwkvBlock",), mixers=("RwkvSelfAttention",),
                 kernels=(("rwkv_linear_attention", WKV), (".attention.time_shift", SHIFT),
                          (".feed_forward.time_shift", SHIFT)),
                 plain=("RwkvForCausalLM", "RwkvModel", "RwkvFeedForward"), entry=("RwkvForCausalLM",),
                 row_states=((".attention.time_shift", 1), (".feed_forward.time_shift", 0))),
) for t in family.model_types}
"""Hybrid families by model type (a multimodal type under its own name and its text model's): what cannot be read
from the modeling code (how the state crosses ranks, the tiled classes, classes that only read like a mixer's, a
CausalLM that hands its layers no keyword arguments); the layers, mixers and kernels are found
(:func:`found_family`), and listed only where they cannot be."""


KERNEL_KINDS: Dict[str, str] = {
    "causal_conv1d_fn": CONV, "chunk_gated_delta_rule": DELTA, "chunk_kda": DELTA, "mamba_chunk_scan_combined": MAMBA2,
    "selective_scan_fn": MAMBA, "mamba_split_conv1d_scan_combined": FUSED, "mamba_inner_fn": FUSED,
}
"""The kernels the hooks compute over shards, by the name transformers resolves them under (whatever a modeling
file calls its function), and their kind."""

FOUND_LAYER_TYPES = ("linear_attention", "mamba", "conv")
"""The config's names for the layers of a family found by its kernels (:func:`found_family`): those of the table's
families whose layers hold a recurrent mixer alone (a "hybrid" layer, a mixer beside attention, is taken where
listed only); which modules mix the sequence is checked on the model itself."""


@functools.lru_cache(maxsize=None)
def family(model_type: Optional[str]) -> Optional[HybridFamily]:
    """The hybrid family of ``model_type`` whose hooks this transformers release can take: the table's, its layers,
    mixers and kernels found where it does not list them, or one found whole (:func:`found_family`); None for
    neither."""
    listed = HYBRIDS.get(model_type or "")
    if listed is None:
        return found_family(model_type) if model_type else None
    if not listed.layers:
        found = found_family(model_type, listed.module)
        if found is None:
            return None
        listed = dataclasses.replace(listed, layers=found.layers, mixers=found.mixers, kernels=found.kernels,
                                     needs=found.needs)
    return listed if listed.modeling_module() is not None else None


def found_family(model_type: str, module_name: Optional[str] = None) -> Optional[HybridFamily]:
    """A family read from ``model_type``'s modeling module (``module_name``: transformers' for the type; see
    :func:`_found_in`), or None. A type transformers does not ship (registered with the auto classes, as a model
    with code of its own is) is read from the module of the causal LM class registered for it."""
    if module_name is not None:
        path = _transformers_modeling(module_name)
    else:
        module_name = model_type_to_module_name(model_type)
        path = _transformers_modeling(module_name)
        if not _importable(path):
            path = _registered_modeling(model_type) or path
    found = _found_in(path)
    if found is None:
        return None
    layers, mixers, kernels, needs = found
    kinds = sorted({kind for _, kind in kernels if kind != FUSED})
    return HybridFamily(model_types=(model_type,), module=module_name, layers=layers, mixers=mixers, kernels=kernels,
                        needs=needs, layer_types=FOUND_LAYER_TYPES,
                        state=f"found by the kernels it calls ({', '.join(kinds)})",
                        modeling_path="" if path == _transformers_modeling(module_name) else path)


def _transformers_modeling(module_name: str) -> str:
    return f"transformers.models.{module_name}.modeling_{module_name}"


def _importable(path: str) -> bool:
    try:
        importlib.import_module(path)
    except ImportError:
        return False
    return True


def _registered_modeling(model_type: str) -> Optional[str]:
    """The module of the causal LM class registered for ``model_type`` with transformers' auto classes, or None."""
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]].__module__
    except (KeyError, ValueError):
        return None


def attention_routed(hybrid: HybridFamily) -> bool:
    """Whether every attention class of ``hybrid``'s modeling module (by name, its mixers aside) hands its attention
    to transformers' attention interface: its ``forward`` reads ``ALL_ATTENTION_FUNCTIONS``. The evidence taken for
    a family found by its kernels whose model class does not declare ``_supports_attention_backend`` (Qwen3.5 and
    the types copied from it do not); the table's families are tested."""
    module = hybrid.modeling_module()
    if module is None:
        return False
    classes = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, torch.nn.Module)
               and c.__module__ == module.__name__ and "Attention" in c.__name__ and c.__name__ not in hybrid.known]
    return bool(classes) and all("ALL_ATTENTION_FUNCTIONS" in _names_used(c, "forward") for c in classes)


@functools.lru_cache(maxsize=None)  # once per module: its source does not change
def _found_in(path: str) -> Optional[Tuple[Tuple[str, ...], Tuple[str, ...], Tuple[Tuple[str, str], ...],
                                           Tuple[Tuple[str, Tuple[str, ...]], ...]]]:
    """The layers, mixers and kernels of the modeling module ``path``, and the kinds each mixer runs: its
    module-level names defined as a kernel of :data:`KERNEL_KINDS` (:func:`declared_kernels`), the module's classes
    whose ``forward`` calls one of them, directly or through module functions (the mixers), and those whose
    ``__init__`` builds a mixer (the decoder layers). None where the module has no such kernel, mixer or layer: a
    mixer built another way is then listed by the structure check, and refused."""
    try:
        module = importlib.import_module(path)
    except ImportError:
        return None
    kernels = declared_kernels(module)
    kinds = dict(kernels)
    source = kernel_source.of_module(module)
    classes = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, torch.nn.Module)
               and c.__module__ == module.__name__]
    called = {c.__name__: _kernels_called(source, c, kinds) for c in classes}
    mixers = tuple(name for name, names in called.items() if names)
    layers = tuple(c.__name__ for c in classes if set(mixers) & _names_used(c, "__init__") and c.__name__ not in mixers
                   and issubclass(c, GradientCheckpointingLayer))
    if not kernels or not mixers or not layers:
        return None
    needs = tuple((m, tuple(sorted({kinds[n] for n in called[m]}))) for m in mixers)
    return layers, mixers, kernels, needs


def declared_kernels(module: ModuleType) -> Tuple[Tuple[str, str], ...]:
    """``(name, kind)`` for each module-level name of ``module`` that its source defines as a kernel of
    :data:`KERNEL_KINDS` (:mod:`.kernel_source`: whatever the name holds now, a user's replacement included), and
    the names the source does not define so that transformers' resolution wraps now (a module without a source
    file, a kernel assigned rather than decorated)."""
    source = kernel_source.of_module(module)
    declared = {name: kernel_name(registry.original(module, name)) for name, fn in vars(module).items()
                if callable(fn)}
    declared.update(source.declared if source is not None else {})
    return tuple((name, KERNEL_KINDS[found]) for name, found in declared.items()
                 if found in KERNEL_KINDS and hasattr(module, name))


def _kernels_called(source: Optional[kernel_source.Source], cls: type, kinds: Dict[str, str]) -> FrozenSet[str]:
    """The kernel names (of ``kinds``) ``cls.forward`` calls: read from the module's source through the module
    functions it calls, or, without a source, from the code of ``cls.forward`` itself."""
    if source is not None and (cls.__name__, "forward") in source.methods:
        return frozenset(source.kernels_reached(cls.__name__)) & frozenset(kinds)
    return frozenset(kinds) & frozenset(_names_used(cls, "forward"))


def _names_used(cls: type, method: str) -> set:
    """The global names the code of ``cls.method`` (its own, decorators unwrapped) reads."""
    fn = cls.__dict__.get(method)
    code = getattr(inspect.unwrap(fn), "__code__", None) if fn is not None else None
    return set(code.co_names) if code is not None else set()


def family_of(model: torch.nn.Module) -> Optional[HybridFamily]:
    """:func:`family` of ``model``'s language model (a multimodal model's by its text config)."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if config is not None else None
    return family(getattr(text, "model_type", None))


def own_cache(model: torch.nn.Module) -> Optional[type]:
    """The cache class of its own that ``model``'s hybrid family insists on, in place of any other (None: none)."""
    hybrid = family_of(model)
    if hybrid is None or not hybrid.own_cache:
        return None
    return getattr(hybrid.modeling_module(), hybrid.own_cache)


def recurrent_layers(model: torch.nn.Module) -> List[int]:
    """The layer indices (as the cache counts them) of ``model``'s recurrent and convolution layers that hf_ring
    computes over shards (none for a model that is not a hybrid hf_ring hooks)."""
    hybrid = family_of(model)
    if hybrid is None:
        return []
    return sorted({int(m.layer_idx) for m in model.modules() if type(m).__name__ in hybrid.mixers
                   and isinstance(getattr(m, "layer_idx", None), int)})


LAYER_WHY = ("binds the family's kernels (convolution, delta rule, Mamba scans) to hooks that compute them exactly "
             "over the sequence shards while one of its decoder layers runs a forward over shards (other calls "
             "untouched)")
KERNEL_WHY = "computed over the sequence shards while one decoder layer of a hybrid runs a forward over shards"
ENTRY_WHY = ("hands a forward's sequence-sharding context to the model's layers, which its own forward calls without "
             "model(...)'s keyword arguments (a pre-hook on each layer for the length of the call)")


def apply(hybrid: HybridFamily) -> None:
    """Hook the family's decoder layers (idempotent, undone by :func:`hf_ring.patches.revert_all`)."""
    module = hybrid.modeling_module()
    if module is None:
        return
    for name in hybrid.layers:
        registry.replace(getattr(module, name), "forward", lambda original: _layer_forward(original, hybrid),
                         LAYER_WHY)
    for name in hybrid.entry:
        registry.replace(getattr(module, name), "forward", lambda original: _entry_forward(original, hybrid),
                         ENTRY_WHY)


def _entry_forward(original: Callable, hybrid: HybridFamily) -> Callable:
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        context = kwargs.get(CONTEXT_KEY)
        if not isinstance(context, ShardedForward):
            return original(self, *args, **kwargs)
        handles = [m.register_forward_pre_hook(functools.partial(_with_context, context), with_kwargs=True)
                   for m in self.modules() if type(m).__name__ in hybrid.layers]
        try:
            return original(self, *args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()

    return forward


def _with_context(context: ShardedForward, module: torch.nn.Module, args: tuple, kwargs: dict):
    """A layer's call given the forward's context (a checkpointed layer keeps it for its recomputation)."""
    return args, {**kwargs, CONTEXT_KEY: context}


def _layer_forward(original: Callable, hybrid: HybridFamily) -> Callable:
    # Inside activation checkpointing, so that a layer's recomputation in the backward binds the kernels again.
    inside = layer_forward_inside(original)
    # a layer whose forward takes no **kwargs (RWKV's block) is handed the context by this wrapper alone
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(original).parameters.values())

    def forward(self, *args, **kwargs):
        context = kwargs.get(CONTEXT_KEY) if open_ended else kwargs.pop(CONTEXT_KEY, None)
        if not isinstance(context, ShardedForward) or not hybrid.recurrent(self) or (
                context.world_size == 1 and context.documents is None and not context.long):
            return inside(self, *args, **kwargs)  # one process holds the whole sequence: the layer as it is
        return _over_shards(inside, hybrid, context, self, args, kwargs)

    forward.__wrapped__ = inside
    return as_layer_forward(forward, original)


@torch.compiler.disable  # collectives and host-side run lists: outside a compiled graph, on purpose
def _over_shards(original: Callable, hybrid: HybridFamily, context: ShardedForward, layer, args, kwargs):
    mixer = hybrid.mixer(layer)
    problem = _swapped(hybrid, layer)
    if problem is not None:  # before the layer computes: its kernels would never be called
        context.fail(ValueError(
            f"the {type(layer).__name__} layer of {hybrid.model_types[0]!r}: {problem}, which hf_ring cannot compute "
            "over sequence shards; load the model with use_kernels=False (transformers 5.25 and later kernelize by "
            "default; USE_HUB_KERNELS=0 turns it off), or run it in one process"))
    call = LayerCall(context, getattr(mixer, "layer_idx", None))
    states = kwargs.get("state") if hybrid.row_states else None
    if states is not None:
        call.row_states = {name[1:]: functools.partial(_set_row, states[entry], layer.layer_id)
                           for name, entry in hybrid.row_states}
    with _kernels_hooked(hybrid, call, layer, mixer):
        out = original(layer, *args, **kwargs)
    for name, keep in call.row_states.items():  # the layer kept its shard's last row: the sequence's instead
        if name in call.tails:
            keep(call.tails[name][..., -1])
    missing = hybrid.needed(layer) - {hybrid.kind_of(name) for name in call.calls}
    if missing:
        names = ", ".join(n for n, k in hybrid.kernels if k in missing)
        context.fail(ValueError(
            f"the {type(layer).__name__} layer of {hybrid.model_types[0]!r} ran its mixer without calling its "
            f"{', '.join(sorted(missing))} kernel through hf_ring ({names} in its modeling module), so that part of "
            "the layer did not see the rest of the sequence: its forward was replaced (a hub kernel loaded with "
            "use_kernels=True?), or calls its kernel another way in this transformers release; load the model "
            "without kernels, or run it in one process"))
    context.mixing()
    return out


def _swapped(hybrid: HybridFamily, layer: torch.nn.Module) -> Optional[str]:
    """What a hub kernel replaced in ``layer``'s mixers, or None: a mixer's whole forward, or the forward of one of
    the kernel functions it holds (``kernels``' ``use_kernelized_func`` gives each mixer its own copy of them, which
    ``kernelize`` replaces: a replaced one computes outside the hooks, or handles the cache itself)."""
    for mixer in (m for m in layer.modules() if type(m).__name__ in hybrid.mixers):
        swapped = swapped_forward(mixer)
        if swapped is not None:
            return (f"its {type(mixer).__name__}'s forward was replaced by {_described(swapped)} (a hub kernel loaded "
                    "with use_kernels=True?)")
        for name, held in getattr(mixer, "_kernel_funcs", {}).items():
            swapped = swapped_forward(held) if isinstance(held, torch.nn.Module) else None
            if swapped is not None:
                repo = vars(held).get("_kernel_repo")
                return (f"its {type(mixer).__name__}'s {name} was replaced by {_described(swapped)}"
                        f"{f' from {repo}' if repo is not None else ''} (kernelize, as use_kernels=True runs it)")
    return None


def _described(fn: object) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def kernel_owner(module: ModuleType, name: str) -> Optional[Tuple[object, str]]:
    """Where a kernel the family table names lives: ``(module, function)`` for a module-level function, ``(class,
    method)`` for ``"Class.method"`` (a class of the modeling module); None where this release has no such name."""
    owner_name, _, attr = name.rpartition(".")
    owner = getattr(module, owner_name, None) if owner_name else module
    return (owner, attr) if owner is not None and hasattr(owner, attr) else None


LEADING: Dict[str, int] = {CONV: 1, **{kind: scan.inputs for kind, scan in SCANS.items()}}
"""Per kind of hooked kernel, the arguments its hook passes by position (it passes the others by name)."""


def replacement_problem(module: ModuleType, name: str, kind: str, held: object) -> Optional[str]:
    """Why what ``module``'s kernel ``name`` (a function, or ``"Class.method"``) holds now cannot run under the hook
    of its ``kind``, or None: it must take the parameters its modeling file defines by the same names (the first by
    position, as the hook passes them), since the hook reads and passes them by those names. Nothing is asked of a
    kind whose hook passes no arguments of its own (a fused kernel, declined) or a name the source does not define."""
    source = kernel_source.of_module(module)
    owner, _, attr = name.rpartition(".")
    defined = source.parameters.get((owner, attr) if owner else attr) if source is not None else None
    if defined is None or kind not in LEADING:
        return None
    what = f"{module.__name__}.{name} holds {_described(held)}"
    if not callable(held):
        return f"{what}, which is not callable; put a {kind} kernel back there"
    try:
        signature = inspect.signature(kernel_function(held))
    except (TypeError, ValueError):
        return f"{what}, whose signature cannot be read; give it one that takes ({', '.join(defined)})"
    leading = min(len(defined), LEADING[kind] + (1 if owner else 0))  # a method takes its instance first
    try:
        signature.bind_partial(*(None,) * leading, **{p: None for p in defined[leading:]})
    except TypeError as e:
        return (f"{what}, which does not take the parameters of the {kind} kernel its modeling file defines "
                f"({', '.join(defined)}; {e}): hf_ring runs a replacement under that kernel's hook only where it "
                "takes them by the same names; give it those parameters, or put the original back")
    return None


def swapped_forward(mixer: torch.nn.Module) -> Optional[Callable]:
    """The function a hub kernel put in place of ``mixer``'s own forward, or None: ``kernels.kernelize`` (what
    ``use_kernels=True`` runs) binds its layer's forward on the instance; accelerate's hooks, which also bind one
    there, keep the forward they wrap as ``_old_forward``, which is looked through."""
    own = vars(mixer)
    forward = own.get("_old_forward", own.get("forward"))
    if forward is None:
        return None
    fn = getattr(forward, "__func__", forward)
    return None if fn is inspect.unwrap(type(mixer).forward) or fn is type(mixer).forward else fn


def _set_row(state: torch.Tensor, layer_id: int, row: torch.Tensor) -> None:
    """One layer's entry ``(B, C)`` of a state list entry ``(B, C, layers)`` (RWKV's), set to ``row``."""
    state[:, :, layer_id] = row.to(state.dtype)


def _keep_conv_state(mixer: torch.nn.Module, attr: str, tail: torch.Tensor) -> None:
    """A prefill's convolution state on the mixer (``attr``): the whole sequence's last rows, where the layer kept
    its own shard's; nothing where the layer keeps none (a forward without a cache sets it to None)."""
    if getattr(mixer, attr, None) is not None:
        setattr(mixer, attr, tail)


def _bound_hook(kind: str, method: Callable, call: LayerCall, name: str) -> Callable:
    """A method's hook, bound to the instance it is called on (RecurrentGemma's ``RecurrentGemmaRglru._rnn_scan``)."""
    def hook(self, *args, **kwargs):
        return hooked(kind, method.__get__(self), call, name)(*args, **kwargs)

    return hook


@contextlib.contextmanager
def _kernels_hooked(hybrid: HybridFamily, call: LayerCall, layer: torch.nn.Module,
                    mixer: torch.nn.Module) -> Iterator[None]:
    """The family's kernels bound to their hooks over ``call`` for the length of one call of the decoder ``layer``
    (whose mixer is ``mixer``); a kernel package release the hooks cannot run on refused first
    (:func:`.recurrent.package_problem`), before the layer computes (the package is the same on every rank).

    A kernel is a module-level function, a method (``"Class.method"``, bound on the class) or a module of the layer
    that mixes neighbouring rows (``".path.to.it"`` from the layer: its ``forward``, bound on that module). The
    context is bound here, not read from a kernel's call: not every mixer hands the forward's keyword arguments on to
    its kernels (Nemotron-H's ``mamba2_chunk_scan`` and Jamba's ``mamba_selective_scan`` get none).
    """
    module = hybrid.modeling_module()
    with contextlib.ExitStack() as scope:
        for name, kind in hybrid.kernels:
            if name.startswith("."):
                part = operator.attrgetter(name[1:])(layer)
                if hybrid.conv_state:
                    call.conv_state = functools.partial(_keep_conv_state, mixer, hybrid.conv_state)
                scope.enter_context(registry.scoped(part, "forward", hooked(kind, part, call, name[1:]), KERNEL_WHY))
                continue
            owner, attr = kernel_owner(module, name)
            kernel = getattr(owner, attr)
            problem = replacement_problem(module, name, kind, kernel) or package_problem(kernel)
            if problem is not None:
                call.context.fail(ValueError(f"the {type(layer).__name__} layer of {hybrid.model_types[0]!r} over "
                                             f"sequence shards: {problem}"))
            hook = _bound_hook(kind, kernel, call, name) if isinstance(owner, type) else hooked(kind, kernel, call, name)
            scope.enter_context(registry.scoped(owner, attr, hook, KERNEL_WHY))
        yield
