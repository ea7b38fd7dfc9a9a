"""``config.ring_dilated``: how a model's ``ring_dilated`` attention is laid out, kept in config.json."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Union

from .layout import check_layout
from .pattern import DilatedPattern

CONFIG_KEY = "ring_dilated"
_KEYS = {"segment_lengths", "dilation_rates", "layout"}


@dataclass(frozen=True)
class RingConfig:
    pattern: Optional[DilatedPattern]
    layout: str = "zigzag"


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
    return RingConfig(pattern, layout)


def configure(model: Any, pattern: Union[DilatedPattern, Mapping[str, Any], None] = None,
              layout: str = "zigzag") -> Any:
    """Set the dilation pattern and layout of ``model`` (stored in ``model.config.ring_dilated``).

    ``pattern=None`` is exact dense attention. Returns the model.
    """
    if isinstance(pattern, Mapping):
        pattern = DilatedPattern.from_dict(pattern)
    if pattern is not None and not isinstance(pattern, DilatedPattern):
        raise TypeError(f"pattern must be a DilatedPattern, a dict or None, got {type(pattern).__name__}")
    value: Dict[str, Any] = {"layout": check_layout(layout)}
    if pattern is not None:
        value.update(pattern.to_dict())
    config = getattr(model, "config", model)
    setattr(config, CONFIG_KEY, value)
    return model
