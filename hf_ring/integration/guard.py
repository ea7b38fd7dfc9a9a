"""Sequence-sharded inputs reach only models whose attention is ``ring_dilated``; a multimodal forward is split
where its language model starts.

A forward given :func:`hf_ring.shard_batch` inputs (or a step of
:func:`hf_ring.generate`) carries a context the ring reads in every layer.
Another attention (``sdpa``, ``eager``, ``flash_attention_2``) ignores it and
attends each rank's rows to that rank's own keys only: a wrong loss with
nothing raised. :func:`install` makes every transformers model refuse such a
call, on every rank at once, before the model computes anything; so is a
model whose modules mix the sequence other than through what hf_ring computes
(:func:`hf_ring.patches.check_supported`, once per model object). A forward
over shards that still ends without hf_ring having computed one
sequence-mixing layer, or whose attention never saw the shards (a model that
drops the forward's keyword arguments on the way), is refused on every rank
too, naming the model. Calls without that context (every call of a model that
hf_ring never sees) pass through untouched. A multimodal batch from :func:`hf_ring.shard_batch` carries a
:class:`~hf_ring.integration.media.MediaForward`: the call of the model's
language model gets this rank's rows (:func:`~hf_ring.integration.media.enter`),
and is checked like any sharded call.
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping, NamedTuple, Optional, Tuple

import torch
from transformers import PreTrainedModel
from transformers.modeling_layers import GenericForSequenceClassification

from ..engine.agreement import UNSHARDED_RANKS
from ..patches import check_supported, recurrent, registry, rope, rotary_modules
from ..patches.structure import counting_embeddings
from .config import ATTN_IMPLEMENTATION, CONFIG_KEY, attn_implementations, parse, runs_ring, shape_conflict
from .context import CONTEXT_KEY, ForwardContext, ShardedForward
from .groups import tp_place
from .media import MediaForward, enter
from .positions import counted_positions
from .readout import head_problem, last_real_rows, pooled_scores, scores_head
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


class _Verdict(NamedTuple):
    """What the guard learns of a model object once: why its sequence cannot be split (None: it can), its rotary
    classes, its hybrid family (None: no recurrent layer hf_ring hooks) and the embeddings that count its positions."""

    error: Optional[ValueError]
    rotary: Tuple[type, ...]
    hybrid: Any
    counting: Optional[torch.nn.Module]


_VERDICTS: "weakref.WeakKeyDictionary[Any, _Verdict]" = weakref.WeakKeyDictionary()
"""Per model object, its :class:`_Verdict` (its modules do not change between forwards; the check walks all of
them)."""


def _verdict(model: Any) -> _Verdict:
    if model not in _VERDICTS:
        try:
            check_supported(model)
            error = head_error(model)
        except ValueError as err:
            error = err
        hybrid = recurrent.family(getattr(getattr(model, "config", None), "model_type", None))
        if hybrid is not None and not any(type(m).__name__ in hybrid.mixers for m in model.modules()):
            hybrid = None  # a hybrid type configured with attention layers only
        _VERDICTS[model] = _Verdict(error, tuple(dict.fromkeys(type(m) for m in rotary_modules(model))), hybrid,
                                    counting_embeddings(model))
    return _VERDICTS[model]


def head_error(model: Any) -> Optional[ValueError]:
    """Why ``model``'s head cannot read a split sequence (:func:`hf_ring.integration.readout.head_problem`), or None."""
    problem = head_problem(model, isinstance(model, GenericForSequenceClassification))
    return None if problem is None else ValueError(problem)


def structure_error(model: Any, split: bool = True) -> Optional[ValueError]:
    """Why ``model``'s sequence cannot be split (its modules and config, :func:`hf_ring.patches.check_supported`),
    or None; worked out once per model object. ``split``: the sequence is split over several ranks, so a model that
    can be split has its length-dependent RoPE made global and its recurrent layers hooked
    (:func:`hf_ring.patches.apply`; made again after ``clear_sequence_parallel`` undid them); one process needs
    neither."""
    verdict = _verdict(model)
    if verdict.error is None and split:
        for cls in verdict.rotary:
            rope.patch_rotary(cls)
        if verdict.hybrid is not None:
            recurrent.apply(verdict.hybrid)
    return verdict.error


def refuse_structure(model: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise ValueError on every rank when sharded inputs reach a model that mixes the sequence other than through
    what hf_ring computes (a state-space scan, a convolution, positions it cannot count), before any layer runs."""
    forward = kwargs.get(CONTEXT_KEY)
    comm = getattr(forward, "comm", None)
    error = structure_error(model, comm is not None and comm.world_size > 1)
    if error is None and isinstance(forward, ShardedForward) and forward.documents is not None \
            and _verdict(model).hybrid is not None:
        error = ValueError(packed_recurrent_message(model))
    if error is None:
        return
    error = ValueError(str(error))
    if isinstance(forward, ShardedForward):
        forward.fail(error)
    raise error


def _name(model: Any) -> str:
    return f"{type(model).__name__} (model type {getattr(getattr(model, 'config', None), 'model_type', None)!r})"


def packed_recurrent_message(model: Any) -> str:
    return (f"{_name(model)} was given packed rows (several documents in one row), but its recurrent layers would "
            "carry their state from one document into the next: transformers' torch path of them cannot reset it at "
            "a document border (its convolution ignores seq_idx). Give one document per row, padded (attention_mask)")


def unmixed_message(model: Any) -> str:
    return (f"{_name(model)} ran a sequence-sharded forward in which hf_ring computed no sequence-mixing layer (no "
            "ring_dilated attention call, no recurrent layer), so each layer saw only this rank's rows and the result "
            "would be wrong; this model cannot run with its sequence split: run it in one process "
            "(hf_ring.clear_sequence_parallel())")


def dropped_context_message(model: Any) -> str:
    return (f"{_name(model)} was given sequence-sharded inputs, but its layers do not hand the keyword arguments of "
            "model(...) on to the attention function, so ring_dilated never learns that the rows are a shard: this "
            "model cannot run with its sequence split; run it in one process (hf_ring.clear_sequence_parallel())")


def pool_over_shards(model: Any, forward: ShardedForward, kwargs: Mapping[str, Any]):
    """For a sequence classifier called with ``kwargs`` (sharded), a hook on its head for this call that hands every
    row the score of its last real token, wherever that token lies
    (:func:`hf_ring.integration.readout.pooled_scores`; the caller removes it after the call); None for other
    models. A collective: every rank of the group calls it for the same model."""
    head = scores_head(model)
    if head is None:
        return None
    if not isinstance(forward, ShardedForward):
        forward.fail(ValueError(f"{_name(model)} pools a multimodal sequence, which hf_ring does not split; run it in "
                                "one process (hf_ring.clear_sequence_parallel())"))
    ids = kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    batch = (ids if ids is not None else embeds).shape[0]
    pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    last = last_real_rows(forward, ids, pad, batch)
    return head.register_forward_hook(lambda module, args, scores: pooled_scores(scores, forward, last))


def _sharded_call(original, model: Any, forward: ShardedForward, args, kwargs):
    """The model's call with a forward over shards: positions it counts itself made global, and refused on every rank
    when the forward lost its context on the way to the attention or ended with no layer hf_ring computed."""
    outermost = forward.enter_call()
    pooling = None
    try:
        if outermost:
            kwargs = counted_positions(_verdict(model).counting, forward, kwargs)
            pooling = pool_over_shards(model, forward, kwargs)
        out = original(model, *args, **kwargs)
    except ValueError as err:
        # The backend saw no sharded inputs on this rank, though they arrived here: the model dropped them.
        if (0 if forward.comm is None else forward.comm.rank) in getattr(err, UNSHARDED_RANKS, ()):
            raise ValueError(dropped_context_message(model)) from None
        raise
    finally:
        forward.leave_call()
        if pooling is not None:
            pooling.remove()
    # One process computes every layer over the whole sequence; over several, every rank ran the same model and
    # raises here alike.
    if outermost and forward.world_size > 1 and forward.mixers == 0:
        raise ValueError(unmixed_message(model))
    return out


WHY = ("refuses sequence-sharded inputs to a model whose attention is not ring_dilated, whose structure mixes the "
       "sequence other than through what hf_ring computes, whose saved layout or ulysses_size is not the setup's, or "
       "that is not sharded over the forward's tp group, and a sharded forward in which no layer reached hf_ring; "
       "hands a model that counts its own positions the ones it would count on the whole row (other calls pass "
       "through untouched); installed by import hf_ring and kept")


@torch.compiler.disable  # may join the forward's agreement exchange: outside a compiled graph, on purpose
def _refuse(model: Any, kwargs: Mapping[str, Any]) -> None:
    refuse_other_attention(model, kwargs)
    refuse_structure(model, kwargs)
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
        if isinstance(forward, ShardedForward):
            return _sharded_call(original, self, forward, args, kwargs)
        return original(self, *args, **kwargs)

    __call__.__wrapped__ = original
    return __call__


def install() -> None:
    """Guard every transformers model's call (idempotent; listed by :func:`hf_ring.patches.applied`)."""
    registry.replace(PreTrainedModel, "__call__", _guarded, WHY, kept=True)
