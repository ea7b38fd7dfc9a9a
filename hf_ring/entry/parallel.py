"""Sequence-parallel process groups: a (dp, sp) mesh built from the running world.

Ranks ``[i·sp, (i+1)·sp)`` form one sequence-parallel group (they share one
sequence, each holding a shard); ranks with the same sp index across groups
form a data-parallel group. Works on gloo (CPU) and NCCL (GPU) alike, with
ranks taken from the environment, so nothing assumes a single machine.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import sys
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..engine import comm
from ..engine.arguments import positive_int
from ..engine.balance import CAUSAL
from ..engine.comm import RingComm
from ..engine.layout import check_layout, check_ulysses, check_ulysses_size
from ..patches import apply_all, registry, revert_all
from ..integration.config import attention_work
from ..integration.groups import SequenceParallel, current, set_current


_MESHES: dict = {}


def shutdown(timeout: Optional[float] = None) -> None:
    """End torch.distributed cleanly: every rank's exit meets the others' (bounded by ``timeout`` seconds), then
    ``destroy_process_group``.

    gloo processes that exit with their process group alive often abort at
    exit ("terminate called without an active exception"), and the launcher
    reports a finished job as failed. :func:`setup_sequence_parallel`
    therefore registers this to run at exit; call it yourself only to end the
    group earlier. ``timeout`` defaults to ``HF_RING_TIMEOUT``.

    The exit is a control exchange over every group hf_ring made and the
    world (see :func:`hf_ring.engine.comm.leave`): a rank still waiting in one of
    hf_ring's exchanges (a batch check, the agreement before the ring) learns
    at once that this rank ended and raises, naming it, and this rank ends
    without waiting for it. If the exchange fails or times out (a peer died
    or is still busy), the group is destroyed all the same and a one-line
    note goes to stderr. Does nothing when no group is initialised. The
    sequence-parallel setup is cleared.
    """
    _leave(timeout, "")


def _leave(timeout: Optional[float], reason: str) -> None:
    set_current(None)
    if not (dist.is_available() and dist.is_initialized()):
        return
    groups = [mesh.get_group(name) for mesh in _MESHES.values() for name in mesh.mesh_dim_names]
    try:  # an HF_RING_TIMEOUT made unusable after the setup is reported here too, not left to abort the exit
        timeout = comm.comm_timeout() if timeout is None else float(timeout)
        for note in comm.leave(groups + [dist.group.WORLD], reason, timeout):
            print(f"hf_ring.shutdown: {note}; ending the process group without it", file=sys.stderr)
    except (RuntimeError, ValueError) as err:
        print(f"hf_ring.shutdown: ending the process group without the exit of every rank ({err})", file=sys.stderr)
    _MESHES.clear()
    registry.original(dist, "destroy_process_group")()
    registry.restore(dist, "destroy_process_group")


DESTROY_WHY = ("ends the whole process group as hf_ring.shutdown does (every rank's exit meets the others' first) "
               "while a sequence-parallel setup stands: a script that ends with dist.destroy_process_group() or "
               "accelerator.end_training() would otherwise tear down a gloo rank's connections while a peer still "
               "uses them, which aborts it at exit")


def _met_first(destroy: Any) -> Any:
    """``torch.distributed.destroy_process_group``, whose call for the whole group (no ``group``) runs
    :func:`shutdown` instead: the exit exchange, then that same destroy."""
    @functools.wraps(destroy)
    def destroy_process_group(group: Optional[dist.ProcessGroup] = None) -> None:
        if group is None and dist.is_initialized():
            shutdown()
            return
        destroy(group)

    return destroy_process_group


ERROR_EXIT_S = 5.0
"""Seconds a rank ending on an uncaught error waits for the others at its exit: long enough for ranks waiting in
an hf_ring exchange to learn why it left, short enough not to hold up the error's exit behind ranks still working."""


def _shutdown_at_exit() -> None:
    error = getattr(sys, "last_value", None)
    if error is None:
        shutdown()
        return
    _leave(ERROR_EXIT_S, f"{type(error).__name__}: {error}")


def clear_sequence_parallel() -> None:
    """Stop splitting sequences: attention runs on whole sequences again and model patches are reverted."""
    set_current(None)
    revert_all()


@contextlib.contextmanager
def sequence_parallel(accelerator: Any = None, sp_size: Optional[int] = None, layout: str = "zigzag",
                      ulysses_size: int = 1, tp_size: int = 1, balance_for: Any = None) -> Iterator[SequenceParallel]:
    """:func:`setup_sequence_parallel` for the length of a ``with`` block: sequences are split and model classes
    patched inside it, and on leaving it (an exception included) both are undone as
    :func:`clear_sequence_parallel` undoes them. For a notebook cell, or a teacher model that must run whole
    sequences after the sharded student. A block inside another setup is refused: clear that one first."""
    if current() is not None:
        raise ValueError("hf_ring.sequence_parallel: a sequence-parallel setup is already active; leave its block or "
                         "call hf_ring.clear_sequence_parallel() first")
    sp = setup_sequence_parallel(accelerator, sp_size, layout, ulysses_size, tp_size, balance_for)
    try:
        yield sp
    finally:
        clear_sequence_parallel()


def setup_sequence_parallel(accelerator: Any = None, sp_size: Optional[int] = None,
                            layout: str = "zigzag", ulysses_size: int = 1, tp_size: int = 1,
                            balance_for: Any = None) -> SequenceParallel:
    """Split every sequence across ``sp_size`` ranks; the remaining factor of the world is data parallel.

    ``accelerator`` is an ``accelerate.Accelerator`` (its process group is used;
    ``None`` uses an already initialised ``torch.distributed``). ``sp_size``
    defaults to the whole world (divided by ``tp_size``). ``ulysses_size`` chooses how attention is
    split: 1 runs the ring over the ``sp_size`` ranks; ``sp_size`` runs head
    parallelism (Ulysses: one all-to-all turns sequence shards into head
    shards); a divisor in between runs head parallelism inside groups of
    ``ulysses_size`` consecutive ranks and the ring across the groups (USP).
    The model's query heads must be a multiple of ``ulysses_size``, and its
    K/V heads a multiple or a divisor of it (checked at the first forward).
    ``tp_size`` > 1 adds tensor parallelism: the world becomes a
    ``(dp, sp, tp)`` mesh whose tp groups are ``tp_size`` consecutive ranks
    sharing one batch, each attending ``1/tp_size`` of the heads (shard the
    model over ``sp.tp_mesh`` with :func:`hf_ring.tensor_parallel`).
    ``layout="balanced"`` splits a packed row by its documents
    (:mod:`hf_ring.engine.balance`), weighing each by the keys its rows attend:
    causal pairs, or under ``balance_for`` (the model, or its config) each
    attention layer's window or dilated pattern.
    Returns the setup and makes it the one ``ring_dilated`` attention and
    :func:`hf_ring.shard_batch` use.
    """
    check_layout(layout)
    work = CAUSAL if balance_for is None else attention_work(balance_for)
    check_ulysses_size(ulysses_size)
    check_tp_size(tp_size)
    comm.comm_timeout()  # an unusable HF_RING_TIMEOUT is refused now, before any wait
    if accelerator is not None:
        # accelerate initialises torch.distributed (gloo on CPU, NCCL on GPU) for multi-process runs.
        _ = accelerator.state
    if not (dist.is_available() and dist.is_initialized()):
        if sp_size not in (None, 1) or ulysses_size != 1 or tp_size != 1:
            raise ValueError(
                f"sp_size={sp_size}, ulysses_size={ulysses_size}{'' if tp_size == 1 else f', tp_size={tp_size}'} "
                "needs several processes, and torch.distributed is not initialised in this one; launch N processes "
                "(N a multiple of sp_size·tp_size): `torchrun --nproc_per_node N script.py`, or `accelerate launch --num_processes N "
                "script.py` (on CPUs add `--multi_gpu` and ACCELERATE_USE_CPU=true, else accelerate starts one "
                "process); under a launcher, pass the Accelerator or call torch.distributed.init_process_group first"
            )
        set_current(None)
        return SequenceParallel(None, None, 0, 1, 0, 1, layout, work=work)
    # Registered once however often the setup runs (unregister is a no-op the first time).
    atexit.unregister(_shutdown_at_exit)
    atexit.register(_shutdown_at_exit)
    world = dist.get_world_size()
    seen = getattr(accelerator, "num_processes", world) if accelerator is not None else world
    if seen != world:
        # accelerate without GPUs builds a one-process state unless told to use the CPU, while torchrun's group
        # spans every process: nothing would average the gradients or split the data over the replicas.
        raise ValueError(f"the accelerator sees {seen} process(es) but torch.distributed runs {world}: "
                         + _one_process_fix(accelerator))
    sp_size = _check_sizes(world, sp_size, tp_size)
    check_ulysses(sp_size, ulysses_size)
    # The mesh lives where the ring's tensors do: on the GPU when NCCL carries them, also beside gloo.
    device_type = "cuda" if comm.carriers(None).get("cuda") == "nccl" and torch.cuda.is_available() else "cpu"
    sp = dataclasses.replace(_groups(device_type, world // (sp_size * tp_size), sp_size, tp_size, ulysses_size,
                                     layout), work=work)
    apply_all()
    registry.replace(dist, "destroy_process_group", _met_first, DESTROY_WHY)
    set_current(sp)
    return sp


def check_tp_size(tp_size: Any) -> int:
    """``tp_size``, ranks per tensor-parallel group, as a positive int."""
    return positive_int(tp_size, "tp_size", "ranks per tensor-parallel group")


def _check_sizes(world: int, sp_size: Optional[int], tp_size: int) -> int:
    """``sp_size`` (default: what ``tp_size`` leaves of the world), refused unless ``sp_size·tp_size`` divides it."""
    if world % tp_size:
        raise ValueError(
            f"tp_size={tp_size} does not divide the {world} processes; choose a divisor of {world} (the world is "
            "split into dp x sp x tp)"
        )
    sp_size = world // tp_size if sp_size is None else sp_size
    positive_int(sp_size, "sp_size")
    if world % (sp_size * tp_size):
        if tp_size == 1:
            raise ValueError(
                f"sp_size={sp_size} does not divide the {world} processes; choose a divisor of {world} "
                "(the remaining factor becomes data parallelism)"
            )
        raise ValueError(
            f"sp_size={sp_size} x tp_size={tp_size} = {sp_size * tp_size} does not divide the {world} processes; "
            f"choose sizes whose product divides {world} (the world is split into dp x sp x tp, the remaining "
            "factor becoming data parallelism)"
        )
    return sp_size


def _groups(device_type: str, dp_size: int, sp_size: int, tp_size: int, ulysses_size: int,
            layout: str) -> SequenceParallel:
    """The process groups of a ``(dp, sp[, tp])`` mesh, tp innermost: a tp group is ``tp_size`` consecutive ranks."""
    tp_dims, tp_names = ((tp_size,), ("tp",)) if tp_size > 1 else ((), ())
    mesh = _mesh(device_type, (dp_size, sp_size) + tp_dims, ("dp", "sp") + tp_names)
    sp_group, dp_group = mesh.get_group("sp"), mesh.get_group("dp")
    sp_comm = RingComm(sp_group) if sp_size > 1 else None
    head_comm, ring_comm = None, sp_comm
    if ulysses_size == sp_size:
        head_comm, ring_comm = sp_comm, None
    elif ulysses_size > 1:  # sp rank g·u + j: member j of head-parallel group g
        split = _mesh(device_type, (dp_size, sp_size // ulysses_size, ulysses_size) + tp_dims,
                      ("dp", "ring", "ulysses") + tp_names)
        head_comm, ring_comm = RingComm(split.get_group("ulysses")), RingComm(split.get_group("ring"))
    tp_group = mesh.get_group("tp") if tp_size > 1 else None
    return SequenceParallel(
        sp_group, dp_group, dist.get_rank(sp_group), sp_size, dist.get_rank(dp_group), dp_size, layout,
        sp_comm, mesh, ulysses_size, head_comm, ring_comm, tp_size=tp_size,
        tp_rank=0 if tp_group is None else dist.get_rank(tp_group), tp_group=tp_group,
        tp_mesh=None if tp_group is None else mesh["tp"],
    )


def _one_process_fix(accelerator: Any) -> str:
    """Why accelerate counted one process on a machine without GPUs, and what makes it count them all."""
    if getattr(accelerator, "distributed_type", None) == "DEEPSPEED":
        # accelerate's CPU mode turns DeepSpeed off, and without it accelerate's state gets no backend on CPUs.
        return ("under DeepSpeed on a machine without GPUs accelerate's state has no process-group backend (its CPU "
                "mode, use_cpu/ACCELERATE_USE_CPU, would turn DeepSpeed off); name gloo before the state is built: "
                "Accelerator(deepspeed_plugin=..., kwargs_handlers=[InitProcessGroupKwargs(backend='gloo')]), or for "
                "a Trainer, with ACCELERATE_USE_DEEPSPEED=true in the environment, PartialState(backend='gloo') before "
                "the TrainingArguments and TrainingArguments(accelerator_config={'use_configured_state': True})")
    return ("on a machine without GPUs accelerate joins the processes only when told to use the CPU; pass "
            "TrainingArguments(use_cpu=True) or Accelerator(cpu=True), or launch with ACCELERATE_USE_CPU=true")


def _mesh(device_type: str, shape: tuple, names: tuple):
    """The device mesh of this shape, made once: creating its groups is a collective over the world."""
    key = (device_type, shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _MESHES[key]
