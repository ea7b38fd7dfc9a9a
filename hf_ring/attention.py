"""The ``ring_dilated`` attention backend transformers calls, and its mask function.

One plain function, as transformers' own backends are: it takes the layer's
rotated ``(B, H, S, D)`` query/key/value, runs ring (or dilated) attention over
the active sequence-parallel group (or this process alone) and returns
``(out (B, S, Hq, D), None)``.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import config as ring_config
from .comm import RingComm
from .parallel import current
from .ring import attend

Tensor = torch.Tensor

NAME = "ring_dilated"

_COMMS: dict = {}


def _comm_for(group) -> Optional[RingComm]:
    if group is None:
        return None
    comm = _COMMS.get(id(group))
    if comm is None or comm.group is not group:
        comm = _COMMS[id(group)] = RingComm(group)
    return comm


def ring_dilated_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    **kwargs: Any,
) -> Tuple[Tensor, None]:
    """transformers attention function for ``attn_implementation="ring_dilated"``."""
    if dropout and module.training:
        raise ValueError(
            f"ring_dilated does not implement attention dropout (got dropout={dropout}); "
            "set config.attention_dropout = 0.0"
        )
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError(
            "ring_dilated attention got queries and keys of different lengths (a KV cache); "
            "call model(...) with use_cache=False, or generate with another attn_implementation"
        )
    cfg = ring_config.parse(getattr(module.config, ring_config.CONFIG_KEY, None))
    sp = current()
    comm = _comm_for(sp.sp_group) if sp is not None and sp.sp_size > 1 else None
    if comm is not None:
        from hf_ring import patches

        patches.check_supported(module.config)
    layout = sp.layout if comm is not None else cfg.layout
    if sp is not None and cfg.layout != sp.layout:
        raise ValueError(
            f"config.ring_dilated layout {cfg.layout!r} differs from the sequence-parallel layout {sp.layout!r}; "
            "use one layout for both (hf_ring.configure and hf_ring.setup_sequence_parallel)"
        )
    out = attend(
        query, key, value, comm, layout=layout, seq_len=kwargs.get("ring_seq_len"),
        causal=bool(getattr(module, "is_causal", True)), window=sliding_window, pattern=cfg.pattern,
        scale=scaling, key_mask=attention_mask,
    )
    return out.transpose(1, 2).contiguous(), None


def ring_dilated_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                      mask_function=None, attention_mask: Optional[Tensor] = None, **kwargs: Any) -> Optional[Tensor]:
    """Mask function for ``ring_dilated``: the 2-D key padding mask, or None when nothing is padded.

    Causality, windows and dilation are applied by the attention itself from
    global positions, so only padding needs to reach it.
    """
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    return None if bool(mask.all()) else mask


def register() -> None:
    """Make ``attn_implementation="ring_dilated"`` available to transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, ring_dilated_attention)
    AttentionMaskInterface.register(NAME, ring_dilated_mask)
