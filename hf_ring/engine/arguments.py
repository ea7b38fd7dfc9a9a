"""Checks of plain argument values that modules on every floor of the library share."""
from __future__ import annotations

from typing import Any


def positive_int(value: Any, name: str, meaning: str = "") -> int:
    """``value`` when it is an int >= 1 (a bool is not); else a ValueError naming ``name`` and what it counts."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        what = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must be a positive int{what}, got {value!r}")
    return value
