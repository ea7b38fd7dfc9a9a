"""The KV cache of sequence-sharded generation: every rank keeps only its own K/V rows, and only rows still visible.

(A hybrid's recurrent layers keep transformers' own states instead, the same on every rank: see
:class:`ShardedCache`.)

Prompt rows stay on the rank the layout gave them. Each generated token goes
to the rank holding the fewest rows (ties: the lowest rank), so the shards
stay balanced however long generation runs. Every rank runs the same
placement on the same counts, so all agree on who stores what without a
message. The cache records the global position of each of its rows; the
attention reads them from there.

A layer whose queries stop reading old rows (a sliding window, a dilated
pattern) drops them: each layer follows a :class:`~hf_ring.generation.retention.Retention`, and
the layers of one rule share a *row set* (one per rule, or one per K/V head
of a dilated rule whose heads read different rows) that holds the positions,
the placement counts and the eviction plan, worked out once per step for all
its layers. A row leaves the cache when its last reader (the last query that
may attend it) is behind the next position. After the prefill the rows still
visible are spread evenly over the ranks (one exchange per layer and row
set), so each rank holds at most its share of a window, whatever the prompt
length and layout. An evicted row's slot is only marked empty; the slots
are compacted, in order, once per growth step of evictions, so a step
rarely copies a row and the buffer stays within its share plus that step.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

from ..engine.comm import RingComm
from ..engine.layout import check_layout, check_ulysses, local_positions
from ..integration.context import ShardedForward
from .retention import KEEP_ALL, Retention
from .slots import SlotTable, growth_rows

Tensor = torch.Tensor

def cache_nbytes(cache: Cache) -> int:
    """Bytes allocated for the K and V of a transformers cache, all layers (a recurrent layer's states too)."""
    total = 0
    for layer in cache.layers:
        states = []
        if isinstance(layer, LinearAttentionLayer):  # a recurrent layer's states, the same on every rank
            states += list(layer.conv_states.values()) + list(layer.recurrent_states.values())
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
        else:
            states += [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for t in states:
            if t is not None:
                total += t.numel() * t.element_size()
    return total


class ShardedLayer(DynamicLayer):
    """One layer's K/V rows on this rank: per row set, ``(B, H, slots, D)`` (H the set's K/V heads).

    Rows live in buffers with spare room, so storing a decoded token is a
    write, not a copy of the whole cache (a concatenation per token per layer
    costs more than the attention itself at long lengths). The prefill is
    stored without spare room; the room added when a buffer fills is at most
    1/8 of it, and a buffer that evictions left mostly empty shrinks back.
    """

    is_croppable = False  # rows sit on several ranks: dropping the last tokens is not a local operation

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbufs: List[Optional[Tensor]] = []
        self._vbufs: List[Optional[Tensor]] = []
        self._lengths: List[int] = []
        self._versions: List[int] = []

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> Tuple[Tensor, Tensor]:
        """Append all of ``key_states`` to a layer of one row set (the cache itself stores through :meth:`store`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._ensure(0)
        self._write(0, self._lengths[0], key_states, value_states)
        return self.keys, self.values

    def _ensure(self, sets: int) -> None:
        while len(self._kbufs) <= sets:
            self._kbufs.append(None)
            self._vbufs.append(None)
            self._lengths.append(0)
            self._versions.append(0)

    def store(self, row_set: int, key_states: Tensor, value_states: Tensor, plan: SlotTable,
              comm: Optional[RingComm]) -> None:
        """Follow ``plan`` (this forward's compaction, buffer size and placement) for row set ``row_set`` of this layer."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._ensure(row_set)
        if self._versions[row_set] != plan.version - 1:
            raise RuntimeError(f"a sharded cache layer was stored {plan.version - 1 - self._versions[row_set]} "
                               "forwards late; every layer must store its rows at every forward")
        self._versions[row_set] = plan.version
        kbuf, vbuf = self._kbufs[row_set], self._vbufs[row_set]
        if plan.compact is not None and kbuf is not None:
            keep = plan.compact.to(kbuf.device)
            kbuf[:, :, :keep.numel()] = kbuf.index_select(2, keep)
            vbuf[:, :, :keep.numel()] = vbuf.index_select(2, keep)
        if plan.gather is not None:
            key_states, value_states = _rebalanced(key_states, value_states, plan.gather, comm)
        elif plan.take is not None:
            take = plan.take.to(key_states.device)
            key_states, value_states = key_states.index_select(2, take), value_states.index_select(2, take)
        if kbuf is None or kbuf.shape[-2] != plan.capacity:
            self._kbufs[row_set], self._vbufs[row_set] = (
                self._resized(buf, new, plan.kept, plan.capacity)
                for buf, new in ((kbuf, key_states), (vbuf, value_states)))
        self._put(row_set, plan.kept, key_states, value_states)

    def _write(self, row_set: int, kept: int, key_states: Tensor, value_states: Tensor) -> None:
        """Append after ``kept`` rows, growing the buffer by its growth step when full."""
        kbuf = self._kbufs[row_set]
        need = kept + key_states.shape[-2]
        if kbuf is None or need > kbuf.shape[-2]:
            rows = need if kbuf is None else need + growth_rows(need)  # the first store gets no spare room
            self._kbufs[row_set], self._vbufs[row_set] = (
                self._resized(buf, new, kept, rows)
                for buf, new in ((kbuf, key_states), (self._vbufs[row_set], value_states)))
        self._put(row_set, kept, key_states, value_states)

    def _put(self, row_set: int, kept: int, key_states: Tensor, value_states: Tensor) -> None:
        kbuf, vbuf = self._kbufs[row_set], self._vbufs[row_set]
        need = kept + key_states.shape[-2]
        kbuf[:, :, kept:need] = key_states
        vbuf[:, :, kept:need] = value_states
        self._lengths[row_set] = need
        if row_set == 0:
            self.keys, self.values = kbuf[:, :, :need], vbuf[:, :, :need]

    @staticmethod
    def _resized(buf: Optional[Tensor], like: Tensor, kept: int, rows: int) -> Tensor:
        b, h, _, d = like.shape
        out = like.new_empty((b, h, rows, d))
        if buf is not None and kept:
            out[:, :, :kept] = buf[:, :, :kept]
        return out

    def rows(self, row_set: int = 0) -> Tuple[Tensor, Tensor]:
        """The live K and V of one row set, ``(B, H, slots, D)`` views."""
        n = self._lengths[row_set]
        return self._kbufs[row_set][:, :, :n], self._vbufs[row_set][:, :, :n]

    def _each_buffer(self, fn) -> None:
        """After an operation on the batch (selection, repetition), ``fn`` of every set's live rows become the buffers."""
        if not self.is_initialized:
            return
        for s in range(len(self._kbufs)):
            if self._kbufs[s] is not None:
                k, v = self.rows(s)
                self._kbufs[s], self._vbufs[s] = fn(k).contiguous(), fn(v).contiguous()
        if self._kbufs and self._kbufs[0] is not None:
            self.keys, self.values = self.rows(0)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each_buffer(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._each_buffer(lambda t: t[indices, ...])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._each_buffer(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def nbytes(self) -> int:
        """Bytes allocated for this layer's K and V (spare room included)."""
        bufs = [t for t in getattr(self, "_kbufs", []) + getattr(self, "_vbufs", []) if t is not None]
        return sum(t.numel() * t.element_size() for t in bufs)


def _rebalanced(key_states: Tensor, value_states: Tensor, gather: Tuple[Tensor, Tensor, Tensor, int],
                comm: Optional[RingComm]) -> Tuple[Tensor, Tensor]:
    """The rows this rank keeps after the prefill's rebalancing: every rank sends its visible rows, each takes its own."""
    if comm is None:
        raise RuntimeError("a sharded cache that evicts rows on several ranks needs the group's comm "
                           "(hf_ring.generate attaches it)")
    send, source, at_source, most = gather
    d = key_states.shape[-1]
    if most == 0:  # no rank has a visible row (every rank knows it): nothing to exchange
        empty = key_states[:, :, :0]
        return empty, value_states[:, :, :0]
    rows = torch.cat([key_states, value_states], dim=-1).index_select(2, send.to(key_states.device))
    padded = rows.new_zeros(*rows.shape[:2], most, rows.shape[-1])
    padded[:, :, :rows.shape[2]] = rows
    parts = comm.all_gather(padded, "the cache rows dealt out after the prefill")  # (P, B, H, most, 2D)
    mine = parts[source.to(parts.device), :, :, at_source.to(parts.device)]  # (rows, B, H, 2D)
    mine = mine.permute(1, 2, 0, 3)
    return mine[..., :d], mine[..., d:]


class ShardedRecurrentLayer(LinearAttentionLayer, ShardedLayer):
    """A recurrent layer's convolution and scan states (the same on every rank) and, where the layer attends as well
    (Falcon-H1's attention beside its Mamba mixer, in one decoder layer), its sharded K/V rows: transformers' own
    layer for such a layer is ``LinearAttentionAndFullAttentionLayer``."""

    is_croppable = False  # rows sit on several ranks (and a scan's state cannot be cropped)
    is_compileable = False  # as a sharded layer: generate must not build the whole prompt's masks for a static cache

    def __init__(self) -> None:
        ShardedLayer.__init__(self)
        LinearAttentionLayer.__init__(self)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # the K/V side is initialised with (keys, values), the recurrent side with its states by keyword
        if args:
            ShardedLayer.lazy_initialization(self, *args, **kwargs)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        ShardedLayer.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        ShardedLayer.reorder_cache(self, beam_idx)


_GLOBAL_SIZES = ("get_seq_length", "get_mask_sizes")
"""What a :class:`ShardedCache` answers for the whole sequence, which a model may not rebind on the instance
(RecurrentGemma in transformers 5.17 binds both to read its first attention layer's rows: this rank's)."""


class ShardedCache(Cache):
    """A KV cache split over the ranks of a sequence-parallel group, holding the rows a later query can read.

    Made by :func:`hf_ring.generate`; pass the one it returns
    (``return_dict_in_generate=True``) back as ``past_key_values`` to continue
    the same sequences on the same ranks. ``evict=False`` keeps every row,
    including those no later query reads (for comparison; the output is the same).

    A hybrid's recurrent layers (:meth:`set_recurrent`) keep transformers' own
    states instead (a convolution's last rows, a scan's state), the same on every
    rank: the prefill's hooks leave every rank the state of the whole prompt, and
    every decode step then runs the same token on every rank.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, layout: str = "zigzag", evict: bool = True,
                 ulysses: int = 1):
        Cache.__init__(self, layer_class_to_replicate=ShardedLayer)  # not a mixed-in cache class's (sharded_cache)
        self.rank, self.world_size, self.layout = rank, world_size, check_layout(layout)
        self.evict = bool(evict)
        self.ulysses = check_ulysses(world_size, ulysses)  # the prefill's split (decoding shards by row alike)
        self.seq_len = 0
        self.rules: Optional[Tuple[Retention, ...]] = None  # per layer; None: every layer keeps every row
        self.comm: Optional[RingComm] = None  # for the exchange after the prefill; attached by generate
        self._sets: Dict[Retention, List[SlotTable]] = {}
        self._prefill = False
        self._prefill_forward: Optional[ShardedForward] = None  # a sharded prefill's forward, while it runs
        self.last_updated = 0  # the layer whose rows the latest update stored: the one that attends next
        self._reset_sets()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _GLOBAL_SIZES:
            return  # the cache's own answer is the whole sequence's, whatever layer a model would ask instead
        super().__setattr__(name, value)

    def _reset_sets(self) -> None:
        rules = set(self.rules or ()) | {KEEP_ALL}
        self._sets = {rule: [SlotTable(rule, s, self.rank, self.world_size) for s in range(rule.sets)] for rule in rules}

    def set_rules(self, rules: Sequence[Retention]) -> None:
        """Which rows each layer keeps (see :func:`hf_ring.generation.retention.layer_rules`); a cache holding rows keeps its own."""
        rules = tuple(rules)
        current = self.rules or tuple(KEEP_ALL for _ in rules)
        if self.seq_len == 0:
            self.rules = rules
            self._reset_sets()
        elif current != rules:
            raise ValueError(
                "past_key_values kept its rows for another model's attention (the layers' sliding windows, dilation "
                "pattern or head counts differ, or it was made with another evict setting); continue a cache only "
                "with the model and settings that filled it"
            )

    def set_recurrent(self, layers: Sequence[int]) -> None:
        """Make layers ``layers`` (a hybrid's recurrent ones) keep transformers' conv and recurrent states, the same on
        every rank, instead of sharded K/V rows."""
        layers = set(layers)
        if not layers:
            return
        kinds = [isinstance(layer, LinearAttentionLayer) for layer in self.layers]
        if self.seq_len and kinds[:max(layers) + 1] != [i in layers for i in range(len(kinds))][:max(layers) + 1]:
            raise ValueError("past_key_values held another model's layers (recurrent and attention layers at other "
                             "places); continue a cache only with the model that filled it")
        while len(self.layers) <= max(layers):
            self.layers.append(ShardedRecurrentLayer() if len(self.layers) in layers else ShardedLayer())

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, *args, **kwargs) -> Tensor:
        """Keep a recurrent layer's convolution state. In a sharded prefill each rank holds some of the prompt's rows:
        the state kept is the whole prompt's last rows, which the hook convolving them over the shards hands over
        from its own exchange (:meth:`hf_ring.integration.context.ShardedForward.await_conv_state`); the rows given
        are returned as they are, for the layer to convolve."""
        if self._prefill_forward is None or self.world_size == 1:
            return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)
        width = kwargs.get("conv_kernel_size") or conv_states.shape[-1]
        update = super().update_conv_state
        self._prefill_forward.await_conv_state(layer_idx, width, lambda tail: update(tail, layer_idx, *args, **kwargs))
        return conv_states

    def rule_of(self, layer_idx: int) -> Retention:
        """The rule of layer ``layer_idx``: which of its rows are kept."""
        if self.rules is None or layer_idx >= len(self.rules):
            return KEEP_ALL
        return self.rules[layer_idx]

    def row_sets(self, layer_idx: int) -> List[SlotTable]:
        """The row sets of layer ``layer_idx`` (one, or one per K/V head)."""
        return self._sets[self.rule_of(layer_idx)]

    def begin_prefill(self, seq_len: int, forward: Optional[ShardedForward] = None) -> Tensor:
        """Start a forward (``forward``: the sharded prefill's) over the first ``seq_len`` tokens, sharded by the
        layout; returns this rank's positions."""
        if self.seq_len:
            raise ValueError("a sharded prefill needs an empty cache")
        pos = local_positions(seq_len, self.rank, self.world_size, self.layout, self.ulysses)
        for sets in self._sets.values():
            for row_set in sets:
                row_set.begin_prefill(seq_len, pos, self.layout, rebalance=self.world_size > 1, ulysses=self.ulysses)
        self.seq_len = seq_len
        self._prefill, self._prefill_forward = True, forward
        return pos

    def begin_step(self, num_new: int) -> Tensor:
        """Start a forward of ``num_new`` tokens that every rank runs; returns their global positions."""
        first = self.seq_len
        for sets in self._sets.values():
            for row_set in sets:
                row_set.begin_step(first, num_new)
        self.seq_len += num_new
        self._prefill, self._prefill_forward = False, None
        return torch.arange(first, self.seq_len)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs) -> Tuple[Tensor, Tensor]:
        """Store this rank's share of the new rows.

        Returns what the attention reads: in the prefill the shard's own rows
        (the ring needs all of them, whatever the cache keeps), then the rows
        this rank holds (of the first row set, for a layer with one per K/V head).
        """
        while len(self.layers) <= layer_idx:
            self.layers.append(ShardedLayer())
        self.last_updated = layer_idx
        layer = self.layers[layer_idx]
        sets = self.row_sets(layer_idx)
        for s, plan in enumerate(sets):
            heads = slice(None) if len(sets) == 1 else slice(s, s + 1)
            layer.store(s, key_states[:, heads], value_states[:, heads], plan, self.comm)
        if self._prefill:
            return key_states, value_states
        return layer.keys, layer.values

    def layer_rows(self, layer_idx: int) -> List[Tuple[Tensor, Tensor, Tensor]]:
        """Per row set of a layer, this rank's ``(positions, keys, values)`` by slot (:data:`hf_ring.generation.slots.EMPTY_SLOT`: evicted)."""
        layer = self.layers[layer_idx]
        return [(plan.positions, *layer.rows(s)) for s, plan in enumerate(self.row_sets(layer_idx))]

    @property
    def index(self) -> Tensor:
        """Global positions of the rows this rank holds for the first layer (its first row set)."""
        return self.row_sets(0)[0].held()

    @property
    def counts(self) -> List[int]:
        """Rows each rank holds for the first layer (its first row set)."""
        return self.row_sets(0)[0].counts

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Global number of tokens seen (on every rank), not this rank's row count."""
        return self.seq_len

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> Tuple[int, int]:
        """As for a whole sequence: ``ring_dilated``'s mask function then hands the attention the 2-D padding
        mask untouched, and the attention masks from the global positions this cache records."""
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def local_length(self, layer_idx: int = 0) -> int:
        """Live rows this rank holds for layer ``layer_idx`` (the most of any of its K/V heads)."""
        return max(int(plan.positions.numel()) - plan.dead for plan in self.row_sets(layer_idx))

    def nbytes(self) -> int:
        """Bytes allocated for K and V on this rank, all layers."""
        return cache_nbytes(self)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a sharded cache cannot be cropped (its rows sit on several ranks)")

    def same_layout(self, rank: int, world_size: int, layout: str, ulysses: int = 1) -> bool:
        return (self.rank, self.world_size, self.layout, self.ulysses) == (rank, world_size, layout, ulysses)


class _Padded(list):
    """A list that answers None past its end: a model's own cache indexes its per-layer lists by layer, while a
    sharded cache holds layers before the model's own cache would have filled them."""

    def __getitem__(self, index):
        if isinstance(index, int) and index >= len(self):
            return None
        return super().__getitem__(index)


@functools.lru_cache(maxsize=None)
def sharded_cache_class(own: Optional[type] = None) -> type:
    """:class:`ShardedCache`, or for a model whose forward insists on a cache class of its own (``own``: MiniMax's
    ``MiniMaxCache``, where its lightning attention keeps its state) a :class:`ShardedCache` that is also an ``own``:
    the K/V rows sharded as always, ``own``'s methods for the rest, its attributes as a new ``own`` has them (its
    lists answering None for a layer it holds nothing of yet)."""
    if own is None or issubclass(ShardedCache, own):
        return ShardedCache

    def __init__(self, *args, **kwargs):
        ShardedCache.__init__(self, *args, **kwargs)
        for name, value in vars(own()).items():
            if name not in vars(self):
                setattr(self, name, _Padded(value) if type(value) is list else value)

    return type(f"Sharded{own.__name__}", (ShardedCache, own), {"__init__": __init__, "__module__": __name__})
