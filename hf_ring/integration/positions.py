"""Positions a model counts itself, given to a shard as the model would count them on the whole row.

RoBERTa-style embeddings (RoBERTa, XLM-R, CamemBERT, Data2Vec-text, ...)
number a row's tokens ``padding_idx + 1, + 2, ...`` from their own input ids,
skipping padding tokens; given ``position_ids`` they use them as they are. A
shard counting from its own first row would give every rank but the first
the wrong positions, so when the batch brought no position ids of its own the
guard on a sharded call replaces the ones :func:`hf_ring.shard_batch` counted
with the model's own count, continued from the non-padding tokens the other
ranks hold before each of this rank's runs (one small all-gather of counts).
The model's own ``create_position_ids_from_input_ids`` does the counting.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..engine.layout import totals_before
from .context import ShardedForward

Tensor = torch.Tensor


def counted_positions(embeddings: Optional[torch.nn.Module], forward: ShardedForward,
                      kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``kwargs`` with the position ids a model would count on the whole rows, where it counts its own (``embeddings``:
    the module that counts, :func:`hf_ring.patches.structure.counting_embeddings`; None: it does not) and the batch
    gave none; ``kwargs`` unchanged otherwise. Called once per forward, for the outermost model given the sharded
    batch (inner models get what it passes on), on every rank of the group (it may exchange counts)."""
    if embeddings is None or forward.positions_given or kwargs.get("position_ids") is None:
        return kwargs
    pad = embeddings.padding_idx
    ids = kwargs.get("input_ids")
    if ids is None:
        if kwargs.get("inputs_embeds") is None:
            return kwargs
        # from embeddings the model counts every row, from padding_idx + 1 (its inputs_embeds rule)
        return {**kwargs, "position_ids": kwargs["position_ids"] + pad + 1}
    pieces = forward.pieces()
    runs = pieces.local()  # none on a rank holding a placeholder row
    kept = ids.ne(pad)
    totals = torch.zeros(ids.shape[0], pieces.width, dtype=torch.long, device=ids.device)
    for i, (offset, length) in enumerate(runs):
        totals[:, i] = kept[:, offset:offset + length].sum(1)
    every = totals[None] if forward.comm is None else forward.comm.all_gather(totals, "the count of positions")
    if not runs:  # a placeholder row: nothing reads its position
        return kwargs
    before = totals_before(pieces.runs, every, pieces.rank)
    counted = [embeddings.create_position_ids_from_input_ids(ids[:, offset:offset + length], pad, before[:, i:i + 1])
               for i, (offset, length) in enumerate(runs)]
    return {**kwargs, "position_ids": torch.cat(counted, dim=1)}
