"""Tiny decoder models built from a config, saved with safetensors and loaded back."""
from __future__ import annotations

import os
import tempfile

import torch

_SAVED: dict = {}


HEAD_DIM = 16
FAMILY_CONFIG = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma2": dict(query_pre_attn_scalar=HEAD_DIM),
    "gemma3_text": dict(query_pre_attn_scalar=HEAD_DIM, layer_types=["sliding_attention", "full_attention"]),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
    "phi3": dict(pad_token_id=None, eos_token_id=2),
    "olmo2": dict(eos_token_id=2),
}
"""Per family, what a 2-layer, hidden-64 model needs beyond the common sizes (few experts for MoE)."""


def length_dependent_rope(kind: str) -> dict:
    """Config overrides giving ``kind`` a RoPE whose frequencies depend on the call's length.

    ``dynamic`` beyond 16 positions; Phi-3 takes only ``longrope`` (long factors past 32
    positions, between the largest positions two zigzag shards of 40 tokens hold); Gemma 3
    keeps plain RoPE on its sliding layers and makes the full layers dynamic.
    """
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    if kind == "phi3":
        return dict(max_position_embeddings=128, original_max_position_embeddings=32, rope_parameters={
            "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * (HEAD_DIM // 2),
            "long_factor": [1.0 + i for i in range(HEAD_DIM // 2)], "original_max_position_embeddings": 32})
    if kind == "gemma3_text":
        return dict(max_position_embeddings=16, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "full_attention": dict(dynamic, rope_theta=1e6)})
    return dict(max_position_embeddings=16, rope_parameters=dynamic)


def tiny_config(kind: str = "llama", **overrides):
    """A tiny config of model type ``kind`` (a key of FAMILY_CONFIG)."""
    from transformers import AutoConfig

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=4096,
                  attention_dropout=0.0, tie_word_embeddings=False)
    common.update(FAMILY_CONFIG[kind])
    common.update(overrides)
    return AutoConfig.for_model(kind, **common)


def saved_model_dir(kind: str = "llama", seed: int = 0, edit=None, **overrides) -> str:
    """A directory holding a tiny model (created once per process and argument set).

    ``edit(model)``, a module-level function, changes the weights before saving.
    """
    from transformers import AutoModelForCausalLM

    key = (kind, seed, getattr(edit, "__name__", None), repr(sorted(overrides.items())))
    if key not in _SAVED:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)
        if edit is not None:
            with torch.no_grad():
                edit(model)
        path = tempfile.mkdtemp(prefix=f"hf_ring_{kind}_")
        model.save_pretrained(path, safe_serialization=True)
        assert os.path.exists(os.path.join(path, "model.safetensors"))
        _SAVED[key] = path
    return _SAVED[key]


def load(path: str, attn: str, **kw):
    from transformers import AutoModelForCausalLM

    import hf_ring  # noqa: F401  (registers ring_dilated)

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32, **kw)
    return model.eval()


def batch(seed: int, b: int, n: int, vocab: int = 97, pad: str = "none"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    if pad == "right":
        mask[0, n - 5:] = 0
    elif pad == "left":
        mask[0, :7] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
