"""Split a batch along the sequence for the ranks of a sequence-parallel group, and put outputs back.

Labels are shifted on the *global* sequence before sharding, so the last
token of a shard keeps its target (the model's own loss would shift inside
each shard and lose it). The loss each rank computes is its shard's share of
the sequence loss: summed over the sp group it is the global loss.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

from .comm import all_gather
from .context import CONTEXT_KEY, ShardedForward
from .layout import local_positions
from .groups import SequenceParallel, current

IGNORE_INDEX = -100


def fingerprint(ids: torch.Tensor) -> int:
    """A 31-bit fingerprint of a batch of token ids, computed where they live; equal batches give equal values."""
    weights = (torch.arange(1, ids.numel() + 1, device=ids.device, dtype=torch.long) * 2654435761) % 2147483647
    return int((ids.reshape(-1).long() * weights).sum() % 2147483647)


def _sp(sp: Optional[SequenceParallel]):
    sp = sp or current()
    if sp is None or sp.sp_group is None:
        return None
    return sp


def shard_batch(batch: Mapping[str, Any], sp: Optional[SequenceParallel] = None) -> Dict[str, Any]:
    """This rank's part of ``batch`` (``input_ids``, optional ``labels``, ``attention_mask``, ``position_ids``).

    Adds global ``position_ids``, globally shifted ``shift_labels`` and the
    global ``num_items_in_batch`` when labels are given, and ``ring_context``:
    the facts of this forward that every attention layer reads (global
    length, padding, the group), so the ranks agree on them once per forward.
    Any length works, including one shorter than the number of ranks.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping such as a dict, got {type(batch).__name__}")
    if CONTEXT_KEY in batch:
        raise ValueError(f"this batch is already sharded (it carries {CONTEXT_KEY!r}); shard the global batch once")
    if "input_ids" not in batch:
        raise ValueError("shard_batch needs 'input_ids' of shape (batch, seq_len)")
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D tensor (batch, seq_len), got {getattr(ids, 'shape', type(ids))}")
    b, n = ids.shape
    for key in ("labels", "attention_mask", "position_ids"):
        t = batch.get(key)
        if t is not None and tuple(t.shape) != (b, n):
            raise ValueError(f"{key} must have the shape of input_ids {(b, n)}, got {tuple(t.shape)}")
    group = _sp(sp)
    rank, size, layout = (0, 1, "contiguous") if group is None else (group.sp_rank, group.sp_size, group.layout)
    pos = local_positions(n, rank, size, layout).to(ids.device)

    out: Dict[str, Any] = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "attention_mask", "position_ids")}
    out["input_ids"] = ids[:, pos]
    if batch.get("attention_mask") is not None:
        out["attention_mask"] = batch["attention_mask"][:, pos]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(n, device=ids.device).expand(b, n)
    out["position_ids"] = positions[:, pos]
    labels = batch.get("labels")
    if labels is not None:
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        out["labels"] = labels[:, pos]
        out["shift_labels"] = shifted[:, pos]
        out["num_items_in_batch"] = int((shifted != IGNORE_INDEX).sum())
    mask = batch.get("attention_mask")
    out[CONTEXT_KEY] = ShardedForward(
        n, None if group is None else group.comm, layout, padded=mask is not None and not bool(mask.all()),
        contents=0 if group is None else fingerprint(ids),
    )
    out.setdefault("use_cache", False)  # a KV cache of a training shard is never read
    return out


def gather_sequence(tensor: torch.Tensor, seq_len: int, dim: int = 1,
                    sp: Optional[SequenceParallel] = None) -> torch.Tensor:
    """Reassemble a tensor sharded along ``dim`` by :func:`shard_batch` into global order (every rank gets it).

    Meant for outputs such as logits in evaluation: the result has the global length.
    """
    group = _sp(sp)
    if group is None:
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    sizes = [len(local_positions(seq_len, r, group.sp_size, group.layout)) for r in range(group.sp_size)]
    if moved.shape[0] != sizes[group.sp_rank]:
        raise ValueError(
            f"this rank holds {moved.shape[0]} rows along dim {dim}, but seq_len={seq_len} gives it {sizes[group.sp_rank]}"
        )
    longest = max(sizes)
    padded = moved.new_zeros((longest,) + moved.shape[1:])
    padded[: moved.shape[0]] = moved
    parts = all_gather(padded, group.sp_group, "the sequence gather")
    full = moved.new_empty((seq_len,) + moved.shape[1:])
    for r, part in enumerate(parts):
        full[local_positions(seq_len, r, group.sp_size, group.layout).to(full.device)] = part[: sizes[r]]
    return full.movedim(0, dim)
