"""Sequence-parallel process groups: a (dp, sp) mesh built from the running world.

Ranks ``[i·sp, (i+1)·sp)`` form one sequence-parallel group (they share one
sequence, each holding a shard); ranks with the same sp index across groups
form a data-parallel group. Works on gloo (CPU) and NCCL (GPU) alike, with
ranks taken from the environment, so nothing assumes a single machine.
"""
from __future__ import annotations

import atexit
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from . import comm
from . import patches
from .comm import RingComm
from .groups import SequenceParallel, current, set_current
from .layout import check_layout, check_ulysses, check_ulysses_size


_MESHES: dict = {}


def shutdown(timeout: Optional[float] = None) -> None:
    """End torch.distributed cleanly: a barrier over the world bounded by ``timeout`` seconds, then
    ``destroy_process_group``.

    gloo processes that exit with their process group alive often abort at
    exit ("terminate called without an active exception"), and the launcher
    reports a finished job as failed. :func:`setup_sequence_parallel`
    therefore registers this to run at exit; call it yourself only to end the
    group earlier. ``timeout`` defaults to ``HF_RING_TIMEOUT``. If the barrier
    fails or times out (a peer died or is still busy), the group is destroyed
    all the same and a one-line note goes to stderr. Does nothing when no
    group is initialised. The sequence-parallel setup is cleared.
    """
    set_current(None)
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        timeout = comm.comm_timeout() if timeout is None else float(timeout)
        comm.all_reduce(torch.zeros(1, device=comm.device_for(None)), None, "the barrier before shutdown",
                        timeout=timeout)
    except (RuntimeError, ValueError) as err:
        print(f"hf_ring.shutdown: ending the process group without the barrier ({err})", file=sys.stderr)
    _MESHES.clear()
    dist.destroy_process_group()


def _shutdown_at_exit() -> None:
    # An uncaught exception on this rank: its peers will not come to a barrier in time (they are waiting for
    # this rank's next send, or have failed too), so waiting for them would only delay the error's exit.
    if getattr(sys, "last_value", None) is not None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        return
    shutdown()


def clear_sequence_parallel() -> None:
    """Stop splitting sequences: attention runs on whole sequences again and model patches are reverted."""
    set_current(None)
    patches.revert_all()


def setup_sequence_parallel(accelerator: Any = None, sp_size: Optional[int] = None,
                            layout: str = "zigzag", ulysses_size: int = 1) -> SequenceParallel:
    """Split every sequence across ``sp_size`` ranks; the remaining factor of the world is data parallel.

    ``accelerator`` is an ``accelerate.Accelerator`` (its process group is used;
    ``None`` uses an already initialised ``torch.distributed``). ``sp_size``
    defaults to the whole world. ``ulysses_size`` chooses how attention is
    split: 1 runs the ring over the ``sp_size`` ranks; ``sp_size`` runs head
    parallelism (Ulysses: one all-to-all turns sequence shards into head
    shards); a divisor in between runs head parallelism inside groups of
    ``ulysses_size`` consecutive ranks and the ring across the groups (USP).
    The model's query heads must be a multiple of ``ulysses_size``, and its
    K/V heads a multiple or a divisor of it (checked at the first forward).
    Returns the setup and makes it the one ``ring_dilated`` attention and
    :func:`hf_ring.shard_batch` use.
    """
    check_layout(layout)
    check_ulysses_size(ulysses_size)
    comm.comm_timeout()  # an unusable HF_RING_TIMEOUT is refused now, before any wait
    if accelerator is not None:
        # accelerate initialises torch.distributed (gloo on CPU, NCCL on GPU) for multi-process runs.
        _ = accelerator.state
    if not (dist.is_available() and dist.is_initialized()):
        if sp_size not in (None, 1) or ulysses_size != 1:
            raise ValueError(
                f"sp_size={sp_size}, ulysses_size={ulysses_size} needs several processes, and torch.distributed is not "
                "initialised in this one; launch N processes (N a multiple of sp_size): `torchrun --nproc_per_node N "
                "script.py`, or `accelerate launch --num_processes N script.py` (on CPUs add `--multi_gpu` and "
                "ACCELERATE_USE_CPU=true, else accelerate starts one process); under a launcher, pass the Accelerator "
                "or call torch.distributed.init_process_group first"
            )
        set_current(None)
        return SequenceParallel(None, None, 0, 1, 0, 1, layout)
    # Registered once however often the setup runs (unregister is a no-op the first time).
    atexit.unregister(_shutdown_at_exit)
    atexit.register(_shutdown_at_exit)
    world = dist.get_world_size()
    seen = getattr(accelerator, "num_processes", world) if accelerator is not None else world
    if seen != world:
        # accelerate without GPUs builds a one-process state unless told to use the CPU, while torchrun's group
        # spans every process: nothing would average the gradients or split the data over the replicas.
        raise ValueError(
            f"the accelerator sees {seen} process(es) but torch.distributed runs {world}: on a machine without GPUs "
            "accelerate joins the processes only when told to use the CPU; pass TrainingArguments(use_cpu=True) or "
            "Accelerator(cpu=True), or launch with ACCELERATE_USE_CPU=true"
        )
    sp_size = world if sp_size is None else sp_size
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive int, got {sp_size!r}")
    if world % sp_size:
        raise ValueError(
            f"sp_size={sp_size} does not divide the {world} processes; choose a divisor of {world} "
            "(the remaining factor becomes data parallelism)"
        )
    check_ulysses(sp_size, ulysses_size)
    dp_size = world // sp_size
    # The mesh lives where the ring's tensors do: on the GPU when NCCL carries them, also beside gloo.
    device_type = "cuda" if comm.carriers(None).get("cuda") == "nccl" and torch.cuda.is_available() else "cpu"
    mesh = _mesh(device_type, (dp_size, sp_size), ("dp", "sp"))
    sp_group, dp_group = mesh.get_group("sp"), mesh.get_group("dp")
    sp_comm = RingComm(sp_group) if sp_size > 1 else None
    head_comm, ring_comm = None, sp_comm
    if ulysses_size == sp_size:
        head_comm, ring_comm = sp_comm, None
    elif ulysses_size > 1:  # sp rank g·u + j: member j of head-parallel group g
        split = _mesh(device_type, (dp_size, sp_size // ulysses_size, ulysses_size), ("dp", "ring", "ulysses"))
        head_comm, ring_comm = RingComm(split.get_group("ulysses")), RingComm(split.get_group("ring"))
    patches.apply_all()
    sp = SequenceParallel(
        sp_group, dp_group, dist.get_rank(sp_group), sp_size, dist.get_rank(dp_group), dp_size, layout,
        sp_comm, mesh, ulysses_size, head_comm, ring_comm,
    )
    set_current(sp)
    return sp


def _mesh(device_type: str, shape: tuple, names: tuple):
    """The device mesh of this shape, made once: creating its groups is a collective over the world."""
    key = (device_type, shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _MESHES[key]


BUCKET_BYTES = 25 * 2**20
"""Gradients are reduced in flat buckets of about this size: one collective per bucket, not per parameter."""


def sync_gradients(model: torch.nn.Module, sp: Optional[SequenceParallel] = None,
                   bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum parameter gradients over the sp group and average them over the dp group.

    For training without DDP. Under DDP use ``loss * sp.loss_scale`` instead.
    Every rank must pass the same model (same parameters, in the same order).
    A parameter with ``requires_grad`` whose gradient is ``None`` on some ranks
    counts as zeros there, so it ends up with the same gradient on every rank;
    one whose gradient is ``None`` on every rank stays ``None`` (one small
    reduction of flags decides, so no rank waits for a collective another rank
    skipped). Gradients travel in flat buckets of about ``bucket_bytes``, one
    per dtype and device, each reduced once over sp and once over dp.
    """
    sp = sp or current()
    if sp is None or sp.sp_group is None or sp.sp_size * sp.dp_size == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError("sync_gradients needs dense gradients; a parameter has a sparse one (use sparse=False)")
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
            grads.append(p.grad)
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        if sp.sp_size > 1:
            comm.all_reduce(flat, sp.sp_group, "the gradient sum over the sequence-parallel group")
        if sp.dp_size > 1:
            comm.all_reduce(flat, sp.dp_group, "the gradient sum over the data-parallel group")
            flat /= sp.dp_size
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


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
