"""Tiny vision-language models built from configs, saved with safetensors and loaded back, and their batches.

Each family's batch is what its processor would make: text tokens with each
image's placeholder tokens where the image sits (as many as the tower and
projector give features), synthetic pixels, and the family's own image inputs
(``image_sizes``, ``image_grid_thw``, ``token_type_ids``).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence

import torch

VOCAB = 300
IMAGE = 299
"""The image placeholder token of every family here (the last id of the vocabulary)."""
_SAVED: dict = {}

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, attention_dropout=0.0,
            tie_word_embeddings=False)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, attention_dropout=0.0)


def _qwen_rope(text: dict) -> dict:
    return dict(text, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]})


def _qwen_pixels(counts: Sequence[int], g: torch.Generator, patch: int, grid: int) -> Dict[str, torch.Tensor]:
    """Qwen-VL's flattened patches: one frame per image repeated over the temporal patch of 2, grid x grid."""
    images = sum(counts)
    return {"pixel_values": torch.randn(images * grid * grid, 3 * 2 * patch * patch, generator=g),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * images)}


@dataclass(frozen=True)
class Family:
    """A tiny model of one multimodal family and how its batches are made."""

    name: str
    model_type: str
    config: Callable[[], dict]
    tokens_per_image: int
    pixels: Callable[[Sequence[int], torch.Generator], Dict[str, torch.Tensor]]  # from each row's image count
    token_types: bool = False  # Gemma 3: token_type_ids mark the image tokens, which attend both ways
    prefix: int = 0  # PaliGemma: images first, then the prompt; token type 0 (both ways) on these first rows
    starts: Sequence[int] = (14, 45)  # where a row's images start, unless the call says
    two_rows: Sequence[Sequence[int]] = ((14, 45), (30,))  # a batch of two rows with different image counts
    mm_types: bool = False  # Qwen-VL: mm_token_type_ids mark the image tokens, for the three-axis positions
    around: Sequence[int] = field(default=())  # tokens before and after an image's placeholders (start, end)

    def build(self, seed: int = 0) -> str:
        """A directory holding this family's tiny model, made once per process."""
        from transformers import AutoConfig, AutoModelForImageTextToText

        key = (self.name, seed)
        if key not in _SAVED:
            torch.manual_seed(seed)
            config = AutoConfig.for_model(self.model_type, **self.config())
            model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
            path = tempfile.mkdtemp(prefix=f"hf_ring_{self.name}_")
            model.save_pretrained(path, safe_serialization=True)
            assert os.path.exists(os.path.join(path, "model.safetensors"))
            _SAVED[key] = path
        return _SAVED[key]

    def load(self, attn, dtype: torch.dtype = torch.float32, path: Optional[str] = None):
        """The model saved at ``path`` (built by :meth:`build` in this process if None; ranks get the path made
        before they start, since only a group's first rank writes a checkpoint)."""
        from transformers import AutoModelForImageTextToText

        import hf_ring  # noqa: F401  (registers ring_dilated)

        return AutoModelForImageTextToText.from_pretrained(path or self.build(), attn_implementation=attn, dtype=dtype)

    def batch(self, seed: int, n: int, where: Optional[Sequence[Sequence[int]]] = None,
              pad: Sequence[int] = ()) -> dict:
        """Rows of ``n`` tokens, row ``r`` holding an image at each start in ``where[r]`` (default: one row, images
        at :attr:`starts`); ``pad[r]`` right-padded tokens (no label). Labels are the text tokens (never an
        image's), and for PaliGemma the suffix's."""
        where = (tuple(self.starts),) if where is None else where
        g = torch.Generator().manual_seed(seed)
        b = len(where)
        ids = torch.randint(3, VOCAB - 8, (b, n), generator=g)
        mask = torch.ones(b, n, dtype=torch.long)
        for row, starts in enumerate(where):
            for start in starts:
                ids[row, start:start + self.tokens_per_image] = IMAGE
                if self.around:
                    ids[row, start - 1], ids[row, start + self.tokens_per_image] = self.around
            if row < len(pad) and pad[row]:
                mask[row, n - pad[row]:] = 0
                ids[row, n - pad[row]:] = 0
        out = {"input_ids": ids, "attention_mask": mask, **self.pixels([len(s) for s in where], g)}
        if self.prefix:
            out["token_type_ids"] = torch.ones_like(ids)
            out["token_type_ids"][:, :self.prefix] = 0
        elif self.token_types:
            out["token_type_ids"] = (ids == IMAGE).long()
        if self.mm_types:
            out["mm_token_type_ids"] = (ids == IMAGE).int()
        out["labels"] = ids.masked_fill((mask == 0) | (ids == IMAGE), -100)
        out["labels"][:, :self.prefix] = -100
        return out


def packed(batch: dict, mrope: Optional[torch.Tensor] = None) -> dict:
    """The rows of ``batch`` (all of one length, no padding) packed into one row, as
    ``DataCollatorWithFlattening`` packs them: position ids restart at each document, no attention mask.
    ``mrope``: the rows' mRoPE positions (3, batch, seq_len), packed after the text positions (four axes)."""
    b, n = batch["input_ids"].shape
    out = {k: v for k, v in batch.items() if k != "attention_mask"}
    for key in ("input_ids", "labels", "token_type_ids", "mm_token_type_ids"):
        if key in batch:
            out[key] = batch[key].reshape(1, b * n)
    out["position_ids"] = torch.arange(n).repeat(b)[None]
    if mrope is not None:
        out["position_ids"] = torch.cat([out["position_ids"][None], mrope.reshape(3, 1, b * n)])
    return out


def _llava(text_type: str) -> Callable[[], dict]:
    def config() -> dict:
        vision = dict(VISION, model_type="clip_vision_model", image_size=16, patch_size=4, projection_dim=32)
        return dict(text_config=dict(TEXT, model_type=text_type), vision_config=vision, image_token_id=IMAGE,
                    projector_hidden_act="gelu", vision_feature_layer=-1)
    return config


def _mistral3() -> dict:
    vision = dict(VISION, model_type="pixtral", image_size=16, patch_size=4, head_dim=16)
    return dict(text_config=dict(TEXT, model_type="mistral"), vision_config=vision, image_token_id=IMAGE,
                spatial_merge_size=2, vision_feature_layer=-1)


def _qwen2_5_vl() -> dict:
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=8, fullatt_block_indexes=[1])
    return dict(text_config=_qwen_rope(TEXT), vision_config=vision, image_token_id=IMAGE, video_token_id=IMAGE - 1,
                vision_start_token_id=IMAGE - 2, vision_end_token_id=IMAGE - 3)


def _qwen3_vl() -> dict:
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0])
    return dict(text_config=_qwen_rope(TEXT), vision_config=vision, image_token_id=IMAGE, video_token_id=IMAGE - 1,
                vision_start_token_id=IMAGE - 2, vision_end_token_id=IMAGE - 3)


def _gemma3() -> dict:
    text = dict(TEXT, sliding_window=8, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
    vision = dict(VISION, image_size=16, patch_size=4)
    return dict(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_id=IMAGE,
                boi_token_id=IMAGE - 2, eoi_token_id=IMAGE - 1)


def _paligemma() -> dict:
    vision = dict(VISION, image_size=16, patch_size=4, projection_dim=64)
    return dict(text_config=dict(TEXT, model_type="gemma"), vision_config=vision, image_token_id=IMAGE,
                projection_dim=64)


def _idefics3() -> dict:
    vision = dict(VISION, image_size=16, patch_size=4)
    return dict(text_config=dict(TEXT, model_type="llama"), vision_config=vision, image_token_id=IMAGE,
                scale_factor=2)


def _idefics3_pixels(counts: Sequence[int], g: torch.Generator) -> Dict[str, torch.Tensor]:
    """Idefics3's images per row, (rows, most images, ...); an all-zero image is a row's padding."""
    pixels = torch.zeros(len(counts), max(counts), 3, 16, 16)
    for row, count in enumerate(counts):
        pixels[row, :count] = torch.randn(count, 3, 16, 16, generator=g)
    return {"pixel_values": pixels}


def _images(size: int) -> Callable[[int, torch.Generator], Dict[str, torch.Tensor]]:
    return lambda counts, g: {"pixel_values": torch.randn(sum(counts), 3, size, size, generator=g)}


def _pixtral(counts: Sequence[int], g: torch.Generator) -> Dict[str, torch.Tensor]:
    images = sum(counts)
    return {"pixel_values": torch.randn(images, 3, 16, 16, generator=g), "image_sizes": torch.tensor([[16, 16]] * images)}


FAMILIES: Dict[str, Family] = {f.name: f for f in (
    Family("llava", "llava", _llava("llama"), 16, _images(16)),
    Family("llava_mistral", "llava", _llava("mistral"), 16, _images(16)),
    Family("mistral3", "mistral3", _mistral3, 4, _pixtral),
    Family("qwen2_5_vl", "qwen2_5_vl", _qwen2_5_vl, 4, lambda counts, g: _qwen_pixels(counts, g, 4, 4),
           around=(IMAGE - 2, IMAGE - 3), mm_types=True),
    Family("qwen3_vl", "qwen3_vl", _qwen3_vl, 4, lambda counts, g: _qwen_pixels(counts, g, 4, 4),
           around=(IMAGE - 2, IMAGE - 3), mm_types=True),
    Family("gemma3", "gemma3", _gemma3, 4, _images(16), token_types=True, around=(IMAGE - 2, IMAGE - 1)),
    Family("paligemma", "paligemma", _paligemma, 16, _images(16), prefix=24, starts=(0,),
           two_rows=((0,), (0,))),
    Family("idefics3", "idefics3", _idefics3, 4, _idefics3_pixels),
    Family("smolvlm", "smolvlm", _idefics3, 4, _idefics3_pixels),
)}
"""The supported multimodal families, by name."""


def _qwen3_5() -> dict:
    """Qwen3.5: a linear-attention layer, then a full-attention layer (the language model of a hybrid)."""
    text = dict(_qwen_rope(TEXT), layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    text["rope_parameters"] = dict(text["rope_parameters"], partial_rotary_factor=1.0)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    return dict(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=IMAGE - 1,
                vision_start_token_id=IMAGE - 2, vision_end_token_id=IMAGE - 3)


HYBRIDS: Dict[str, Family] = {f.name: f for f in (
    Family("qwen3_5", "qwen3_5", _qwen3_5, 4, lambda counts, g: _qwen_pixels(counts, g, 4, 4),
           around=(IMAGE - 2, IMAGE - 3), mm_types=True),
)}
"""Multimodal families whose language model is a hybrid (tests/test_hybrids.py)."""


def family(name: str) -> Family:
    """A family of :data:`FAMILIES` or :data:`HYBRIDS` by name."""
    return FAMILIES[name] if name in FAMILIES else HYBRIDS[name]


def _aya_vision() -> dict:
    text = dict(TEXT, model_type="cohere2", layer_types=["full_attention"] * 2)
    vision = dict(VISION, model_type="siglip_vision_model", image_size=16, patch_size=4)
    return dict(text_config=text, vision_config=vision, image_token_id=IMAGE, downsample_factor=2,
                vision_feature_layer=-1)


UNTESTED = Family("aya_vision", "aya_vision", _aya_vision, 4, _images(16))
"""A multimodal family whose split is not tested: refused by name."""
