"""What a model does along the sequence besides attention, read from its config and modules.

Sequence parallelism splits every layer's input along the sequence; only the
attention exchanges rows between ranks. Anything else that carries
information along the sequence (a state-space scan, linear attention, a
convolution over tokens, attention the backend never sees) would run on each
shard alone and give a silently wrong result, so such models are refused.
"""
from __future__ import annotations

import functools
import re
from typing import Any, List, Optional

import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from .families import MULTIMODAL
from .hybrids import HYBRIDS, attention_routed, family

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""Layer types the ring attention computes exactly (windows and chunks are applied on global positions)."""
TOKENWISE_LAYER_TYPES = ("moe", "mlp", "dense", "sparse")
"""Layer types that act on each token alone (hybrid configs list feed-forward layers among the mixers)."""

_LAYER_TYPE_REASONS = {
    "linear_attention": "recurrent layers (state-space or linear attention) carry a state along the sequence",
    "mamba": "Mamba layers carry a state along the sequence",
    "hybrid": "hybrid layers mix the sequence beside or inside their attention (a state-space mixer, convolutions)",
    "hybrid_sliding": "hybrid layers mix the sequence beside or inside their sliding-window attention",
    "conv": "convolution layers mix neighbouring tokens",
}

SEQUENCE_MIXER = re.compile(r"Mamba|Mixer|DeltaNet|DeltaAttention|LinearAttention|Lightning|Rglru|Recurrent|ShortConv|"
                            r"Rwkv|Hyena|SSM|LSTM")
"""Class names of transformers' non-attention sequence mixers (a safety net beside the layer types)."""
SEQUENCE_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
MULTIMODAL_KEYS = ("vision_config", "audio_config", "speech_config", "vision_tower_config")
SHOWN = 4


def _listed(items) -> str:
    items = list(items)
    return ", ".join(str(i) for i in items[:SHOWN]) + (" ..." if len(items) > SHOWN else "")


def _layer_types(config) -> Optional[List[str]]:
    for key in ("layer_types", "layers_block_type"):
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)) and value:
            return [str(v) for v in value]
    return None


def _causal_lm_class(config) -> Optional[type]:
    return _causal_lm_class_of(type(config))


@functools.lru_cache(maxsize=None)  # the attention calls the check on every layer: keep the lookup out of that path
def _causal_lm_class_of(config_type: type) -> Optional[type]:
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[config_type]
    except (KeyError, ValueError):
        return None


def _backend_problems(cls: Optional[type], model_type: Optional[str] = None) -> List[str]:
    if cls is None or getattr(cls, "_supports_attention_backend", True) or (model_type or "") in HYBRIDS:
        return []  # a listed hybrid family: its attention layers are known (tested) to go through the interface
    hybrid = family(model_type)
    if hybrid is not None and attention_routed(hybrid):
        return []  # a family found by its kernels, every attention class of which calls the interface
    return [f"{cls.__name__} does not declare that its attention goes through transformers' attention interface "
            "(its class leaves _supports_attention_backend False), so hf_ring cannot know that every attention of it "
            "sees the other shards"]


def multimodal_keys(config) -> List[str]:
    """The sub-configs of towers beside the language model (empty for a text model)."""
    return [k for k in MULTIMODAL_KEYS if getattr(config, k, None) is not None]


def config_problems(config) -> List[str]:
    """Reasons, read from the config, why sharding the sequence would change this model's result."""
    problems = []
    multimodal = multimodal_keys(config)
    if multimodal and getattr(config, "model_type", None) not in MULTIMODAL:
        problems.append(
            f"it is multimodal ({', '.join(multimodal)}) and not among the multimodal families whose split is "
            f"tested ({', '.join(sorted(MULTIMODAL))}); load the text model alone (e.g. AutoModelForCausalLM "
            "from the text config)"
        )
    types = _layer_types(config)
    hybrid = family(getattr(config, "model_type", None))
    handled = ATTENTION_LAYER_TYPES + TOKENWISE_LAYER_TYPES + (() if hybrid is None else hybrid.layer_types)
    if types is not None:
        foreign = [t for t in dict.fromkeys(types) if t not in handled]
        for t in foreign:
            where = [i for i, x in enumerate(types) if x == t]
            why = _LAYER_TYPE_REASONS.get(t, "they are not attention layers ring_dilated can shard")
            problems.append(f"layers [{_listed(where)}] are {t!r}: {why}")
    return problems


def module_problems(model: torch.nn.Module) -> List[str]:
    """Reasons, read from the modules, why sharding the sequence would change this model's result."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    problems = _backend_problems(type(model), model_type)
    hybrid = family(model_type)
    hooked = () if hybrid is None else hybrid.mixers  # computed over shards (hybrids.py), convolution included
    inside = {id(m) for mixer in model.modules() if type(mixer).__name__ in hooked for m in mixer.modules()}
    convs = [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
             if isinstance(m, SEQUENCE_CONVS) and id(m) not in inside]
    if convs:
        problems.append(f"convolutions mix neighbouring tokens: {_listed(convs)}")
    known = () if hybrid is None else hybrid.known
    mixers = sorted({type(m).__name__ for m in model.modules() if SEQUENCE_MIXER.search(type(m).__name__)
                     and id(m) not in inside and type(m).__name__ not in known})
    if mixers:
        problems.append(f"non-attention sequence mixers: {_listed(mixers)}")
    counting = counting_embeddings(model)
    counted = set() if counting is None else {id(m) for m in counting.modules()}
    numbered = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Embedding)
                and "position" in name and m.padding_idx is not None and id(m) not in counted]
    if numbered:
        problems.append(f"learned positions counted from the padding of its own input ids ({_listed(numbered)}), "
                        "which no shard holds whole, by code hf_ring does not know")
    return problems


def counting_embeddings(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The embeddings module that counts positions from the padding of its own input ids (RoBERTa-style:
    ``create_position_ids_from_input_ids(ids, padding_idx, offset)``), or None.

    Such a model numbers a row's tokens ``padding_idx + 1, + 2, ...`` skipping
    padding, where a shard would count from its own first row; the guard on a
    sharded call hands it the positions it would count on the whole row
    (:mod:`hf_ring.integration.positions`).
    """
    for m in model.modules():
        if callable(getattr(m, "create_position_ids_from_input_ids", None)) and \
                isinstance(getattr(m, "padding_idx", None), int) and \
                isinstance(getattr(m, "position_embeddings", None), torch.nn.Embedding):
            return m
    return None


def problems(model_or_config: Any) -> List[str]:
    """All reasons found for ``model_or_config`` (a model or a config); empty when it can be sharded."""
    if isinstance(model_or_config, torch.nn.Module):
        return config_problems(model_or_config.config) + module_problems(model_or_config)
    return config_problems(model_or_config) + _backend_problems(_causal_lm_class(model_or_config),
                                                                getattr(model_or_config, "model_type", None))
