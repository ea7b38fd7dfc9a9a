"""The KV cache of sequence-sharded generation: every rank keeps only its own rows.

Prompt rows stay on the rank the layout gave them. Each generated token goes
to the rank holding the fewest rows (ties: the lowest rank), so the shards
stay balanced however long generation runs. Every rank runs the same
placement on the same counts, so all agree on who stores what without a
message. The cache records the global position of each of its rows; the
attention reads them from there (it never sees this object).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .layout import check_layout, check_ulysses, local_positions, shard_sizes

Tensor = torch.Tensor


def place_tokens(counts: Sequence[int], num_new: int) -> List[int]:
    """Owner rank of each of ``num_new`` new tokens: always the rank with the fewest rows, ties to the lowest.

    The largest shard then never grows past ``ceil(total / world_size)``
    unless it already was larger.
    """
    counts = list(counts)
    owners = []
    for _ in range(num_new):
        rank = min(range(len(counts)), key=lambda r: (counts[r], r))
        owners.append(rank)
        counts[rank] += 1
    return owners


def cache_nbytes(cache: Cache) -> int:
    """Bytes allocated for the K and V of a transformers cache, all layers."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
            continue
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


GROWTH = 8
"""A full buffer grows by 1/GROWTH of its rows (at least MIN_GROWTH_ROWS)."""
MIN_GROWTH_ROWS = 64


class ShardedLayer(DynamicLayer):
    """One layer's K/V rows on this rank, ``(B, Hkv, local rows, D)``.

    Rows live in a buffer with spare room, so storing a decoded token is a
    write, not a copy of the whole cache (a concatenation per token per layer
    costs more than the attention itself at long lengths). The prefill is
    stored without spare room; the room added when the buffer fills is at
    most 1/8 of it.
    """

    is_croppable = False  # rows sit on several ranks: dropping the last tokens is not a local operation

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf: Optional[Tensor] = None
        self._vbuf: Optional[Tensor] = None
        self.length = 0

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> Tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        need = self.length + key_states.shape[-2]
        if self._kbuf is None or need > self._kbuf.shape[-2]:
            room = 0 if self.length == 0 else max(MIN_GROWTH_ROWS, need // GROWTH)
            self._kbuf, self._vbuf = (self._grown(buf, new, need + room)
                                      for buf, new in ((self._kbuf, key_states), (self._vbuf, value_states)))
        self._kbuf[:, :, self.length:need] = key_states
        self._vbuf[:, :, self.length:need] = value_states
        self.length = need
        self.keys, self.values = self._kbuf[:, :, :need], self._vbuf[:, :, :need]
        return self.keys, self.values

    def _grown(self, buf: Optional[Tensor], like: Tensor, rows: int) -> Tensor:
        b, h, _, d = like.shape
        out = like.new_empty((b, h, rows, d))
        if buf is not None and self.length:
            out[:, :, :self.length] = buf[:, :, :self.length]
        return out

    def _rebase(self) -> None:
        """After an operation replaced ``keys``/``values`` (batch selection), they become the buffers."""
        if self.is_initialized and self.keys is not None and self.keys.numel():
            self._kbuf, self._vbuf = self.keys.contiguous(), self.values.contiguous()
            self.keys, self.values = self._kbuf, self._vbuf

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._rebase()

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self._rebase()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._rebase()

    def nbytes(self) -> int:
        """Bytes allocated for this layer's K and V (spare room included)."""
        bufs = [t for t in (getattr(self, "_kbuf", None), getattr(self, "_vbuf", None)) if t is not None]
        return sum(t.numel() * t.element_size() for t in bufs)


class ShardedCache(Cache):
    """A KV cache split over the ranks of a sequence-parallel group.

    Made by :func:`hf_ring.generate`; pass the one it returns
    (``return_dict_in_generate=True``) back as ``past_key_values`` to continue
    the same sequences on the same ranks.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, layout: str = "zigzag", ulysses: int = 1):
        super().__init__(layer_class_to_replicate=ShardedLayer)
        self.rank, self.world_size, self.layout = rank, world_size, check_layout(layout)
        self.ulysses = check_ulysses(world_size, ulysses)  # the prefill's split (decoding shards by row alike)
        self.seq_len = 0
        self.counts = [0] * world_size
        self.index = torch.zeros(0, dtype=torch.long)
        self._keep: Optional[Tensor] = None  # rows of the running forward's inputs this rank stores

    def begin_prefill(self, seq_len: int) -> Tensor:
        """Start a forward over the first ``seq_len`` tokens, sharded by the layout; returns this rank's positions."""
        if self.seq_len:
            raise ValueError("a sharded prefill needs an empty cache")
        pos = local_positions(seq_len, self.rank, self.world_size, self.layout, self.ulysses)
        self.index = pos.clone()
        self.counts = shard_sizes(seq_len, self.world_size, self.layout, self.ulysses)
        self.seq_len = seq_len
        self._keep = None
        return pos

    def begin_step(self, num_new: int) -> Tensor:
        """Start a forward of ``num_new`` tokens that every rank runs; returns their global positions."""
        owners = place_tokens(self.counts, num_new)
        mine = [i for i, owner in enumerate(owners) if owner == self.rank]
        for owner in owners:
            self.counts[owner] += 1
        first = self.seq_len
        self.index = torch.cat([self.index, first + torch.tensor(mine, dtype=torch.long)])
        self._keep = torch.tensor(mine, dtype=torch.long)
        self.seq_len += num_new
        return torch.arange(first, self.seq_len)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs) -> Tuple[Tensor, Tensor]:
        """Store this rank's share of the new rows; return all the rows this rank holds."""
        keep = self._keep
        if keep is not None:
            keep = keep.to(key_states.device)
            key_states, value_states = key_states.index_select(2, keep), value_states.index_select(2, keep)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Global number of tokens seen (on every rank), not this rank's row count."""
        return self.seq_len

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> Tuple[int, int]:
        """As for a whole sequence: ``ring_dilated``'s mask function then hands the attention the 2-D padding
        mask untouched, and the attention masks from the global positions this cache records."""
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def local_length(self) -> int:
        """Rows this rank holds."""
        return int(self.index.numel())

    def nbytes(self) -> int:
        """Bytes allocated for K and V on this rank, all layers."""
        return cache_nbytes(self)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a sharded cache cannot be cropped (its rows sit on several ranks)")

    def same_layout(self, rank: int, world_size: int, layout: str, ulysses: int = 1) -> bool:
        return (self.rank, self.world_size, self.layout, self.ulysses) == (rank, world_size, layout, ulysses)
