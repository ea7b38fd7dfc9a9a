"""Per-model-family patches for sequence-sharded runs (shipped as ``hf_ring.patches``).

One module per family, one registry from ``config.model_type`` to its patch.
Patches are applied when sequence parallelism is set up and reverted when it
is cleared; unsharded runs behave exactly like the unpatched model.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from . import llama, mistral

PATCHES: Dict[str, Tuple[Callable[[], None], Callable[[], None], Callable[[], bool]]] = {
    "llama": (llama.apply_ring_to_llama, llama.revert_ring_from_llama, llama.is_applied),
    "mistral": (mistral.apply_ring_to_mistral, mistral.revert_ring_from_mistral, mistral.is_applied),
}


def supported() -> Tuple[str, ...]:
    return tuple(sorted(PATCHES))


def _model_type(model_or_type: Any) -> str:
    if isinstance(model_or_type, str):
        return model_or_type
    config = getattr(model_or_type, "config", model_or_type)
    return getattr(config, "model_type", type(model_or_type).__name__)


def check_supported(model_or_type: Any) -> str:
    model_type = _model_type(model_or_type)
    if model_type not in PATCHES:
        raise ValueError(
            f"model type {model_type!r} has no hf_ring patch for sequence-sharded runs; "
            f"supported: {', '.join(supported())}"
        )
    return model_type


def apply(model_or_type: Any) -> None:
    """Apply the patch for ``model.config.model_type`` (or a model type string)."""
    PATCHES[check_supported(model_or_type)][0]()


def revert(model_or_type: Any) -> None:
    PATCHES[check_supported(model_or_type)][1]()


def is_applied(model_or_type: Any) -> bool:
    return PATCHES[check_supported(model_or_type)][2]()


def apply_all() -> None:
    for patch, _, _ in PATCHES.values():
        patch()


def revert_all() -> None:
    for _, undo, _ in PATCHES.values():
        undo()
