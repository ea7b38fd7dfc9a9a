"""``config.ring_dilated``: how a model's ``ring_dilated`` attention is laid out, kept in config.json."""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from collections import Counter
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ..engine.balance import Work
from ..engine.layout import Layout, check_layout, check_ulysses_size, head_split, layout_name
from ..engine.pattern import DilatedPattern, coverage_message
from .groups import current

CONFIG_KEY = "ring_dilated"
ATTN_IMPLEMENTATION = "ring_dilated"
"""The ``attn_implementation`` name hf_ring registers with transformers."""
_KEYS = {"segment_lengths", "dilation_rates", "layout", "ulysses_size"}


@dataclass(frozen=True)
class RingConfig:
    pattern: Optional[DilatedPattern]
    layout: str = "zigzag"
    ulysses_size: Optional[int] = None  # None: whatever hf_ring.setup_sequence_parallel was given


def attn_implementations(config: Any) -> Tuple[str, ...]:
    """Every attention implementation a transformers config names (a dict form names one per sub-model)."""
    impl = getattr(config, "_attn_implementation", None)
    if isinstance(impl, Mapping):
        return tuple(str(v) for v in impl.values() if v is not None)
    return (str(impl),)


def decoder_config(config: Any) -> Any:
    """The config of the model's layers that run the ring: a multimodal model's text config, else ``config``."""
    text = getattr(config, "get_text_config", None)
    return config if text is None else text(decoder=True)


def runs_ring(config: Any) -> bool:
    """Whether a model with this config runs ``ring_dilated`` attention in every layer."""
    return all(impl == ATTN_IMPLEMENTATION for impl in attn_implementations(config))


def model_heads(config: Any) -> Optional[Tuple[int, int]]:
    """``(query heads, K/V heads)`` of a transformers config, or None when it does not say."""
    config = getattr(config, "get_text_config", lambda: config)()
    hq = getattr(config, "num_attention_heads", None)
    if not isinstance(hq, int):
        return None
    hkv = getattr(config, "num_key_value_heads", None)
    return hq, hkv if isinstance(hkv, int) else hq


@functools.lru_cache(maxsize=64)  # every layer of every forward asks; the answer depends on these two alone
def _coverage(pattern: DilatedPattern, num_heads: int) -> Optional[str]:
    return coverage_message(pattern, num_heads)


def warn_coverage(pattern: Optional[DilatedPattern], config: Any) -> None:
    """Warn when ``pattern`` leaves positions that no query head of the model reads (see
    :meth:`DilatedPattern.coverage_gaps`); Python's warning filter shows it once per place."""
    heads = model_heads(config)
    if pattern is None or heads is None:
        return
    message = _coverage(pattern, heads[0])
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=3)


def parse(value: Optional[Mapping[str, Any]]) -> RingConfig:
    """Validate a ``config.ring_dilated`` dict; ``None`` means dense attention, zigzag layout."""
    if value is None:
        return RingConfig(None)
    if not isinstance(value, Mapping):
        raise TypeError(f"config.{CONFIG_KEY} must be a dict, got {type(value).__name__}")
    unknown = set(value) - _KEYS
    if unknown:
        raise ValueError(f"config.{CONFIG_KEY} has unknown keys {sorted(unknown)}; allowed: {sorted(_KEYS)}")
    layout = check_layout(value.get("layout", "zigzag"))
    has = [k in value for k in ("segment_lengths", "dilation_rates")]
    if any(has) and not all(has):
        raise ValueError(f"config.{CONFIG_KEY} needs both segment_lengths and dilation_rates, or neither")
    pattern = DilatedPattern(value["segment_lengths"], value["dilation_rates"]) if all(has) else None
    ulysses = value.get("ulysses_size")
    return RingConfig(pattern, layout, None if ulysses is None else check_ulysses_size(ulysses))


def shape_conflict(saved: RingConfig, layout: Layout, ulysses_size: int) -> Optional[str]:
    """What a model's saved ``config.ring_dilated`` says against a sequence-parallel setup's shape, or None.

    The saved pattern belongs to the model; a saved layout or ``ulysses_size``
    must match the setup's (a model trained head-parallel in groups of 2 keeps
    that size), and a mismatch is refused before anything runs, naming both.
    """
    layout = layout_name(layout)
    if saved.layout != layout:
        return (f"the model's config.{CONFIG_KEY} has layout={saved.layout!r} but the sequence-parallel setup has "
                f"layout={layout!r}; pass the same to hf_ring.setup_sequence_parallel (or prepare_trainer), or change "
                "the model's with hf_ring.configure(model, layout=...)")
    if saved.ulysses_size not in (None, ulysses_size):
        return (f"the model's config.{CONFIG_KEY} has ulysses_size={saved.ulysses_size} but the sequence-parallel "
                f"setup has ulysses_size={ulysses_size}; pass the same to hf_ring.setup_sequence_parallel "
                "(prepare_trainer takes it from the config), or change the model's with hf_ring.configure")
    return None


def configure(model: Any, pattern: Union[DilatedPattern, Mapping[str, Any], None] = None,
              layout: str = "zigzag", ulysses_size: Optional[int] = None) -> Any:
    """Set the dilation pattern, layout and head-parallel size of ``model`` (stored in ``model.config.ring_dilated``;
    a multimodal model's in its text config's, which its language model's layers read).

    ``pattern=None`` is exact dense attention; a pattern whose dilation rates
    exceed the model's query heads leaves some positions unread by every
    head at long distances, and is warned about. ``ulysses_size``: ranks per
    head-parallel group this model is trained with (see
    :func:`hf_ring.setup_sequence_parallel`); :func:`hf_ring.prepare_trainer`
    takes it from here; under a sequence-parallel setup with another layout
    or ``ulysses_size`` this call is refused, and so is a call of a model
    that carries them.
    Returns the model.
    """
    if isinstance(pattern, Mapping):
        pattern = DilatedPattern.from_dict(pattern)
    if pattern is not None and not isinstance(pattern, DilatedPattern):
        raise TypeError(f"pattern must be a DilatedPattern, a dict or None, got {type(pattern).__name__}")
    value: Dict[str, Any] = {"layout": check_layout(layout)}
    if pattern is not None:
        value.update(pattern.to_dict())
    if ulysses_size is not None:
        value["ulysses_size"] = check_ulysses_size(ulysses_size)
        heads = model_heads(getattr(model, "config", model))
        if heads is not None:
            head_split(*heads, ulysses_size)
    sp = current()
    if sp is not None and sp.sp_size > 1:  # refused now, not at the model's first call under that setup
        conflict = shape_conflict(parse(value), sp.layout, sp.ulysses_size)
        if conflict is not None:
            raise ValueError(conflict)
    config = decoder_config(getattr(model, "config", model))
    warn_coverage(pattern, config)
    setattr(config, CONFIG_KEY, value)
    return model


def layer_windows(config: Any) -> List[Optional[int]]:
    """The sliding window of each layer, as the model passes it to its attention.

    ``layer_types`` names the windowed layers (Gemma 2/3, gpt-oss, Qwen2...);
    without it every layer has ``config.sliding_window`` (Mistral, Phi-3).
    A layer type other than ``sliding_attention`` keeps every row.
    """
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * n
    return [window if kind == "sliding_attention" else None for kind in types]


def attention_work(config: Any) -> Work:
    """What a document's rows cost in a model's attention layers (for ``layout="balanced"``): per layer its window
    or its ``ring_dilated`` pattern; a layer ``layer_types`` calls neither full nor sliding attention (a
    recurrent or convolution layer) costs per row alike everywhere, and is not counted."""
    config = decoder_config(getattr(config, "config", config))
    pattern = parse(getattr(config, CONFIG_KEY, None)).pattern
    branches = () if pattern is None else tuple(tuple(b) for b in pattern.branches)
    types = getattr(config, "layer_types", None) or ("full_attention",) * int(config.num_hidden_layers)
    kinds = Counter((window, branches) for kind, window in zip(types, layer_windows(config))
                    if kind in ("full_attention", "sliding_attention"))
    return Work(tuple((count, window, b) for (window, b), count in sorted(kinds.items(), key=repr)))
