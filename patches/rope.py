"""Make length-dependent RoPE (``dynamic``, ``longrope``) see the global sequence length.

Those RoPE types pick their frequencies from ``max(position_ids) + 1`` of the
call. A rank holding a shard would pick from its own largest position and
disagree with the other ranks (and with an unsharded run). The patched
forward first takes the maximum over the sequence-parallel group, lets the
model's own update run on that one position, then computes cos/sin for the
shard with the updated frequencies.

Rotary modules are recognised by structure, not by name: transformers gives
each one a ``rope_type`` (one string, or one per layer type as in Gemma 3)
and ``inv_freq`` buffers, and wraps its ``forward`` in
``modeling_rope_utils.dynamic_rope_update``, which is where the length is read.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

from transformers.modeling_rope_utils import dynamic_rope_update

from hf_ring.integration.config import runs_ring
from hf_ring.integration.groups import current

from . import registry

_MARK = "_hf_ring_global_length"
WHY = "length-dependent RoPE sees the global sequence length under sequence parallelism"
LENGTH_DEPENDENT = ("dynamic", "longrope")
# Every forward transformers wraps with dynamic_rope_update runs this one code object (``functools.wraps``
# copies names, not code), so it identifies the wrapper that reads the call's length.
_ROPE_UPDATE_CODE = dynamic_rope_update(lambda self, x, position_ids: None).__code__


def rope_types(module: torch.nn.Module) -> Tuple[str, ...]:
    """The RoPE type(s) of a rotary module: one, or one per layer type it serves."""
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, dict):
        return tuple(str(t) for t in rope_type.values())
    return () if rope_type is None else (str(rope_type),)


def is_length_dependent(rope_type: str) -> bool:
    """Whether frequencies of this RoPE type depend on the call's largest position (transformers' own test)."""
    return any(kind in rope_type for kind in LENGTH_DEPENDENT)


def is_rotary(module: torch.nn.Module) -> bool:
    """A rotary embedding module: it has a RoPE type and inverse-frequency buffers."""
    buffers = (name for name, _ in module.named_buffers(recurse=False))
    return bool(rope_types(module)) and any(name.endswith("inv_freq") for name in buffers)


def rotary_modules(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Every rotary embedding module of ``model`` (Gemma 3's serves its local and global layers)."""
    return (m for m in model.modules() if is_rotary(m))


def _undecorated(forward) -> Optional[object]:
    """The forward inside transformers' ``dynamic_rope_update`` wrapper (under any outer decorators such as
    ``torch.no_grad``), or None when there is no such wrapper."""
    while forward is not None:
        if getattr(forward, "__code__", None) is _ROPE_UPDATE_CODE:
            return getattr(forward, "__wrapped__", None)
        forward = getattr(forward, "__wrapped__", None)
    return None


def reads_call_length(cls: type) -> bool:
    """Whether ``cls.forward`` is transformers' length-reading wrapper, patched or not."""
    return is_patched(cls) or _undecorated(cls.forward) is not None


def _needs_global_length(module, layer_type) -> bool:
    rope_type = getattr(module, "rope_type", "default")
    if isinstance(rope_type, dict):
        rope_type = rope_type.get(layer_type, "default")
    return isinstance(rope_type, str) and is_length_dependent(rope_type)


def patch_rotary(cls: type) -> bool:
    """Wrap ``cls.forward`` (idempotent); False when its forward does not read the call's length."""
    if is_patched(cls):
        return True
    raw = _undecorated(cls.forward)
    if raw is None:
        return False
    registry.replace(cls, "forward", lambda original: _global_length_forward(original, raw), WHY)
    return True


def _global_length_forward(original, raw):
    @torch.compiler.disable  # a collective: outside a compiled graph, on purpose
    def forward(self, x, position_ids, *args, **kwargs):
        layer_type = args[0] if args else kwargs.get("layer_type")
        sp = current()
        config = getattr(self, "config", None)
        # Only a ring model's shards need the global length: another model beside it runs whole sequences.
        if (sp is None or sp.sp_size == 1 or not _needs_global_length(self, layer_type)
                or (config is not None and not runs_ring(config))):
            return original(self, x, position_ids, *args, **kwargs)
        # Gemma 3 calls once per layer type, in set order that may differ between processes; every call
        # gathers the same value, so matching the calls in any order gives every rank the same answer. The
        # exchange has the size of every control exchange, so a rank that reached another one instead (its
        # model refusing sharded inputs in the forward's agreement) fails both at once rather than waiting.
        longest = max(row[0] for row in sp.comm.all_gather_ints([int(position_ids.max())], "the RoPE global length"))
        longest = torch.tensor([[longest]], dtype=torch.long, device=position_ids.device)
        original(self, x[:1, :1], longest, *args, **kwargs)  # global-length update only
        with torch.no_grad():  # as the decorated original; raw must not redo the update with the shard's length
            return raw(self, x, position_ids, *args, **kwargs)

    forward.__wrapped__ = raw
    setattr(forward, _MARK, True)
    return forward


def unpatch_rotary(cls: type) -> None:
    """Undo :func:`patch_rotary` on ``cls`` or the base class that holds the patch."""
    for owner in cls.__mro__:
        if registry.restore(owner, "forward"):
            return


def is_patched(cls: type) -> bool:
    return bool(getattr(cls.forward, _MARK, False))
