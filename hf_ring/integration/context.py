"""Facts of one model forward, worked out once and read by every attention layer of that forward.

transformers hands every keyword argument of ``model(...)`` down to each
attention call, so a context object put into the forward's kwargs (under
``ring_context``) by :func:`hf_ring.shard_batch` or :func:`hf_ring.generate`
reaches every layer: what one forward's layers share travels on that object,
never in module-level state. What the process keeps is not per forward: the
active setup (:mod:`hf_ring.integration.groups`) and, in other modules, the
device meshes built for it and the registry of what is patched while it runs. What is the same for all layers
(the parsed configuration, the family check, the ranks' agreement, which is
one collective) is done by the first layer that runs and kept on the object;
later layers, and the recomputation of gradient checkpointing, reuse it. A
prefill's cache waits on it for what the recurrent layers' hooks exchange
(:meth:`ShardedForward.await_conv_state`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..engine.agreement import agree_table, facts, global_length, unsharded_error
from ..engine.comm import RingComm
from ..engine.documents import Documents, check_documents, chunk_ids, document_ids, starts_of_ids
from ..engine.layout import local_positions, shard_sizes
from ..engine.recurrence import SCAN_ROWS, Pieces
from ..engine.spec import AttentionSpec
from ..engine.ulysses import group_rows
from .groups import SequenceParallel

Tensor = torch.Tensor

CONTEXT_KEY = "ring_context"
"""The model keyword under which a forward's context travels to the attention layers."""


class ForwardContext:
    """What one forward carries to every attention layer under :data:`CONTEXT_KEY`.

    :class:`ShardedForward` is a forward over sequence shards, which the
    backend runs through the ring; a context that ``decodes`` (generation's
    ``DecodeStep``) attends new tokens over a cache of its own, with :meth:`attend`.
    """

    decodes = False

    def attend(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
               key_valid: Optional[Tensor], spec: AttentionSpec) -> Tensor:
        """This layer's attention ``(B, Hq, S, D)`` of new tokens over the context's cache (contexts that decode)."""
        raise NotImplementedError(f"{type(self).__name__} does not decode")


def _layer_key(q: Tensor, k: Tensor, opts: AttentionSpec) -> Tuple:
    """What may differ between the layers of one forward (head counts, windows...), to agree once per kind."""
    return (tuple(q.shape), k.shape[1], q.dtype, opts.causal, opts.window, opts.pattern, opts.scale)


@dataclass(eq=False)
class ShardedForward(ForwardContext):
    """A forward over sequence shards: a training step, an evaluation, or a prefill.

    ``seq_len`` is the global length; ``padded`` whether any row of the global
    batch has padded keys; ``contents`` a fingerprint of the global batch, so
    ranks of one group that were handed different batches are caught;
    ``documents`` the global start rows of the documents packed in each row
    (None: one sequence per row); ``placeholder``: this rank holds none of the
    rows and the model runs on one placeholder row, which the ring leaves out;
    ``ulysses``: ranks per head-parallel group, whose all-to-all runs over
    ``head_comm`` while the ring runs over ``ring_comm`` (see
    :func:`hf_ring.setup_sequence_parallel`);
    ``left_padding``: each batch row's padded rows before its first token,
    and ``positions`` the global ``(B, n)`` position ids (None: ``0..n-1``):
    where chunked attention (Llama 4) starts its chunks; ``positions_given``:
    the batch brought its own position ids (else :func:`hf_ring.shard_batch`
    counted them, and a model that counts its own is given what it would count);
    ``shift_given``: the batch brought its own ``shift_labels`` (per-token
    outputs then keep the last row, as one process's do); ``scan_rows``: the
    most rows one call of a recurrent layer's torch-path scan kernel runs
    (:data:`hf_ring.engine.recurrence.SCAN_ROWS`; None: each run whole);
    ``router_loss``: once a mixture of experts computed it, the whole sequence's router load-balancing loss
    (detached; :mod:`hf_ring.patches.router_loss`).
    """

    seq_len: int
    comm: Optional[RingComm]
    layout: str
    padded: bool = False
    contents: int = 0
    documents: Optional[Documents] = None
    placeholder: bool = False  # this rank holds no row and runs the model on one placeholder row
    ulysses: int = 1
    head_comm: Optional[RingComm] = None
    ring_comm: Optional[RingComm] = None
    left_padding: Optional[Tuple[int, ...]] = None
    positions: Optional[Tensor] = None
    positions_given: bool = False
    shift_given: bool = False
    scan_rows: Optional[int] = SCAN_ROWS
    router_loss: Optional[Tensor] = None
    _chunks: Dict[Tuple[int, bool], Optional[Documents]] = field(default_factory=dict, repr=False)
    _agreed: Dict[Tuple, bool] = field(default_factory=dict, repr=False)
    _group_masks: List[Tuple[Tensor, Tensor]] = field(default_factory=list, repr=False)
    _rows: Dict[str, Tensor] = field(default_factory=dict, repr=False)
    _pieces: Optional[Pieces] = field(default=None, repr=False)
    _mixers: int = field(default=0, repr=False)
    _open_calls: int = field(default=0, repr=False)
    _conv_states: Dict[int, Tuple[int, Any]] = field(default_factory=dict, repr=False)

    @classmethod
    def over(cls, sp: Optional[SequenceParallel], seq_len: int, layout: str, **facts: Any) -> "ShardedForward":
        """A forward over the shards of ``sp``'s group (``None``: one process holds the whole sequence).

        The one place the group's communicators and head-parallel size are
        taken from a setup; ``facts`` are this forward's own (``padded``,
        ``contents``, ``documents``, ``placeholder``).
        """
        if sp is None or sp.comm is None:
            return cls(seq_len, None, layout, **facts)
        return cls(seq_len, sp.comm, layout, ulysses=sp.ulysses_size, head_comm=sp.head_comm,
                   ring_comm=sp.ring_comm, **facts)

    def chunked(self, chunk: int, in_documents: bool) -> Optional[Documents]:
        """The forward's documents cut into chunks of ``chunk`` rows as transformers counts them: from each row's
        left padding, at the position ids inside each document when ``in_documents``; once per forward."""
        key = (chunk, in_documents)
        if key not in self._chunks:
            b = len(self.documents or self.left_padding or (0,))
            start = torch.tensor(self.left_padding or (0,) * b)
            positions = self.positions if in_documents and self.documents is not None else None
            ids = chunk_ids(chunk, start, positions, self.seq_len)
            docs = None if self.documents is None else document_ids(self.documents, 0, self.seq_len)
            self._chunks[key] = check_documents(starts_of_ids(ids.expand(b, -1), docs), b, self.seq_len)
        return self._chunks[key]

    def rows(self, device: torch.device) -> Tensor:
        """This rank's rows' global positions (none for a rank holding a placeholder row); worked out once per
        forward and device, since every layer asks."""
        found = self._rows.get(str(device))
        if found is None:
            if self.placeholder:
                found = torch.zeros(0, dtype=torch.long, device=device)
            else:
                rank = 0 if self.comm is None else self.comm.rank
                found = local_positions(self.seq_len, rank, self.world_size, self.layout, self.ulysses).to(device)
            self._rows[str(device)] = found
        return found

    @property
    def long(self) -> bool:
        """Longer than one call of a torch-path scan kernel runs (``scan_rows``): a hybrid's recurrent layers cut it
        into pieces, in one process too."""
        return self.scan_rows is not None and self.seq_len > self.scan_rows

    def pieces(self) -> Pieces:
        """The runs of the sequence every rank of the group holds, for the layers that carry a state along it;
        worked out once per forward."""
        if self._pieces is None:
            rank = 0 if self.comm is None else self.comm.rank
            self._pieces = Pieces.of(self.seq_len, self.world_size, self.layout, self.ulysses, rank)
        return self._pieces

    @property
    def world_size(self) -> int:
        return 1 if self.comm is None else self.comm.world_size

    def group_sizes(self) -> List[int]:
        """Rows each member of this rank's head-parallel group holds."""
        sizes = shard_sizes(self.seq_len, self.world_size, self.layout, self.ulysses)
        first = self.comm.rank // self.ulysses * self.ulysses
        return sizes[first:first + self.ulysses]

    def group_key_mask(self, key_mask: Tensor) -> Tensor:
        """The key padding mask of the head-parallel group's rows, from this rank's ``(B, S_local)``.

        Every layer passes the same mask, so the exchange runs once per forward
        (and once more in a checkpointed recomputation, which every rank makes).
        """
        for seen, rows in self._group_masks:
            if seen is key_mask:
                return rows
        rows = group_rows(self.head_comm, key_mask, self.group_sizes())
        self._group_masks.append((key_mask, rows))
        return rows

    def agree(self, q: Tensor, k: Tensor, opts: AttentionSpec, codes: Sequence[Tuple[str, int]] = ()) -> bool:
        """Check, once per kind of layer, that every rank runs the same attention over its shard of this batch.

        True when this call did the check (the first layer of its kind in this forward).
        """
        key = (_layer_key(q, k, opts), tuple(codes))
        if key in self._agreed:
            return False
        if self.world_size == 1:
            if q.shape[2] != self.seq_len:
                raise ValueError(f"the batch was sharded for {self.seq_len} tokens but this process holds {q.shape[2]}")
        else:
            table = agree_table(self.comm, facts(q, k, self.seq_len, opts, self.padded, True, self.contents, codes),
                                codes)
            global_length(table, self.seq_len, self.layout, self.ulysses)
        self._agreed[key] = True
        return True

    def fail(self, error: Exception) -> None:
        """This rank's checks of a layer's arguments failed: every rank raises that error, not only this one.

        The error rides in the agreement exchange the other ranks make for the
        forward's first layer (see :func:`hf_ring.engine.agreement.agree_table`). A layer
        after an agreement was made (the same arguments passed the checks on
        this rank before) has no exchange to join and raises here alone.
        """
        if self.world_size > 1 and not self._agreed:
            agree_table(self.comm, None, (), error)
        raise error

    def mixing(self) -> None:
        """Note that one sequence-mixing layer (an attention call, a recurrent layer) ran over the shards."""
        self._mixers += 1

    @property
    def mixers(self) -> int:
        """Sequence-mixing layers hf_ring has run over the shards in this forward (recomputations included)."""
        return self._mixers

    def enter_call(self) -> bool:
        """A model's call with this forward begins; True for the outermost one (see :meth:`leave_call`)."""
        self._open_calls += 1
        return self._open_calls == 1

    def leave_call(self) -> None:
        self._open_calls -= 1

    def await_conv_state(self, layer_idx: int, width: int, keep: Any) -> None:
        """A prefill's cache waits for the convolution state of layer ``layer_idx``: the last ``width`` rows of the
        convolution's input over the whole sequence, which the hook computing that convolution over the shards
        hands to ``keep`` from its own exchange (transformers gives the cache the state before the kernel runs)."""
        self._conv_states[layer_idx] = (width, keep)

    def awaited_conv_state(self, layer_idx: Optional[int]) -> Optional[Tuple[int, Any]]:
        """``(width, keep)`` of :meth:`await_conv_state` for layer ``layer_idx``, once; None when nothing waits."""
        return None if layer_idx is None else self._conv_states.pop(layer_idx, None)

    @property
    def collectives(self) -> int:
        """Agreement collectives this forward has issued (one per kind of layer on several ranks)."""
        return 0 if self.world_size == 1 else len(self._agreed)


def refuse_unsharded(comm: RingComm, q: Tensor, k: Tensor, opts: AttentionSpec) -> None:
    """A whole-sequence forward under sequence parallelism without sharded inputs: the same error on every rank.

    The ranks still take part in the agreement, so a group where only some
    ranks forgot to shard fails at once everywhere instead of timing out.
    """
    agree_table(comm, facts(q, k, None, opts, False, False))  # raises: this rank's row says unsharded
    raise unsharded_error([comm.rank])
