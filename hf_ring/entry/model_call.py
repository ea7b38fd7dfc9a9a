"""A transformers model's call with a forward context: the one path a sharded model call takes.

``import hf_ring`` guards ``PreTrainedModel.__call__`` (:func:`install`). A call
without a forward context (every call of a model that hf_ring never sees)
passes through untouched. A multimodal batch from :func:`hf_ring.shard_batch`
carries a :class:`~hf_ring.entry.media.MediaForward`: the call of the model's
language model gets this rank's rows (:func:`~hf_ring.entry.media.enter`) and
is then a sharded call like any other. A sharded call (:func:`sharded_call`),
read top to bottom:

1. refused, on every rank, for any reason :mod:`hf_ring.entry.guard` knows;
2. what the model needs while its sequence is split is installed
   (:func:`hf_ring.patches.apply`: global-length RoPE, hooks on its recurrent
   layers' kernels), when it is split over several ranks;
3. the outermost call hands a model that counts its own positions the ones it
   would count on the whole row (:mod:`hf_ring.integration.positions`), and a
   sequence classifier's head the score of each row's last real token
   (:func:`hf_ring.integration.readout.pool_over_shards`);
4. the call itself;
5. a forward whose attention never saw the shards, or in which no layer
   reached hf_ring, is refused on every rank, naming the model.

A decode step of :func:`hf_ring.generate` is refused as a sharded call is,
and then runs as it is.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from ..engine.agreement import UNSHARDED_RANKS
from ..integration.context import CONTEXT_KEY, ShardedForward
from ..integration.positions import counted_positions
from ..integration.readout import pool_over_shards
from ..patches import apply, needs, registry
from .guard import dropped_context_message, refuse, unmixed_message
from .media import MediaForward, enter


def sharded_call(original, model: Any, forward: ShardedForward, args: tuple, kwargs: dict):
    """``original(model, *args, **kwargs)`` (the model's own call) over the shards of ``forward`` (see the module
    docstring)."""
    _refuse(model, kwargs)
    if forward.world_size > 1:
        apply(model)
    outermost = forward.enter_call()
    try:
        if outermost:
            kwargs = counted_positions(needs(model).counting, forward, kwargs)
            pool_over_shards(model, forward, kwargs)
        out = original(model, *args, **kwargs)
    except ValueError as err:
        # The backend saw no sharded inputs on this rank, though they arrived here: the model dropped them.
        if (0 if forward.comm is None else forward.comm.rank) in getattr(err, UNSHARDED_RANKS, ()):
            raise ValueError(dropped_context_message(model)) from None
        raise
    finally:
        forward.leave_call()
    # One process computes every layer over the whole sequence; over several, every rank ran the same model and
    # raises here alike.
    if outermost and forward.world_size > 1 and forward.mixers == 0:
        raise ValueError(unmixed_message(model))
    return out


@torch.compiler.disable  # may join the forward's agreement exchange: outside a compiled graph, on purpose
def _refuse(model: Any, kwargs: dict) -> None:
    refuse(model, kwargs)


@torch.compiler.disable  # binds the forward's decoder, and may join its agreement exchange
def _enter(model: Any, forward: MediaForward, kwargs: dict) -> dict:
    return enter(model, forward, kwargs)


def _guarded(original):
    def __call__(self, *args, **kwargs):
        forward = kwargs.get(CONTEXT_KEY)
        if isinstance(forward, MediaForward):  # a multimodal forward: split where its language model starts
            kwargs = _enter(self, forward, kwargs)
            forward = kwargs.get(CONTEXT_KEY)
        if isinstance(forward, ShardedForward):
            return sharded_call(original, self, forward, args, kwargs)
        if forward is not None and not isinstance(forward, MediaForward):
            _refuse(self, kwargs)  # a decode step
        return original(self, *args, **kwargs)

    __call__.__wrapped__ = original
    return __call__


WHY = ("refuses sequence-sharded inputs to a model whose attention is not ring_dilated, whose structure mixes the "
       "sequence other than through what hf_ring computes, whose saved layout or ulysses_size is not the setup's, or "
       "that is not sharded over the forward's tp group, and a sharded forward in which no layer reached hf_ring; "
       "installs what a split model needs, hands a model that counts its own positions the ones it would count on "
       "the whole row and a sequence classifier the score of each row's last token (other calls pass through "
       "untouched); installed by import hf_ring and kept")


def install() -> None:
    """Guard every transformers model's call (idempotent; listed by :func:`hf_ring.patches.applied`)."""
    registry.replace(PreTrainedModel, "__call__", _guarded, WHY, kept=True)
