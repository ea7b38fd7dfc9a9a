"""Mistral: global-length RoPE like Llama. Its ``sliding_window`` reaches the attention
function as a keyword and is applied there on global positions, across shard borders."""
from .rope import rotary_patch

_apply, _revert, is_applied = rotary_patch("transformers.models.mistral.modeling_mistral", "MistralRotaryEmbedding")


def apply_ring_to_mistral() -> None:
    """Patch Mistral for sequence-sharded ``ring_dilated`` runs (reversible, idempotent)."""
    _apply()


def revert_ring_from_mistral() -> None:
    _revert()
