"""Llama: the rotary embedding must see the global length under sequence parallelism."""
from .rope import rotary_patch

_apply, _revert, is_applied = rotary_patch("transformers.models.llama.modeling_llama", "LlamaRotaryEmbedding")


def apply_ring_to_llama() -> None:
    """Patch Llama for sequence-sharded ``ring_dilated`` runs (reversible, idempotent)."""
    _apply()


def revert_ring_from_llama() -> None:
    _revert()
