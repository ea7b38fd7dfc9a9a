"""Models whose mask says more than causality, built tiny, and their rank functions (module-level so they pickle)."""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist

import hf_ring

TOL = 1e-5
N = 61
VOCAB = 97


def llama4_config(**overrides):
    """Llama 4 text: chunks of 8 on its RoPE layers, NoPE full-attention layers with temperature tuning from
    position 3 on, experts on every other layer."""
    from transformers import AutoConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=8,
              no_rope_layers=[1, 0, 1, 0], layer_types=["chunked_attention", "full_attention"] * 2,
              attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, num_local_experts=4,
              interleave_moe_layer_step=2, moe_layers=[1, 3], max_position_embeddings=512, attention_dropout=0.0,
              pad_token_id=0)
    kw.update(overrides)
    return AutoConfig.for_model("llama4_text", **kw)


def phimoe_config(**overrides):
    """PhiMoE: its sliding window lives only in its mask (the attention call passes none)."""
    from transformers import AutoConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
              max_position_embeddings=512, attention_dropout=0.0, pad_token_id=0)
    kw.update(overrides)
    return AutoConfig.for_model("phimoe", **kw)


def _batch(pad: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, N), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0  # left padding: chunks count from each row's first token
    return {"input_ids": ids, "attention_mask": mask}


def _model(config, attn: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def _plain(config):
    """The same config with the mask's own pattern taken out (no chunk, no window)."""
    config = config.__class__.from_dict(config.to_dict())
    if getattr(config, "attention_chunk_size", None):
        config.attention_chunk_size = 4 * N
    if getattr(config, "sliding_window", None):
        config.sliding_window = None
    return config


def text_logits(config, pad: int):
    """``ring_dilated`` and ``eager`` logits at the valid rows, and ``eager``'s without the mask's pattern."""
    batch = _batch(pad)
    valid = batch["attention_mask"].bool()
    out = []
    for cfg, attn in ((config, "ring_dilated"), (config, "eager"), (_plain(config), "eager")):
        with torch.no_grad():
            out.append(_model(cfg, attn).eval()(**batch).logits[valid])
    return tuple(out)


def step_case(config, pad: int = 0, ulysses: int = 1, generate: bool = False) -> Dict[str, Any]:
    """One training step: ``eager`` in one process (no process group), or ``ring_dilated`` with the sequence split
    over every rank; loss and every parameter gradient. ``generate``: hf_ring.generate instead, or its refusal."""
    batch = _batch(pad)
    # A left-padded row's first token has no predecessor: a padded row, which attends to nothing, would predict it.
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[0, pad] = -100
    if not dist.is_initialized():
        model = _model(config, "eager").eval()  # eval: no stochastic routing (PhiMoE samples in training)
        out = model(**batch, labels=labels)
        out.loss.backward()
        return {"loss": out.loss.detach(), "grads": {k: p.grad for k, p in model.named_parameters()}}
    sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses)
    try:
        model = _model(config, "ring_dilated")
        if generate:
            try:
                hf_ring.generate(model.eval(), batch["input_ids"][:1], max_new_tokens=2, do_sample=False)
            except NotImplementedError as err:
                return {"refused": str(err)}
            return {"refused": None}
        model.eval()
        out = model(**hf_ring.shard_batch({**batch, "labels": labels}))
        out.loss.backward()
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        return {"loss": loss, "grads": {k: torch.zeros_like(p) if p.grad is None else p.grad
                                        for k, p in model.named_parameters()}}
    finally:
        hf_ring.clear_sequence_parallel()


def _with_and_without_types(model, inputs, types):
    """``ring_dilated``'s and ``eager``'s logits with the token types, and ``eager``'s without them."""
    out = []
    for attn, kw in (("ring_dilated", {"token_type_ids": types}), ("eager", {"token_type_ids": types}), ("eager", {})):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            out.append(model(**inputs, **kw).logits)
    return tuple(out)


def gemma3_image_logits():
    """Gemma 3 with one image of 4 tokens inside a model of sliding (8) and full layers: ``ring_dilated``,
    ``eager``, and ``eager`` without the token types that make the image's tokens attend both ways."""
    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                  image_token_id=299, boi_token_id=297, eoi_token_id=298)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    ids[0, 10], ids[0, 11:15], ids[0, 15] = 297, 299, 298
    inputs = {"input_ids": ids, "pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))}
    types = (ids == 299).long()
    return _with_and_without_types(model, inputs, types)


def paligemma_logits():
    """PaliGemma: image tokens and prompt form a prefix that attends both ways, then the causal suffix."""
    from transformers import AutoConfig, PaliGemmaForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8, projection_dim=64)
    config = AutoConfig.for_model("paligemma", text_config=text, vision_config=vision, image_token_id=299,
                                  projection_dim=64)
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config).eval()
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    ids[0, :16] = 299  # the image's 16 patches first, then the prompt
    types = torch.ones_like(ids)
    types[0, :24] = 0  # prefix: image and prompt; suffix: the answer
    inputs = {"input_ids": ids, "pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))}
    return _with_and_without_types(model, inputs, types)
