"""Sequence-sharded inputs reach only models whose attention is ``ring_dilated``; a multimodal forward is split
where its language model starts.

A forward given :func:`hf_ring.shard_batch` inputs (or a step of
:func:`hf_ring.generate`) carries a context the ring reads in every layer.
Another attention (``sdpa``, ``eager``, ``flash_attention_2``) ignores it and
attends each rank's rows to that rank's own keys only: a wrong loss with
nothing raised. :func:`install` makes every transformers model refuse such a
call, on every rank at once, before the model computes anything. Calls
without that context (every call of a model that hf_ring never sees) pass
through untouched. A multimodal batch from :func:`hf_ring.shard_batch` carries a
:class:`~hf_ring.integration.media.MediaForward`: the call of the model's
language model gets this rank's rows (:func:`~hf_ring.integration.media.enter`),
and is checked like any sharded call.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from transformers import PreTrainedModel

from ..patches import registry
from .config import ATTN_IMPLEMENTATION, CONFIG_KEY, attn_implementations, parse, runs_ring, shape_conflict
from .context import CONTEXT_KEY, ForwardContext, ShardedForward
from .groups import tp_place
from .media import MediaForward, enter
from .tp import sharding_error

def other_attention_message(model: Any) -> str:
    names = attn_implementations(getattr(model, "config", None))
    shown = names[0] if len(names) == 1 else list(names)
    return (
        f"{type(model).__name__} was given sequence-sharded inputs (hf_ring.shard_batch, prepare_trainer or "
        f"hf_ring.generate) but runs attn_implementation={shown!r}, which would attend each rank's rows to its own "
        f"keys only; load it with attn_implementation={ATTN_IMPLEMENTATION!r} or call "
        f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r})"
    )


def refuse_other_attention(model: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise ValueError on every rank when ``kwargs`` are sharded inputs and ``model`` does not run the ring."""
    forward = kwargs.get(CONTEXT_KEY)
    if not isinstance(forward, ForwardContext) or runs_ring(getattr(model, "config", None)):
        return
    error = ValueError(other_attention_message(model))
    if isinstance(forward, ShardedForward):
        forward.fail(error)  # rides the forward's agreement exchange, so a rank running the ring model raises too
    raise error


def refuse_other_shape(model: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise ValueError on every rank when sharded inputs reach a model whose saved ``config.ring_dilated`` has
    another layout or ``ulysses_size`` than the setup that sharded them (before any layer runs)."""
    forward = kwargs.get(CONTEXT_KEY)
    if not isinstance(forward, ShardedForward) or forward.world_size == 1:
        return
    try:
        saved = parse(getattr(getattr(model, "config", None), CONFIG_KEY, None))
    except (TypeError, ValueError) as err:
        forward.fail(err)
        raise
    message = shape_conflict(saved, forward.layout, forward.ulysses)
    if message is not None:
        forward.fail(ValueError(message))


def refuse_other_sharding(model: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise ValueError on every rank when sharded inputs reach a model not sharded over the forward's tp group
    (transformers' own layers would otherwise fail on half-heads, or run every head on every tp rank)."""
    forward = kwargs.get(CONTEXT_KEY)
    if not isinstance(forward, ShardedForward):
        return
    message = sharding_error(model, *tp_place())
    if message is not None:
        forward.fail(ValueError(message))


WHY = ("refuses sequence-sharded inputs to a model whose attention is not ring_dilated, whose saved layout or "
       "ulysses_size is not the setup's, or that is not sharded over the forward's tp group (other calls pass "
       "through untouched); installed by import hf_ring and kept")


@torch.compiler.disable  # may join the forward's agreement exchange: outside a compiled graph, on purpose
def _refuse(model: Any, kwargs: Mapping[str, Any]) -> None:
    refuse_other_attention(model, kwargs)
    refuse_other_shape(model, kwargs)
    refuse_other_sharding(model, kwargs)


@torch.compiler.disable  # binds the forward's decoder, and may join its agreement exchange
def _enter(model: Any, forward: MediaForward, kwargs: dict) -> dict:
    return enter(model, forward, kwargs)


def _guarded(original):
    def __call__(self, *args, **kwargs):
        forward = kwargs.get(CONTEXT_KEY)
        if isinstance(forward, MediaForward):  # a multimodal forward: split where its language model starts
            kwargs = _enter(self, forward, kwargs)
            forward = kwargs.get(CONTEXT_KEY)
        if forward is not None and not isinstance(forward, MediaForward):
            _refuse(self, kwargs)
        return original(self, *args, **kwargs)

    __call__.__wrapped__ = original
    return __call__


def install() -> None:
    """Guard every transformers model's call (idempotent; listed by :func:`hf_ring.patches.applied`)."""
    registry.replace(PreTrainedModel, "__call__", _guarded, WHY, kept=True)
