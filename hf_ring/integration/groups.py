"""The sequence-parallel setup of this process: its groups, and which one is active.

Made by :func:`hf_ring.setup_sequence_parallel` and read by everything that
must know whether sequences are split (the attention backend, the data
helpers, the model patches). Like torch.distributed's default group, the
active setup belongs to the process, so it has one owner here, below every
module that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple


from ..engine.balance import CAUSAL, Work
from ..engine.comm import RingComm


@dataclass(frozen=True)
class SequenceParallel:
    """The groups attention and the data helpers use; made by :func:`setup_sequence_parallel`."""

    sp_group: Any
    dp_group: Any
    sp_rank: int
    sp_size: int
    dp_rank: int
    dp_size: int
    layout: str
    comm: Optional[RingComm] = None
    """Ring neighbours and bounded collectives over ``sp_group`` (None when the sequence is not split)."""
    mesh: Any = None
    """The ``("dp", "sp")`` device mesh the groups come from, ``("dp", "sp", "tp")`` under tensor parallelism
    (handed to accelerate's data loaders)."""
    ulysses_size: int = 1
    """Ranks per head-parallel group (1: the ring alone; ``sp_size``: head parallelism alone; between: both)."""
    head_comm: Optional[RingComm] = None
    """The all-to-all of this rank's head-parallel group (None when ``ulysses_size`` is 1)."""
    ring_comm: Optional[RingComm] = None
    """The ring over the head-parallel groups, between ranks at the same place in their group (None: one group)."""
    tp_size: int = 1
    """Ranks per tensor-parallel group: consecutive ranks that share one batch and split the model's heads."""
    tp_rank: int = 0
    """This rank's place in its tensor-parallel group: it holds query heads ``tp_rank·Hq/tp_size`` onward."""
    tp_group: Any = None
    """The tensor-parallel process group (None when ``tp_size`` is 1)."""
    tp_mesh: Any = None
    """The 1-D ``"tp"`` device mesh of ``tp_group``, the one to shard the model over (None when ``tp_size`` is 1)."""
    work: Work = CAUSAL
    """What ``layout="balanced"`` weighs a document by: the keys its rows attend in the model's attention layers
    (``balance_for`` of :func:`hf_ring.setup_sequence_parallel`; causal pairs without it)."""

    @property
    def loss_scale(self) -> float:
        """Multiply the local loss by this before ``backward`` when DDP or DeepSpeed averages over all ranks.

        Each rank's loss is its shard's share of the sequence loss, so shard
        gradients must be *summed* over the sp group; DDP and DeepSpeed's engine
        (every ZeRO stage) average over the whole world (dp x sp), which divides
        that sum by ``sp_size`` too many. Under tensor parallelism FSDP2
        averages over the dp x sp ranks of each tp rank: the same scale.
        """
        return float(self.sp_size)


_CURRENT: Optional[SequenceParallel] = None


def current() -> Optional[SequenceParallel]:
    """The active sequence-parallel setup, or None when the sequence is not split."""
    return _CURRENT


def tp_place() -> Tuple[int, int]:
    """This rank's place in its tensor-parallel group, ``(tp_rank, tp_size)``, from the active setup (``(0, 1)``
    without one): it decides the global index of the rank's first head."""
    sp = _CURRENT
    return (0, 1) if sp is None else (sp.tp_rank, sp.tp_size)


def set_current(sp: Optional[SequenceParallel]) -> None:
    """Make ``sp`` the active setup (None: sequences are not split)."""
    global _CURRENT
    _CURRENT = sp
