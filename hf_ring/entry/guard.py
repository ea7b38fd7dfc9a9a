"""Refusals of a model call given a forward context, the same on every rank, before the model computes anything.

A forward given :func:`hf_ring.shard_batch` inputs (or a step of
:func:`hf_ring.generate`) carries a context the ring reads in every layer.
Another attention (``sdpa``, ``eager``, ``flash_attention_2``) ignores it and
attends each rank's rows to that rank's own keys only: a wrong loss with
nothing raised. So is a model whose modules mix the sequence other than
through what hf_ring computes (:func:`hf_ring.patches.check_supported`, once
per model object), one whose head cannot read a split sequence, one saved for
another layout or head split, or one not sharded over the forward's tp group.
Each is refused here, riding the forward's agreement exchange so that every
rank raises. The messages of the checks made after the call
(:mod:`hf_ring.entry.model_call`) are here too.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from transformers.modeling_layers import GenericForSequenceClassification

from ..integration.config import ATTN_IMPLEMENTATION, CONFIG_KEY, attn_implementations, parse, runs_ring, shape_conflict
from ..integration.context import CONTEXT_KEY, ForwardContext, ShardedForward
from ..integration.groups import tp_place
from ..integration.readout import head_problem
from ..integration.tp import sharding_error
from ..patches import needs
from ..patches.router_loss import problem as router_problem


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


def refuse_other_router_term(model: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise ValueError on every rank when sharded inputs reach a mixture of experts whose router term (asked by
    the config or the call) hf_ring cannot compute over the whole sequence (see :mod:`hf_ring.patches.router_loss`)."""
    forward = kwargs.get(CONTEXT_KEY)
    if not isinstance(forward, ShardedForward) or forward.world_size == 1:
        return
    message = router_problem(model, kwargs.get("output_router_logits"))
    if message is not None:
        forward.fail(ValueError(message))


def head_error(model: Any) -> Optional[ValueError]:
    """Why ``model``'s head cannot read a split sequence (:func:`hf_ring.integration.readout.head_problem`), or None."""
    problem = head_problem(model, isinstance(model, GenericForSequenceClassification))
    return None if problem is None else ValueError(problem)


def refuse_structure(model: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise ValueError on every rank when sharded inputs reach a model that mixes the sequence other than through
    what hf_ring computes (a state-space scan, a convolution, positions it cannot count) or whose head cannot read a
    split sequence, before any layer runs."""
    forward = kwargs.get(CONTEXT_KEY)
    error = needs(model).error or head_error(model)
    if error is None:
        return
    error = ValueError(str(error))
    if isinstance(forward, ShardedForward):
        forward.fail(error)
    raise error


def _name(model: Any) -> str:
    return f"{type(model).__name__} (model type {getattr(getattr(model, 'config', None), 'model_type', None)!r})"


def unmixed_message(model: Any) -> str:
    return (f"{_name(model)} ran a sequence-sharded forward in which hf_ring computed no sequence-mixing layer (no "
            "ring_dilated attention call, no recurrent layer), so each layer saw only this rank's rows and the result "
            "would be wrong; this model cannot run with its sequence split: run it in one process "
            "(hf_ring.clear_sequence_parallel())")


def dropped_context_message(model: Any) -> str:
    return (f"{_name(model)} was given sequence-sharded inputs, but its layers do not hand the keyword arguments of "
            "model(...) on to the attention function, so ring_dilated never learns that the rows are a shard: this "
            "model cannot run with its sequence split; run it in one process (hf_ring.clear_sequence_parallel())")


def refuse(model: Any, kwargs: Mapping[str, Any]) -> None:
    """Every refusal of a call given a forward context (sharded inputs, a decode step), before the model computes:
    a structure hf_ring does not compute (first: no attention setting changes it, as for RWKV, which has no attention
    to set), another attention, another saved layout, another tp sharding, a router term it cannot reduce."""
    refuse_structure(model, kwargs)
    refuse_other_attention(model, kwargs)
    refuse_other_shape(model, kwargs)
    refuse_other_sharding(model, kwargs)
    refuse_other_router_term(model, kwargs)
