"""Mistral: global-length RoPE like Llama. Its ``sliding_window`` reaches the attention
function as a keyword and is applied there on global positions, across shard borders."""
from .rope import is_patched, patch_rotary, unpatch_rotary


def _rotary():
    from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding

    return MistralRotaryEmbedding


def apply_ring_to_mistral() -> None:
    """Patch Mistral for sequence-sharded ``ring_dilated`` runs (reversible, idempotent)."""
    patch_rotary(_rotary())


def revert_ring_from_mistral() -> None:
    unpatch_rotary(_rotary())


def is_applied() -> bool:
    return is_patched(_rotary())
