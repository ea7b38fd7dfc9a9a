"""Make length-dependent RoPE (``dynamic``, ``longrope``) see the global sequence length.

Those RoPE types pick their frequencies from ``max(position_ids) + 1`` of the
call. A rank holding a shard would pick from its own largest position and
disagree with the other ranks (and with an unsharded run). The patched
forward first takes the maximum over the sequence-parallel group, lets the
model's own update run on that one position, then computes cos/sin for the
shard with the updated frequencies.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hf_ring.comm import all_reduce

_ORIGINAL = "_hf_ring_original_forward"
LENGTH_DEPENDENT = ("dynamic", "longrope")


def _needs_global_length(module) -> bool:
    rope_type = getattr(module, "rope_type", "default")
    return isinstance(rope_type, str) and any(t in rope_type for t in LENGTH_DEPENDENT)


def patch_rotary(cls) -> None:
    """Wrap ``cls.forward`` (idempotent)."""
    if hasattr(cls, _ORIGINAL):
        return
    original = cls.forward
    raw = getattr(original, "__wrapped__", None)

    def forward(self, x, position_ids, *args, **kwargs):
        from hf_ring.parallel import current

        sp = current()
        if raw is None or sp is None or sp.sp_size == 1 or not _needs_global_length(self):
            return original(self, x, position_ids, *args, **kwargs)
        longest = position_ids.max().reshape(1).to(torch.long)
        all_reduce(longest, sp.sp_group, "the RoPE global length", op=dist.ReduceOp.MAX)
        original(self, x[:1, :1], longest.view(1, 1).to(position_ids.device))  # global-length update only
        return raw(self, x, position_ids, *args, **kwargs)

    forward.__wrapped__ = raw
    setattr(cls, _ORIGINAL, original)
    cls.forward = forward


def unpatch_rotary(cls) -> None:
    original = cls.__dict__.get(_ORIGINAL)
    if original is not None:
        cls.forward = original
        delattr(cls, _ORIGINAL)


def is_patched(cls) -> bool:
    return _ORIGINAL in cls.__dict__


def rotary_patch(module: str, name: str):
    """``(apply, revert, is_applied)`` for the rotary embedding class ``module.name``, imported on use."""

    def cls():
        import importlib

        return getattr(importlib.import_module(module), name)

    return (lambda: patch_rotary(cls())), (lambda: unpatch_rotary(cls())), (lambda: is_patched(cls()))
