"""The benchmarks' models: the tiny Llama most of them train, and the Qwen3.5-like hybrid of ``bench hybrid`` and
``bench scale --hybrid``."""
from __future__ import annotations

from typing import Any, Dict, List

MODEL = dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1 << 22, attention_dropout=0.0,
             tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
"""A random Llama: hidden 256, 8 heads, 4 K/V heads, vocabulary 32000 (fp32 in every benchmark)."""

HYBRID = dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4,
              linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
              head_dim=32)
"""What makes :data:`MODEL` a Qwen3.5-like hybrid: its layer pattern (three gated delta rule layers, then one
attention layer) and linear-attention sizes."""
MIXER = "Qwen3_5GatedDeltaNet"
"""The hybrid's recurrent mixer class."""


def hybrid_config(**sizes: Any):
    """The Qwen3.5 text config of :data:`MODEL` (``sizes`` replacing its entries) with :data:`HYBRID`'s layers;
    four layers per :data:`HYBRID` pattern repeat when ``num_hidden_layers`` is a multiple of four."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    model: Dict[str, Any] = dict(MODEL, **sizes)
    layers = model["num_hidden_layers"]
    if layers % len(HYBRID["layer_types"]):
        raise ValueError(f"num_hidden_layers must be a multiple of {len(HYBRID['layer_types'])}, got {layers}")
    hybrid = dict(HYBRID, layer_types=HYBRID["layer_types"] * (layers // len(HYBRID["layer_types"])))
    return Qwen3_5TextConfig(**model, **hybrid)


def dilated_pattern(n: int, first: int = 2048) -> Dict[str, List[int]]:
    """The benchmarks' linear dilated pattern: segments first, 2·first, ... below n, then n itself; rates 1, 2, 4,
    ... (one per segment), so every query of a branch sees about ``first`` keys."""
    segs = []
    w = first
    while w < n:
        segs.append(w)
        w *= 2
    segs.append(n)
    return {"segment_lengths": segs, "dilation_rates": [1 << i for i in range(len(segs))]}
