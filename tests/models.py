"""Tiny Llama and Mistral models built from a config, saved with safetensors and loaded back."""
from __future__ import annotations

import os
import tempfile

import torch

_SAVED: dict = {}


def tiny_config(kind: str = "llama", **overrides):
    from transformers import LlamaConfig, MistralConfig

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  attention_dropout=0.0, tie_word_embeddings=False)
    if kind == "mistral":
        common["sliding_window"] = None
    common.update(overrides)
    return (MistralConfig if kind == "mistral" else LlamaConfig)(**common)


def saved_model_dir(kind: str = "llama", seed: int = 0, **overrides) -> str:
    """A directory holding a tiny model (created once per process and argument set)."""
    from transformers import AutoModelForCausalLM

    key = (kind, seed, repr(sorted(overrides.items())))
    if key not in _SAVED:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)
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
