"""Gradients of a sequence-parallel step without DDP: summed over sp, averaged over dp, in flat buckets."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..engine import comm
from ..integration.groups import SequenceParallel, current
from .zero import managed_by_deepspeed


BUCKET_BYTES = 25 * 2**20
"""Gradients are reduced in flat buckets of about this size: one collective per bucket, not per parameter."""


def sync_gradients(model: torch.nn.Module, sp: Optional[SequenceParallel] = None,
                   bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum parameter gradients over the sp group and average them over the dp group.

    For training without DDP. Under DDP or DeepSpeed use ``loss * sp.loss_scale`` instead (a model whose
    parameters DeepSpeed manages is refused).
    Every rank must pass the same model (same parameters, in the same order).
    A parameter with ``requires_grad`` whose gradient is ``None`` on some ranks
    counts as zeros there, so it ends up with the same gradient on every rank;
    one whose gradient is ``None`` on every rank stays ``None`` (one small
    reduction of flags decides, so no rank waits for a collective another rank
    skipped). Gradients travel in flat buckets of about ``bucket_bytes``, one
    per dtype and device, each reduced once over sp and once over dp.
    Under tensor parallelism a DTensor gradient is reduced on this rank's
    shard (the ranks of an sp or dp group hold the same shard); its mesh must
    be the setup's ``tp_mesh``: an FSDP2-sharded model reduces its own
    gradients and is refused here.
    """
    sp = sp or current()
    if sp is None or sp.sp_group is None or sp.sp_size * sp.dp_size == 1:
        return
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if managed_by_deepspeed(params):
        raise ValueError(
            "sync_gradients was given a model whose parameters DeepSpeed manages: its engine reduces the gradients "
            "itself, averaging them over every rank, so reducing them here as well would scale them wrongly; call "
            "accelerator.backward(loss * sp.loss_scale) (or engine.backward) instead of sync_gradients"
        )
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError("sync_gradients needs dense gradients; a parameter has a sparse one (use sparse=False)")
    _check_shards(named, sp)
    device = comm.device_for(sp.sp_group)
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=device)
    for group, size in ((sp.sp_group, sp.sp_size), (sp.dp_group, sp.dp_size)):
        if size > 1:
            comm.all_reduce(has, group, "the gradient presence check", op=dist.ReduceOp.MAX)
    grads = []
    for p, present in zip(params, has.tolist()):
        if present:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(_local_grad(p))
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        if sp.sp_size > 1:
            comm.all_reduce(flat, sp.sp_group, "the gradient sum over the sequence-parallel group")
        if sp.dp_size > 1:
            comm.all_reduce(flat, sp.dp_group, "the gradient sum over the data-parallel group")
            flat /= sp.dp_size
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


def _local_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """The gradient of ``p`` as this rank holds it: a DTensor's local shard (a view, so writes reach it)."""
    if not isinstance(p.grad, DTensor):
        return p.grad
    if p.grad.placements != p.placements:  # e.g. a partial sum left for later: settle it as the parameter lies
        p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
    return p.grad.to_local()


def _check_shards(named, sp: SequenceParallel) -> None:
    """Refuse DTensor parameters sharded other than over the setup's tensor-parallel group (FSDP2, another TP group):
    summing their local pieces over sp and dp would mix different slices."""
    tp_ranks = sorted(dist.get_process_group_ranks(sp.tp_group)) if sp.tp_group is not None else None
    seen: dict = {}
    for name, p in named:
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        if id(mesh) not in seen:
            seen[id(mesh)] = mesh.ndim == 1 and sorted(mesh.mesh.flatten().tolist()) == tp_ranks
        if not seen[id(mesh)]:
            raise ValueError(
                f"sync_gradients: parameter {name!r} is a DTensor over ranks {mesh.mesh.flatten().tolist()} (mesh "
                f"dims {mesh.mesh_dim_names}), but this setup's tensor-parallel group is {tp_ranks or 'none'} "
                f"(tp_size={sp.tp_size}); only tensor-parallel shards over sp.tp_mesh can be reduced here. A model "
                "sharded with FSDP2 reduces its gradients itself: multiply the loss by sp.loss_scale before backward "
                "and do not call sync_gradients. A tensor-parallel model must be sharded over sp.tp_mesh "
                "(hf_ring.tensor_parallel(model) after setup_sequence_parallel(..., tp_size=...))"
            )


def _buckets(tensors, limit: int):
    """``tensors`` in order, grouped by (dtype, device) into lists of at most ``limit`` bytes (or one tensor)."""
    filling: dict = {}  # (dtype, device) -> [tensors, bytes]
    for t in tensors:
        entry = filling.setdefault((t.dtype, t.device), [[], 0])
        if entry[0] and entry[1] + t.nbytes > limit:
            yield entry[0]
            entry[:] = [[], 0]
        entry[0].append(t)
        entry[1] += t.nbytes
    for bucket, _ in filling.values():
        if bucket:
            yield bucket
