"""Every exchange between ranks that hf_ring makes, each with a bounded wait.

Point-to-point exchanges between ring neighbours (:class:`RingComm`) and the
collectives (:func:`all_reduce`, :func:`all_gather`, :func:`all_to_all`, :func:`broadcast`) are
all posted asynchronously and then finished by :func:`wait`, the one place a
rank waits for another. A rank whose peer died, raised, or was given other
shapes therefore raises :class:`CommTimeoutError` instead of blocking forever.

The bound is ``HF_RING_TIMEOUT`` seconds (default 600): a finite number > 0,
checked by :func:`comm_timeout` when a ``RingComm`` is made, when a collective
is issued, and by ``setup_sequence_parallel``.

How the bound is enforced depends on the backend that carries the tensor,
read from the group's backend configuration for the tensor's device (a group
made by ``init_process_group()`` with no backend is ``cpu:gloo`` on a CPU
build and ``cpu:gloo,cuda:nccl`` on a CUDA one, so the group's backend name
alone does not say):

* gloo: ``work.wait(timeout)`` blocks the calling thread with that deadline
  (gloo waits on its transport with the timeout given), so the wait itself is
  bounded. gloo never marks point-to-point work completed before ``wait()``,
  so it must not be polled.
* NCCL and any other backend: a host-side watchdog. ``work.wait()`` of NCCL
  only orders the current CUDA stream after the transfer and returns at once
  unless ``TORCH_NCCL_BLOCKING_WAIT`` is set, so a dead peer would surface
  much later, at the next host synchronisation. Instead the host polls
  ``work.is_completed()`` (a non-blocking query of the transfer's CUDA
  event) until it is true or the deadline passes, and only then calls
  ``work.wait()`` to order the stream and re-raise any error the backend
  recorded. This does not depend on ``TORCH_NCCL_BLOCKING_WAIT``. After a
  timeout the communicator may still hold the stuck transfer: the process
  should report the error and exit (or abort the group), not reuse it.
"""
from __future__ import annotations

import math
import os
import time
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .fingerprint import fingerprint

Tensor = torch.Tensor

TIMEOUT_VAR = "HF_RING_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
# The watchdog's sleeps start at _POLL_MIN_S and double up to _POLL_MAX_S: a transfer that has
# finished is noticed at most ~0.1 ms late (torch's own blocking wait polls every 1 ms).
_POLL_MIN_S = 10e-6
_POLL_MAX_S = 100e-6


def comm_timeout() -> float:
    """The wait bound in seconds from ``HF_RING_TIMEOUT`` (default 600); raises ValueError when it is unusable."""
    raw = os.environ.get(TIMEOUT_VAR, "")
    if not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_VAR}={raw!r} is not a number of seconds; set it to e.g. 600") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{TIMEOUT_VAR}={raw!r} must be a finite number of seconds > 0 (every wait needs a bound); "
            "set it to e.g. 600"
        )
    return value


class CommTimeoutError(RuntimeError):
    """A point-to-point exchange or collective did not finish in time, or failed."""


def _failure(what: str, timeout: float, cause) -> CommTimeoutError:
    return CommTimeoutError(
        f"hf_ring: {what} failed or did not finish within {timeout:g} s ({TIMEOUT_VAR}). "
        "Another rank probably died, raised an error or was given different shapes; "
        f"look at the other ranks' errors. Cause: {cause}"
    )


def carriers(group: Optional[dist.ProcessGroup]) -> Dict[str, str]:
    """Which backend carries tensors of each device type over ``group``: ``{"cpu": "gloo", "cuda": "nccl"}``."""
    return parse_carriers(dist.get_backend_config(_resolve(group)))


def parse_carriers(config: str) -> Dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` (torch's backend configuration) as ``{"cpu": "gloo", "cuda": "nccl"}``."""
    found = dict(part.strip().split(":", 1) for part in config.split(",") if ":" in part)
    if not found:  # a bare backend name: NCCL carries GPU tensors only, others every device type
        name = config.strip()
        found = {"cuda": name} if name.lower() == "nccl" else {"cpu": name, "cuda": name}
    return {device: name.lower() for device, name in found.items()}


def carrier(group: Optional[dist.ProcessGroup], device: torch.device) -> str:
    """The backend that carries a tensor on ``device`` over ``group`` (``"gloo"``, ``"nccl"``, ...)."""
    return carriers(group).get(torch.device(device).type, "")


def wait(work, what: str, timeout: float, backend: str) -> None:
    """Finish ``work`` within ``timeout`` seconds or raise :class:`CommTimeoutError` (see the module notes).

    ``backend`` is the one that carries the work's tensors (:func:`carrier`), not the group's name.
    """
    try:
        if backend == "gloo":
            ok = work.wait(timedelta(seconds=timeout))
        else:
            deadline = time.monotonic() + timeout
            pause = _POLL_MIN_S
            while not work.is_completed():
                if time.monotonic() >= deadline:
                    raise _failure(what, timeout, "timed out (host-side watchdog)")
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
            ok = work.wait()
    except CommTimeoutError:
        raise
    except RuntimeError as err:  # gloo's timeout, a closed connection, or an error NCCL recorded
        raise _failure(what, timeout, err) from err
    if ok is False:
        raise _failure(what, timeout, "the backend reported the wait as failed")


def _post(what: str, timeout: float, post):
    """Issue an asynchronous operation; an error raised while posting (e.g. a peer already gone) is reported alike."""
    try:
        return post()
    except RuntimeError as err:
        raise _failure(what, timeout, err) from err


_RELEASE_S = 1.0
"""The most seconds a finished collective waits for gloo to drop its references to the collective's tensors."""


class _Handed:
    """Tensors handed to a finished collective, with the references each has while the work object stands (see
    :meth:`released`): every one of them is held by the work, so once the work is gone each has fewer.

    gloo runs a collective on a worker thread of its process group, which keeps the work, and so its tensors, a
    moment after marking it done. A tensor Python has seen whose last reference goes on that thread needs the
    interpreter's lock to free its Python object; if the interpreter is exiting by then (a script that ends right
    after a backward whose last step was a collective), the thread is ended inside C++ and the process aborts with
    "terminate called without an active exception". So a collective over gloo returns only once gloo holds none of
    its tensors, and every tensor of hf_ring's is freed by Python, on its own thread.
    """

    def __init__(self, tensors: Sequence[Tensor]):
        self.tensors = list(tensors)
        self.counts = [t._use_count() for t in self.tensors]

    def released(self, backend: str) -> bool:
        """Once the caller has dropped its work object: return when the work is gone, so that the backend holds no
        reference to the tensors (at most :data:`_RELEASE_S`; the worker drops them right after the work completes,
        so this is microseconds). Other backends than gloo return at once. False: the bound passed first."""
        if backend != "gloo":
            return True
        deadline, pause = time.monotonic() + _RELEASE_S, _POLL_MIN_S
        while any(t._use_count() >= n for t, n in zip(self.tensors, self.counts)):
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)
        return True


def _collective(what: str, timeout: float, backend: str, tensors: Sequence[Tensor], post) -> None:
    """Post a collective over ``tensors`` and finish it: bounded (:func:`wait`), and with gloo's references to the
    tensors dropped (:class:`_Handed`)."""
    work = _post(what, timeout, post)
    wait(work, what, timeout, backend)
    handed = _Handed(tensors)
    del work  # ours; the worker's goes when it is done with it
    handed.released(backend)


def _resolve(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def through_host(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` moves tensors of ``device`` only through a host copy: gloo with anything but the CPU
    (its point-to-point transfers read a tensor's memory as host memory, and of its collectives only some take GPU
    tensors). Ranks that share one GPU, where NCCL refuses a second rank on the device, then communicate over gloo."""
    return backend == "gloo" and torch.device(device).type != "cpu"


def _on_host(tensor: Tensor, backend: str) -> Tensor:
    """``tensor`` itself, or a host copy of it where ``backend`` carries it only so (:func:`through_host`)."""
    return tensor.to("cpu", copy=True) if through_host(backend, tensor.device) else tensor


def _host_buffer(tensor: Tensor, backend: str) -> Tensor:
    """Where a transfer into ``tensor`` lands: ``tensor`` itself, or an empty host tensor like it where ``backend``
    carries it only through the host (its old contents are overwritten, so not copied)."""
    return torch.empty_like(tensor, device="cpu") if through_host(backend, tensor.device) else tensor


def all_reduce(tensor: Tensor, group: Optional[dist.ProcessGroup], what: str,
               op=dist.ReduceOp.SUM, timeout: Optional[float] = None) -> Tensor:
    """Reduce ``tensor`` in place over ``group`` (``None``: the world) with a bounded wait; returns it.

    ``what`` names the operation in the error; ``timeout`` defaults to :func:`comm_timeout`.
    """
    group, timeout = _resolve(group), comm_timeout() if timeout is None else timeout
    backend = carrier(group, tensor.device)
    moved = _on_host(tensor, backend)
    _collective(what, timeout, backend, [moved], lambda: dist.all_reduce(moved, op=op, group=group, async_op=True))
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_gather(tensor: Tensor, group: Optional[dist.ProcessGroup], what: str,
               timeout: Optional[float] = None) -> Tensor:
    """Every rank's ``tensor`` stacked by group rank, ``(group size, *tensor.shape)``, with a bounded wait."""
    group, timeout = _resolve(group), comm_timeout() if timeout is None else timeout
    backend = carrier(group, tensor.device)
    moved = _on_host(tensor.contiguous(), backend)
    parts = [torch.empty_like(moved) for _ in range(dist.get_world_size(group))]
    _collective(what, timeout, backend, [moved] + parts,
                lambda: dist.all_gather(parts, moved, group=group, async_op=True))
    return torch.stack(parts).to(tensor.device)


def broadcast(tensor: Tensor, src: int, group: Optional[dist.ProcessGroup], what: str,
              timeout: Optional[float] = None) -> Tensor:
    """``tensor`` of group rank ``src`` on every rank (other ranks pass a buffer of its shape), bounded wait."""
    group, timeout = _resolve(group), comm_timeout() if timeout is None else timeout
    tensor = tensor.contiguous()
    root = dist.get_global_rank(group, src)
    backend = carrier(group, tensor.device)
    moved = _on_host(tensor, backend)
    _collective(what, timeout, backend, [moved], lambda: dist.broadcast(moved, src=root, group=group, async_op=True))
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_to_all(output: Tensor, tensor: Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
               group: Optional[dist.ProcessGroup], what: str, timeout: Optional[float] = None) -> Tensor:
    """Piece ``i`` of ``tensor`` (dim 0 cut by ``input_splits``) to group rank ``i``; ``output`` receives, bounded wait.

    ``output`` is cut by ``output_splits``: piece ``i`` comes from group rank ``i``. Returns ``output``.
    """
    group, timeout = _resolve(group), comm_timeout() if timeout is None else timeout
    backend = carrier(group, output.device)
    moved, received = _on_host(tensor.contiguous(), backend), _host_buffer(output, backend)
    _collective(what, timeout, backend, [received, moved], lambda: dist.all_to_all_single(
        received, moved, list(output_splits), list(input_splits), group=group, async_op=True))
    if received is not output:
        output.copy_(received)
    return output


def device_for(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where small control tensors for ``group`` live: the CPU when a backend of the group carries CPU
    tensors (gloo, also beside NCCL), else the current GPU."""
    if "cpu" in carriers(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class Pending:
    """Sends and receives in flight; ``wait()`` returns the received tensors.

    ``delivered``: where the received tensors go once they have arrived, one per received tensor (host copies
    received for tensors of another device, :func:`through_host`); None: they are the result as they are.
    """

    def __init__(self, works, sent: List[Tensor], received: List[Tensor], what: str, timeout: float,
                 backend: str, collective: bool = False, delivered: Optional[List[Tensor]] = None):
        self._works, self._received, self._what = works, received, what
        self._timeout, self._backend = timeout, backend
        self._sent = sent  # keep send buffers alive until their transfer completes
        self._collective = collective  # a collective's worker thread lets go of its tensors before ours go (_Handed)
        self._delivered = delivered

    def wait(self) -> List[Tensor]:
        for i in range(len(self._works)):  # no loop name: one left holding the last work would keep it standing
            wait(self._works[i], self._what, self._timeout, self._backend)
        handed = _Handed(self._sent + self._received) if self._collective else None
        self._works = []
        if handed is not None:
            handed.released(self._backend)
        self._sent = []
        if self._delivered is not None:
            for target, arrived in zip(self._delivered, self._received):
                target.copy_(arrived)
            self._received = self._delivered
        return self._received


CONTROL_INTS = 640
"""Integers in every small control exchange (agreements, shared errors, the exit), whatever it carries."""

_WHAT_BYTES = 96
"""Bytes of an exchange's own name each control row carries, so a mismatch can say where every rank was."""

LEAVING = "the exit of hf_ring.shutdown"
"""The name of the control exchange a rank makes as it ends (see :func:`leave`)."""

_REASON_BYTES = 400


class RankLeftError(CommTimeoutError):
    """Another rank ended while this one waited for it in an exchange (see :func:`leave`)."""


def text_ints(text: str, size: int) -> List[int]:
    """``text`` as ``1 + size`` integers: its UTF-8 length (cut at ``size`` bytes), then the bytes, zero-padded."""
    raw = text.encode()[:size]
    return [len(raw)] + list(raw) + [0] * (size - len(raw))


def ints_text(ints: Sequence[int]) -> str:
    """The text :func:`text_ints` wrote."""
    return bytes(ints[1:1 + ints[0]]).decode(errors="replace")


def _code(what: str) -> int:
    return fingerprint(what)


_LEAVING_CODE = _code(LEAVING)

_HEAD = 2 + _WHAT_BYTES
"""Integers before a control row's values: the exchange's code, then its name as :func:`text_ints`."""


def control_row(what: str, values: Sequence[int]) -> List[int]:
    """One rank's row of a control exchange: the exchange's code and name, then ``values``, padded to one size."""
    values = [int(v) for v in values]
    if _HEAD + len(values) > CONTROL_INTS:
        raise ValueError(f"{what}: {len(values)} integers do not fit one exchange of {CONTROL_INTS - _HEAD}")
    return [_code(what)] + text_ints(what, _WHAT_BYTES) + values + [0] * (CONTROL_INTS - _HEAD - len(values))


def _left(rows: Sequence[Sequence[int]], ranks: Sequence[int], what: str, me: int) -> RankLeftError:
    """The error of a rank that waited in ``what`` while the ranks whose rows are :data:`LEAVING` ended."""
    gone = [(ranks[r], row) for r, row in enumerate(rows) if row[0] == _LEAVING_CODE]
    why = []
    for rank, row in gone:
        reason = ints_text(row[_HEAD:])
        why.append(f"rank {rank} ended " + (f"after an error it did not catch ({reason}; its own output has the "
                                            "traceback)" if reason else "cleanly (its script finished)"))
    return RankLeftError(
        f"{'; '.join(why)}, while rank {me} waited for it in {what}. Every rank must make the same hf_ring calls: "
        "a rank whose script ends early (it skipped a step, or a condition differed between ranks) leaves the others "
        "waiting"
    )


def leave(groups: Sequence[dist.ProcessGroup], reason: str, timeout: float) -> List[str]:
    """Tell every rank of each group that this one is ending, and wait for them to end too.

    The exit is a control exchange like the agreements (:meth:`RingComm.all_gather_ints`),
    posted on every group at once: a rank waiting in one of those learns at
    once that this rank left (:class:`RankLeftError`), and this rank learns
    where that rank was instead of waiting for it. Returns a note per rank
    found elsewhere (empty when all ended together); raises
    :class:`CommTimeoutError` when a group does not answer within ``timeout``.
    ``reason``: the error this rank is ending on ("" for a clean end).
    """
    row = control_row(LEAVING, text_ints(reason, _REASON_BYTES))
    posted, seen = [], set()
    for group in groups:
        if id(group) in seen or dist.get_rank(group) < 0:
            continue
        seen.add(id(group))
        t = torch.tensor(row, dtype=torch.long, device=device_for(group))
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        work = _post(LEAVING, timeout, lambda: dist.all_gather(parts, t, group=group, async_op=True))
        posted.append((group, work, parts, t))
    deadline, pause = time.monotonic() + timeout, 1e-3
    while posted:
        for item in [p for p in posted if p[1].is_completed()]:
            group, work, parts, t = item
            posted.remove(item)
            work.wait()
            handed = _Handed([t] + parts)
            del work, item  # the process is ending: gloo's worker must let go of the exchange's tensors first
            handed.released(carrier(group, t.device))
            elsewhere = [(dist.get_global_rank(group, r), ints_text(p.tolist()[1:])) for r, p in enumerate(parts)
                         if int(p[0]) != _LEAVING_CODE]
            if elsewhere:  # those ranks raise RankLeftError now; the other groups' exits would wait for nothing
                return [f"rank {rank} was still in {where}" for rank, where in elsewhere]
        if posted and time.monotonic() >= deadline:
            raise _failure(LEAVING, timeout, "some ranks did not reach their exit (still working, or hung)")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return []


FUSE_BYTES = 1 << 20
"""A message's tensors up to this many bytes in all travel as one transfer where gloo carries them: a short
sequence's step is measurably faster so (``python -m bench fixed``), and copying a MiB costs a fraction of a
transfer's latency."""


def fused(sizes: Sequence[Tuple[int, torch.dtype]], backend: str) -> List[int]:
    """Which of a message's tensors (``(numel, dtype)`` each) travel together in one flat buffer.

    gloo sends each tensor of a batch as its own transfer, with its own latency, which small messages (a
    short sequence's K and V, their gradients) pay in full; copying them into one buffer costs far less.
    NCCL runs a batch's transfers as one group already, so nothing is fused there, nor a large message
    (its copy would cost what the transfer does). Pure, so the sender (from its tensors) and the receiver
    (from the shapes it expects) decide alike: the non-empty tensors of the first one's dtype, when more
    than one and small in all.
    """
    if backend != "gloo":
        return []
    present = [(i, n, dtype) for i, (n, dtype) in enumerate(sizes) if n]
    if not present:
        return []
    first = present[0][2]
    chosen = [(i, n) for i, n, dtype in present if dtype == first]
    if len(chosen) < 2 or sum(n for _, n in chosen) * first.itemsize > FUSE_BYTES:
        return []
    return [i for i, _ in chosen]


class RingComm:
    """A process group's ring: point-to-point exchanges with any peer, and small bounded collectives."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = _resolve(group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.carriers = carriers(self.group)
        self.timeout = comm_timeout()

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
        backend = self.carriers.get(device.type, "")
        delivered = None
        if through_host(backend, device):  # received on the host, delivered to the device by Pending.wait
            delivered = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in recv_like]
            send, device = [_on_host(t, backend) for t in send], torch.device("cpu")
        sent = [t.contiguous() for t in send]
        together = fused([(t.numel(), t.dtype) for t in sent], backend)
        outgoing = list(enumerate(sent))
        if together:  # one transfer under the first one's tag; the receiver expects it so (see fused)
            outgoing = [(together[0], torch.cat([sent[i].reshape(-1) for i in together]))] + [
                (i, t) for i, t in outgoing if i not in together]
        received = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in recv_like]
        incoming = list(enumerate(received))
        together = fused([(math.prod(shape), dtype) for shape, dtype in recv_like], backend)
        if together:
            flat = torch.empty(sum(received[i].numel() for i in together), dtype=received[together[0]].dtype,
                               device=device)
            offset = 0
            for i in together:
                n = received[i].numel()
                received[i] = flat[offset:offset + n].view(received[i].shape)
                offset += n
            incoming = [(together[0], flat)] + [(i, t) for i, t in incoming if i not in together]
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=send_to, tag=tag + i)
               for i, t in outgoing if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=recv_from, tag=tag + i)
                for i, t in incoming if t.numel()]
        what = f"exchange (send to rank {send_to}, receive from rank {recv_from})"
        works = _post(what, self.timeout, lambda: dist.batch_isend_irecv(ops)) if ops else []
        return Pending(works, [t for _, t in outgoing], received, what, self.timeout, backend, delivered=delivered)

    def all_gather_ints(self, values: Sequence[int], what: str) -> List[List[int]]:
        """Every rank's copy of a few small integers, by rank (one small all-gather).

        Every such exchange has the same size and starts with the code and
        name of ``what``, so ranks that reached different exchanges (one rank
        skipped a step the others made) get a clear error on all of them
        instead of a size mismatch inside the backend, and a rank that ended
        (:func:`leave`) is known to the others at once.
        """
        t = torch.tensor(control_row(what, values), dtype=torch.long, device=device_for(self.group))
        table = [r.tolist() for r in self.all_gather(t, what)]
        codes = {r[0] for r in table}
        if len(codes) > 1:
            ranks = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
            if _LEAVING_CODE in codes:
                raise _left(table, ranks, what, ranks[self.rank])
            where = "; ".join(f"rank {rank}: {ints_text(r[1:])}" for rank, r in zip(ranks, table))
            raise ValueError(
                f"the ranks reached different exchanges ({where}): a rank skipped or added a step the others made, "
                "e.g. one rank passed its batch through hf_ring.shard_batch and another did not, or ran another model"
            )
        return [r[_HEAD:_HEAD + len(values)] for r in table]

    def all_gather(self, tensor: Tensor, what: str) -> Tensor:
        """Every rank's ``tensor`` stacked by rank, ``(world_size, *tensor.shape)``."""
        return all_gather(tensor, self.group, what, timeout=self.timeout)

    def all_reduce(self, tensor: Tensor, what: str) -> Tensor:
        """``tensor`` summed over the group, in place; returns it."""
        return all_reduce(tensor, self.group, what, timeout=self.timeout)

    def all_to_all(self, output: Tensor, tensor: Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                   what: str) -> Tensor:
        """See :func:`all_to_all`: piece ``i`` of ``tensor`` to rank ``i``, piece ``i`` of ``output`` from it."""
        return all_to_all(output, tensor, output_splits, input_splits, self.group, what, timeout=self.timeout)

    def post_all_to_all(self, output: Tensor, tensor: Tensor, output_splits: Sequence[int],
                        input_splits: Sequence[int], what: str) -> Pending:
        """:meth:`all_to_all` left in flight: ``wait()`` on the result returns ``[output]``."""
        backend = carrier(self.group, output.device)
        moved, received = _on_host(tensor.contiguous(), backend), _host_buffer(output, backend)
        work = _post(what, self.timeout, lambda: dist.all_to_all_single(
            received, moved, list(output_splits), list(input_splits), group=self.group, async_op=True))
        return Pending([work], [moved], [received], what, self.timeout, backend, collective=True,
                       delivered=None if received is output else [output])

    def broadcast(self, tensor: Tensor, src: int, what: str) -> Tensor:
        """``tensor`` of group rank ``src`` on every rank (in place; other ranks pass a buffer of its shape)."""
        return broadcast(tensor, src, self.group, what, timeout=self.timeout)


def resolve_group(group) -> Optional[RingComm]:
    """The ring of ``group`` (the default group when None), or None for one process without torch.distributed."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
    elif not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group was given but torch.distributed is not initialised; call init_process_group first")
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the given group; "
            "call ring_attention only on the group's ranks"
        )
    return RingComm(group)
