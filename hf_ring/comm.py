"""Point-to-point exchanges between ring neighbours, with a bounded wait.

Every wait has a timeout, so a rank whose peer died or was given other shapes
raises instead of blocking forever. The timeout is ``HF_RING_TIMEOUT`` seconds
(default 600), read when a ``RingComm`` is made.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

Tensor = torch.Tensor

DEFAULT_TIMEOUT_S = 600.0


def comm_timeout() -> float:
    raw = os.environ.get("HF_RING_TIMEOUT", "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"HF_RING_TIMEOUT={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"HF_RING_TIMEOUT must be > 0 seconds, got {raw!r}")
    return value


class CommTimeoutError(RuntimeError):
    """A point-to-point exchange or collective did not finish in time, or failed."""


class Pending:
    """Sends and receives in flight; ``wait()`` returns the received tensors."""

    def __init__(self, works, sent: List[Tensor], received: List[Tensor], what: str, timeout: float):
        self._works, self._received, self._what, self._timeout = works, received, what, timeout
        self._sent = sent  # keep send buffers alive until their transfer completes

    def wait(self) -> List[Tensor]:
        for work in self._works:
            _wait(work, self._what, self._timeout)
        self._works, self._sent = [], []
        return self._received


def _wait(work, what: str, timeout: float) -> None:
    try:
        ok = work.wait(timedelta(seconds=timeout))
    except RuntimeError as err:
        raise CommTimeoutError(
            f"hf_ring: {what} failed or did not finish within {timeout:g} s (HF_RING_TIMEOUT). "
            "Another rank probably raised an error or was given different shapes; "
            f"look at the other ranks' errors. Cause: {err}"
        ) from err
    if ok is False:
        raise CommTimeoutError(f"hf_ring: {what} did not finish within {timeout:g} s (HF_RING_TIMEOUT)")


class RingComm:
    """Ring neighbours in a process group: rank ``r`` sends to ``r+1`` and receives from ``r-1``."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout = comm_timeout()

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world_size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world_size

    def exchange(
        self,
        send: Sequence[Tensor],
        send_to: int,
        recv_like: Sequence[Tuple[torch.Size, torch.dtype]],
        recv_from: int,
        tag: int = 0,
        device: Optional[torch.device] = None,
    ) -> Pending:
        """Post ``send`` to group rank ``send_to`` and receives of the given shapes from ``recv_from``.

        Empty tensors are neither sent nor received: both sides know the shard
        sizes, so they skip them alike.
        """
        if device is None:
            device = send[0].device if send else torch.device("cpu")
        received = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in recv_like]
        ops, sent = [], [t.contiguous() for t in send]
        for i, t in enumerate(sent):
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t, group=self.group, group_peer=send_to, tag=tag + i))
        for i, t in enumerate(received):
            if t.numel():
                ops.append(dist.P2POp(dist.irecv, t, group=self.group, group_peer=recv_from, tag=tag + i))
        works = dist.batch_isend_irecv(ops) if ops else []
        what = f"exchange (send to rank {send_to}, receive from rank {recv_from})"
        return Pending(works, sent, received, what, self.timeout)

    def all_gather_ints(self, values: Sequence[int], what: str) -> List[List[int]]:
        """Every rank's copy of a few small integers, by rank (one tiny all-gather)."""
        t = torch.tensor(list(values), dtype=torch.long, device=self._device())
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        work = dist.all_gather(out, t, group=self.group, async_op=True)
        _wait(work, what, self.timeout)
        return [x.tolist() for x in out]

    def all_gather(self, tensor: Tensor, what: str) -> Tensor:
        """Every rank's ``tensor`` stacked by rank, ``(world_size, *tensor.shape)``."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        _wait(dist.all_gather(parts, tensor, group=self.group, async_op=True), what, self.timeout)
        return torch.stack(parts)

    def broadcast(self, tensor: Tensor, src: int, what: str) -> Tensor:
        """``tensor`` of group rank ``src`` on every rank (in place; other ranks pass a buffer of its shape)."""
        tensor = tensor.contiguous()
        work = dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group, async_op=True)
        _wait(work, what, self.timeout)
        return tensor

    def _device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
