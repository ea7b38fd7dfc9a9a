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
   would count on the whole row (:mod:`hf_ring.integration.positions`), a
   sequence classifier's head the score of each row's last real token
   (:func:`hf_ring.integration.readout.pool_over_shards`), and a mixture of
   experts its router's load-balancing loss over the whole sequence
   (:mod:`hf_ring.patches.router_loss`);
4. the call itself;
5. a forward whose attention never saw the shards, or in which no layer
   reached hf_ring, is refused on every rank, naming the model.

A decode step of :func:`hf_ring.generate` is refused as a sharded call is,
and then runs as it is. A ``ring_dilated`` hybrid called in one process
without any hf_ring call gets a forward of its own
(:func:`one_process_call`) when its recurrent layers need one: given packed
rows (a padding-free training loop: position ids restarting and no mask or
cache, or ``cu_seq_lens_q`` / ``seq_idx``), the forward holds the documents,
so its recurrent layers keep them apart as its attention does (transformers'
torch kernels would carry each document's state into the next); given rows
longer than :data:`~hf_ring.engine.recurrence.SCAN_ROWS` with no padding and
a cache that holds nothing yet (none, or the one a prefill or a training step
makes), its recurrent layers run them in pieces of at most that many rows,
each starting from the state the one before ended in, so their time grows
linearly with the rows; the states they end in fill the cache as the whole
row's would.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from transformers import PreTrainedModel

from ..engine.agreement import UNSHARDED_RANKS
from ..engine.documents import VARLEN_KEYS, documents_of_call
from ..engine.recurrence import SCAN_ROWS
from ..integration.config import runs_ring
from ..integration.context import CONTEXT_KEY, ShardedForward
from ..integration.groups import current
from ..integration.seams import cache_argument, holds_nothing
from ..integration.positions import counted_positions
from ..integration.readout import pool_over_shards
from ..patches import apply, needs, registry
from ..patches.hybrids import family
from ..patches.router_loss import over_shards, report
from .guard import dropped_context_message, refuse, unmixed_message
from .media import MediaForward, enter


def sharded_call(original, model: Any, forward: ShardedForward, args: tuple, kwargs: dict):
    """``original(model, *args, **kwargs)`` (the model's own call) over the shards of ``forward`` (see the module
    docstring)."""
    _refuse(model, kwargs)
    if forward.world_size > 1 or ((forward.documents is not None or forward.long) and needs(model).hybrid is not None):
        apply(model)
    outermost = forward.enter_call()
    try:
        if outermost:
            kwargs = counted_positions(needs(model).counting, forward, kwargs)
            pool_over_shards(model, forward, kwargs)
        with over_shards(model, forward) if outermost else contextlib.nullcontext():
            out = original(model, *args, **kwargs)
        if outermost:
            out = report(out, forward)
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


def one_process_call(model: Any, kwargs: dict) -> Optional[dict]:
    """For a call of a ``ring_dilated`` hybrid in one process with no forward context (see the module docstring),
    the call's keyword arguments with a one-process forward of its own when its recurrent layers need one: for
    packed rows with no cache (holding the documents), or for rows longer than
    :data:`~hf_ring.engine.recurrence.SCAN_ROWS`, no padding and a cache holding nothing yet (cut into pieces);
    the collator's varlen keys and a mask that masks nothing are dropped (the forward holds what they say). None
    for every other call. A ``ring_dilated`` model hf_ring cannot split (recurrent layers of a family it does not
    hook) is refused packed rows: its layers would carry their state from one document into the next."""
    if kwargs.get(CONTEXT_KEY) is not None or not runs_ring(getattr(model, "config", None)):
        return None
    sp = current()
    if sp is not None and sp.comm is not None:
        return None  # (over several ranks a whole-sequence forward is refused by the attention, on every rank)
    ids = kwargs.get("input_ids")
    tokens = ids if ids is not None else kwargs.get("inputs_embeds")
    if tokens is None:
        return None
    positions = kwargs.get("position_ids")
    varlen = any(kwargs.get(k) is not None for k in VARLEN_KEYS)
    cached = cache_argument(kwargs) is not None or kwargs.get("use_cache", getattr(model.config, "use_cache", False))
    mask = kwargs.get("attention_mask")
    masked = mask is not None or bool(cached)  # transformers reads no documents then
    b, n = tokens.shape[:2]
    documents = None if positions is None and not varlen else documents_of_call(
        b, n, positions, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), masked, kwargs.get("seq_idx"))
    # What reads tensors last: a compiled call (a static cache's decoding step) reaches no data-dependent branch
    long = documents is None and not varlen and n > SCAN_ROWS and \
        family(getattr(model.config, "model_type", None)) is not None and _unpadded(mask) and holds_nothing(kwargs)
    if documents is None and not varlen and not long:
        return None  # (a collator's varlen keys of one document per row would still stop transformers' kernels)
    found = needs(model)  # (only now: the check walks every module, and warns of a family it has not tested)
    if found.hybrid is None and found.error is None:
        return None
    if found.error is not None:
        if documents is None:
            return None
        raise ValueError(f"{type(model).__name__} was given packed rows (several documents in one row), which hf_ring "
                         f"keeps apart only in the layers it computes, and it cannot compute this model's: "
                         f"{found.error}. Give one document per row, padded (attention_mask)")
    own = ShardedForward.over(None, n, "contiguous", documents=documents, positions=positions,
                              positions_given=positions is not None)
    dropped = VARLEN_KEYS + (("attention_mask",) if long or _unpadded(mask) else ())
    return {**{k: v for k, v in kwargs.items() if k not in dropped}, CONTEXT_KEY: own}


def _unpadded(mask: Any) -> bool:
    """No attention mask, or a 2-D one that masks nothing (a whole batch of long rows, as a collator gives it)."""
    return mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all()))


def _guarded(original):
    def __call__(self, *args, **kwargs):
        forward = kwargs.get(CONTEXT_KEY)
        if forward is None:
            own = one_process_call(self, kwargs)
            if own is not None:
                kwargs, forward = own, own[CONTEXT_KEY]
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
