"""Query scales an attention module computes from its call's rows: Llama 4's temperature tuning.

Llama 4's layers without RoPE multiply each query by
``1 + attn_scale·log1p(floor((p + 1) / floor_scale))``, with ``p`` counted from
the call's first row (plus a cache's length). A shard's rows are not
positions ``0..S-1`` of the sequence, so on a split sequence the module takes
that scale at the wrong positions; the backend moves it to the rows' global
positions with :func:`position_scale`. Beyond ``floor_scale`` tokens (8192 in
the released checkpoints) the two differ, which is where long sequences live.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

Tensor = torch.Tensor


def position_scale(module: torch.nn.Module) -> Optional[Callable[[Tensor], Tensor]]:
    """The query scale ``module`` applies by position, as a function of positions, or None if it applies none."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    floor, scale = module.floor_scale, module.attn_scale
    return lambda p: torch.log1p(torch.floor((p.to(torch.float32) + 1.0) / floor)) * scale + 1.0


def at_global_positions(module: torch.nn.Module, query: Tensor, rows: Tensor) -> Tensor:
    """``query`` ``(B, H, S, D)`` of a shard whose rows sit at global positions ``rows`` ``(S,)``, its position scale
    (if any) moved from the local rows ``0..S-1`` the module counted to ``rows``."""
    scale = position_scale(module)
    if scale is None or rows.numel() == 0:
        return query
    local = torch.arange(rows.numel(), device=rows.device)
    ratio = scale(rows) / scale(local)
    return query * ratio.to(device=query.device, dtype=query.dtype).view(1, 1, -1, 1)
