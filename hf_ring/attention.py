"""The ``ring_dilated`` attention backend transformers calls, and its mask function.

One plain function, as transformers' own backends are: it takes the layer's
rotated ``(B, H, S, D)`` query/key/value and returns ``(out (B, S, Hq, D), None)``.
Whole sequences (training, a prefill) run ring (or dilated) attention over the
active sequence-parallel group or this process alone; new tokens over a KV
cache run :mod:`hf_ring.decode`, merged across the ranks under
:func:`hf_ring.generate`.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import config as ring_config
from .comm import RingComm
from .decode import DENSE, cached_attention, cached_blocks, merge_ranks
from .generation import active
from .parallel import current
from .ring import attend, check_options

Tensor = torch.Tensor

NAME = "ring_dilated"

_COMMS: dict = {}


def comm_for(group) -> Optional[RingComm]:
    """The (reused) ring communicator of a process group."""
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
    cfg = ring_config.parse(getattr(module.config, ring_config.CONFIG_KEY, None))
    sp = current()
    comm = comm_for(sp.sp_group) if sp is not None and sp.sp_size > 1 else None
    if comm is not None:
        from hf_ring import patches

        patches.check_supported(module.config)
    state = active()
    if (state is not None and state.mode == "step") or query.shape[2] != key.shape[2]:
        return _cached(module, query, key, value, attention_mask, scaling, sliding_window, cfg, comm, state), None
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


def _cached(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
            scaling: Optional[float], sliding_window: Optional[int], cfg, comm: Optional[RingComm], state) -> Tensor:
    """New tokens over a KV cache: this rank's rows, merged across the ranks under hf_ring.generate."""
    causal = bool(getattr(module, "is_causal", True))
    window, pattern, scale = check_options(causal, sliding_window, cfg.pattern, scaling, query.shape[-1])
    branches = DENSE if pattern is None else pattern.branches
    hq, hkv, kv_len = query.shape[1], key.shape[1], key.shape[2]
    stepping = state is not None and state.mode == "step"
    if stepping:
        k_pos = state.cache.index
        if k_pos.numel() != kv_len:
            raise RuntimeError(f"the sharded cache records {k_pos.numel()} rows but the layer returned {kv_len}")
        blocks = state.blocks(hq, hkv, causal, window, branches, query.device)
        comm = state.comm
    else:
        if comm is not None:
            raise NotImplementedError(
                "ring_dilated got a KV cache while the sequence is split across ranks; generate with "
                "hf_ring.generate(model, input_ids, ...), which keeps the cache sharded"
            )
        # transformers' own cache on one process: the keys are the last kv_len positions, the queries their tail.
        k_pos = torch.arange(kv_len)
        blocks = cached_blocks(k_pos[kv_len - query.shape[2]:], k_pos, hq=hq, hkv=hkv, causal=causal,
                               window=window, branches=branches)
    key_mask = None
    if attention_mask is not None:
        key_mask = attention_mask[:, k_pos.to(attention_mask.device)] if stepping else attention_mask[:, -kv_len:]
    out, lse = cached_attention(query, key, value, blocks, scale=scale, key_mask=key_mask)
    out = merge_ranks(out, lse, comm)
    return out.to(query.dtype).transpose(1, 2).contiguous()


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
