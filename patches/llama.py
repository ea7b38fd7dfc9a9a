"""Llama: the rotary embedding must see the global length under sequence parallelism."""
from .rope import is_patched, patch_rotary, unpatch_rotary


def _rotary():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding


def apply_ring_to_llama() -> None:
    """Patch Llama for sequence-sharded ``ring_dilated`` runs (reversible, idempotent)."""
    patch_rotary(_rotary())


def revert_ring_from_llama() -> None:
    unpatch_rotary(_rotary())


def is_applied() -> bool:
    return is_patched(_rotary())
