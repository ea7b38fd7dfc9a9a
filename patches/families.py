"""The decoder families tested under sequence parallelism: one table, each family patched and reverted alike.

A model instance needs none of this: :func:`hf_ring.patches.apply` finds its
rotary modules itself. The table serves the time before a model exists
(``setup_sequence_parallel`` patches these classes up front) and records what
each family's attention passes to the backend, which ``tests/test_model_zoo.py``
checks against the installed transformers.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, Tuple

from . import rope


@dataclass(frozen=True)
class Family:
    """A tested family: where its classes live and what its attention asks of the backend."""

    model_type: str
    module: str  # transformers.models.<module>.modeling_<module>
    rotary: Tuple[str, ...]  # rotary embedding classes
    attention_kwargs: Tuple[str, ...]  # keywords beyond (mask, dropout, scaling) that change the math
    layers: str  # which layers attend how
    rope: str  # RoPE types of released checkpoints
    tiled: Tuple[str, ...] = ()  # CausalLM, MLP and RMSNorm classes the sequence tiling fits (empty: not tiled)

    @property
    def modeling(self) -> str:
        """The module that defines the family's classes."""
        return f"transformers.models.{self.module}.modeling_{self.module}"

    def rotary_classes(self) -> Tuple[type, ...]:
        # Imported on use: ``import hf_ring`` should not load every family's modeling code.
        module = importlib.import_module(self.modeling)
        return tuple(getattr(module, name) for name in self.rotary)

    def apply(self) -> None:
        for cls in self.rotary_classes():
            rope.patch_rotary(cls)

    def revert(self) -> None:
        for cls in self.rotary_classes():
            rope.unpatch_rotary(cls)

    def is_applied(self) -> bool:
        return all(rope.is_patched(cls) for cls in self.rotary_classes())


FAMILIES: Dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "llama", ("LlamaRotaryEmbedding",), (), "all full", "default, llama3, linear, dynamic, yarn",
           ("LlamaForCausalLM", "LlamaMLP", "LlamaRMSNorm")),
    Family("mistral", "mistral", ("MistralRotaryEmbedding",), ("sliding_window",),
           "all sliding when config.sliding_window is set, else full", "default",
           ("MistralForCausalLM", "MistralMLP", "MistralRMSNorm")),
    Family("qwen2", "qwen2", ("Qwen2RotaryEmbedding",), ("sliding_window",),
           "config.layer_types (sliding from max_window_layers when use_sliding_window)", "default, yarn, dynamic",
           ("Qwen2ForCausalLM", "Qwen2MLP", "Qwen2RMSNorm")),
    Family("qwen3", "qwen3", ("Qwen3RotaryEmbedding",), ("sliding_window",),
           "config.layer_types (sliding from max_window_layers when use_sliding_window)", "default, yarn",
           ("Qwen3ForCausalLM", "Qwen3MLP", "Qwen3RMSNorm")),
    Family("qwen3_moe", "qwen3_moe", ("Qwen3MoeRotaryEmbedding",), ("sliding_window",),
           "all sliding when config.sliding_window is set, else full", "default, yarn"),
    Family("gemma2", "gemma2", ("Gemma2RotaryEmbedding",), ("sliding_window", "softcap"),
           "config.layer_types: sliding and full alternate", "default",
           ("Gemma2ForCausalLM", "Gemma2MLP", "Gemma2RMSNorm")),
    Family("gemma3_text", "gemma3", ("Gemma3RotaryEmbedding",), ("sliding_window",),
           "config.layer_types: 5 sliding to 1 full; one rotary module with a RoPE per layer type",
           "sliding: default; full: linear"),
    Family("gpt_oss", "gpt_oss", ("GptOssRotaryEmbedding",), ("sliding_window", "s_aux"),
           "config.layer_types: sliding and full alternate", "yarn"),
    Family("phi3", "phi3", ("Phi3RotaryEmbedding",), ("sliding_window",),
           "all sliding when config.sliding_window is set, else full", "default, longrope"),
    Family("olmo2", "olmo2", ("Olmo2RotaryEmbedding",), (), "all full", "default"),
)}



@dataclass(frozen=True)
class Multimodal:
    """A vision-language family tested under sequence parallelism: its towers see whole images, and its language
    model (of the ``decoders`` types) is split after the image features are merged."""

    model_type: str
    decoders: Tuple[str, ...]  # model types of its language models
    inputs: str  # what its batches carry beside input_ids, attention_mask and labels


MULTIMODAL: Dict[str, Multimodal] = {m.model_type: m for m in (
    Multimodal("llava", ("llama", "mistral"), "pixel_values"),
    Multimodal("mistral3", ("mistral",), "pixel_values, image_sizes"),
    Multimodal("qwen2_5_vl", ("qwen2_5_vl_text",), "pixel_values(_videos), image/video_grid_thw, mm_token_type_ids"),
    Multimodal("qwen3_vl", ("qwen3_vl_text",), "pixel_values(_videos), image/video_grid_thw, mm_token_type_ids"),
    Multimodal("qwen3_5", ("qwen3_5_text",), "pixel_values(_videos), image/video_grid_thw, mm_token_type_ids; a "
               "hybrid language model (linear attention beside attention)"),
    Multimodal("gemma3", ("gemma3_text",), "pixel_values, token_type_ids"),
    Multimodal("paligemma", ("gemma", "gemma2"), "pixel_values, token_type_ids (0: the prefix, which attends both ways)"),
    Multimodal("idefics3", ("llama",), "pixel_values (batch, images, ...), pixel_attention_mask"),
    Multimodal("smolvlm", ("llama",), "pixel_values (batch, images, ...), pixel_attention_mask"),
)}
