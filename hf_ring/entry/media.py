"""Multimodal forwards: the towers see whole images, the sequence is split where the decoder starts.

A vision-language model (Llava, Mistral 3, Qwen-VL, Gemma 3) encodes its
images with a tower, projects them, and merges the features into the token
embeddings at the image placeholders; only then does its language model (the
decoder) run over the sequence. :func:`hf_ring.shard_batch` leaves such a
batch whole and hands the model a :class:`MediaForward`: every sub-model before
the decoder runs on the whole batch, and the decoder's call gets this rank's
rows of what the model prepared for it (:func:`split_at_decoder`): the merged
embeddings, the global position ids (three-axis ones too), the padding, the
masks the model built over the whole sequence, Qwen3-VL's deepstack features.
An image whose tokens straddle two shards is exact: its features were merged
before the split.

A tower's own attention (non-causal, over its patches, with its own masks) is
never the ring's: :func:`is_tower` names the configs that are not a text
decoder's, and the backend hands their calls to ``sdpa``, the attention they
would otherwise run.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, Mapping, Optional

import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..patches import multimodal_problem
from ..integration.context import CONTEXT_KEY, ShardedForward
from ..integration.masks import RingMask

Tensor = torch.Tensor


MEDIA = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")
"""Inputs that make a batch multimodal: its model merges image or video features (or the towers' outputs, which
``generate`` computes before the prefill from transformers 5.24) into the token embeddings, so the sequence is split
where the model's language model starts."""
MEDIA_INPUTS = MEDIA + ("image_grid_thw", "video_grid_thw", "image_sizes", "pixel_attention_mask",
                        "second_per_grid_ts", "mm_token_type_ids")
"""What a vision-language processor adds to a batch: handed to the model whole."""


def has_media(inputs: Mapping[str, Any]) -> bool:
    """Whether a batch (or a forward's keywords) holds images or video (see :data:`MEDIA`)."""
    return any(inputs.get(key) is not None for key in MEDIA)


@lru_cache(maxsize=None)
def _decodes_text(config_type: type, model_type: str) -> bool:
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config_type, "base_config_key", "") == "text_config"


def is_tower(config: Any) -> bool:
    """Whether ``config`` is an encoder's beside a decoder (a vision or audio tower): neither a causal LM's nor a
    multimodal model's text config."""
    model_type = getattr(config, "model_type", None)
    return isinstance(model_type, str) and not _decodes_text(type(config), model_type)


@dataclass(eq=False)
class MediaForward:
    """A multimodal forward over sequence shards, not split yet (see the module docstring).

    ``sharded`` is the forward the decoder runs once split; ``rows`` the
    positions of this rank's rows (one placeholder row on a rank that holds
    none); ``decoder`` the language model, bound at the model's first call.
    """

    sharded: ShardedForward
    rows: Tensor
    decoder: Optional[torch.nn.Module] = None

    def fail(self, error: Exception) -> None:
        """Raise ``error`` on every rank of the group (see :meth:`ShardedForward.fail`)."""
        self.sharded.fail(error)


def enter(model: torch.nn.Module, forward: MediaForward, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments ``model`` runs with, inside ``forward``: the decoder's split, the others' as given.

    The first model called (the multimodal model itself) binds its decoder, or
    is refused on every rank when its family is not one whose split is tested.
    """
    if forward.decoder is None:
        problem = multimodal_problem(model)
        if problem is not None:
            forward.fail(ValueError(problem))
        forward.decoder = model.get_decoder()
    if model is not forward.decoder:
        return kwargs
    try:
        return split_at_decoder(kwargs, forward)
    except (TypeError, ValueError) as err:
        forward.fail(err)
        raise


PER_TOKEN = ("inputs_embeds", "input_ids", "token_type_ids", "mm_token_type_ids")
"""Per-token inputs a decoder may take, split along the sequence (dim 1) like the embeddings."""

LOSS_INPUTS = ("labels", "shift_labels", "completion_mask", "assistant_masks")
"""Per-token inputs of the loss: ``shard_batch`` gives a rank its own rows of these at once, and a model that
hands its keyword arguments on to its language model passes them through as they are."""


def split_at_decoder(kwargs: Dict[str, Any], forward: MediaForward) -> Dict[str, Any]:
    """This rank's rows of a decoder call made over the whole sequence (pure but for the tensors it slices)."""
    embeds = kwargs.get("inputs_embeds")
    if not isinstance(embeds, Tensor) or embeds.dim() != 3:
        raise ValueError("a multimodal model called its language model without inputs_embeds (batch, seq_len, hidden) "
                         "after merging its images; hf_ring splits the sequence there and cannot split this call")
    b, n = embeds.shape[:2]
    if n != forward.sharded.seq_len:
        raise ValueError(f"the language model got {n} rows, but shard_batch was given {forward.sharded.seq_len} tokens")
    if forward.sharded.documents is not None and _mrope(forward.decoder) and not four_axes(kwargs.get("position_ids")):
        raise ValueError("packed rows of a model with mRoPE positions take position_ids of shape (4, batch, "
                         "seq_len): each document's text positions, then its three mRoPE axes; "
                         "with 2-D position ids the model would give its images text positions. Pass the four-axis "
                         "form, or one document per row, padded (attention_mask)")
    rows = forward.rows.to(embeds.device)
    out: Dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == CONTEXT_KEY:
            out[key] = forward.sharded
        elif key == "attention_mask":
            out[key] = _mask_rows(value, rows, b, n)
        elif key == "position_ids":
            out[key] = _position_rows(value, rows, b, n, embeds.device)
        elif key in ("visual_pos_masks", "deepstack_visual_embeds"):
            continue
        elif key in LOSS_INPUTS:  # already this rank's rows
            out[key] = value
        elif key == "cache_position":  # the decoder counts its shard's rows from 0, as for any split forward
            if value is not None and not torch.equal(value.cpu(), torch.arange(n)):
                raise ValueError("a multimodal forward over a cache cannot be split; generate with hf_ring.generate")
        elif key in PER_TOKEN and isinstance(value, Tensor):
            out[key] = value[:, rows]
        elif isinstance(value, Tensor) and value.dim() >= 2 and (tuple(value.shape[:2]) == (b, n)
                                                                  or value.shape[-1] == n):
            raise ValueError(f"the language model was called with {key}= (shape {tuple(value.shape)}), one entry per "
                             "token, which hf_ring does not know how to split; this model cannot run with its "
                             "sequence split")
        else:
            out[key] = value
    if "position_ids" not in out:
        out["position_ids"] = _position_rows(None, rows, b, n, embeds.device)
    if kwargs.get("visual_pos_masks") is not None:
        out["visual_pos_masks"], out["deepstack_visual_embeds"] = _deepstack_rows(
            kwargs["visual_pos_masks"], kwargs.get("deepstack_visual_embeds"), rows)
    return out


def _mrope(decoder: Any) -> bool:
    """Whether a language model rotates by mRoPE's sections (position ids of three axes)."""
    config = getattr(decoder, "config", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return isinstance(rope, dict) and rope.get("mrope_section") is not None


def four_axes(positions: Any) -> bool:
    """Whether ``positions`` are mRoPE's four-axis form (4, batch, seq_len): the text positions, whose restarts
    mark packed documents, then the three rotary axes."""
    return isinstance(positions, Tensor) and positions.dim() == 3 and positions.shape[0] == 4


def _mask_rows(mask: Any, rows: Tensor, b: int, n: int) -> Any:
    if mask is None:
        return None
    if isinstance(mask, dict):  # one mask per kind of layer (full, sliding), made over the whole sequence
        return {kind: _mask_rows(m, rows, b, n) for kind, m in mask.items()}
    if isinstance(mask, RingMask):
        return mask.rows(rows)
    if isinstance(mask, Tensor) and tuple(mask.shape) == (b, n):
        return mask[:, rows]
    raise ValueError(f"the language model got an attention_mask of shape {tuple(getattr(mask, 'shape', ()))}; "
                     "with its sequence split it takes the 2-D padding mask (batch, seq_len) or the masks "
                     "ring_dilated's mask function made")


def _position_rows(positions: Optional[Tensor], rows: Tensor, b: int, n: int, device: torch.device) -> Tensor:
    """The rows' global position ids: ``0..n-1`` when the model gave none, else its own (mRoPE's three or four
    axes too), cut on their last dimension."""
    if positions is None:
        return torch.arange(n, device=device)[rows].expand(b, -1)
    if positions.shape[-1] != n:
        raise ValueError(f"position_ids of shape {tuple(positions.shape)} do not have the sequence's {n} rows last")
    return positions[..., rows]


def _deepstack_rows(mask: Tensor, embeds: Optional[list], rows: Tensor):
    """Qwen3-VL's deepstack: the visual positions among the rows, and their features (held in the order of the
    visual positions over the whole batch, row by row)."""
    order = (torch.cumsum(mask.reshape(-1).long(), 0) - 1).view(mask.shape)
    local = mask[:, rows]
    chosen = order[:, rows][local]
    return local, None if embeds is None else [e[chosen.to(e.device)] for e in embeds]
