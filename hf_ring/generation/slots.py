"""Which rows a rank's share of a sharded KV cache holds: where new tokens go, which rows expire, when slots compact.

Pure bookkeeping over positions, the same on every rank (every rank runs it on
the same counts), so the ranks agree on who stores what without a message;
:mod:`hf_ring.generation.cache` keeps the K/V tensors these rows index.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..engine.layout import local_positions, shard_sizes
from .retention import Retention

Tensor = torch.Tensor

NO_EXPIRY = 1 << 62
"""The first expiry of a row set none of whose rows ever expires."""
EMPTY_SLOT = -(1 << 40)
"""The position recorded for an evicted row's slot: outside every window and segment, so no query attends it."""


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


GROWTH = 8
"""A full buffer grows by 1/GROWTH of its rows (at least MIN_GROWTH_ROWS)."""
MIN_GROWTH_ROWS = 64


def growth_rows(rows: int) -> int:
    """The spare room a buffer of ``rows`` live rows gets when it grows (or shrinks)."""
    return max(MIN_GROWTH_ROWS, rows // GROWTH)


def _ranks_of(seq_len: int, world_size: int, layout: str, ulysses: int = 1) -> Tensor:
    """The layout's owner rank of every position of a ``seq_len``-long prompt."""
    owners = torch.zeros(seq_len, dtype=torch.long)
    for r in range(world_size):
        owners[local_positions(seq_len, r, world_size, layout, ulysses)] = r
    return owners


class SlotTable:
    """The rows one row set keeps: this rank's slots, every rank's counts, and this forward's plan.

    Slot ``i`` of every layer of the rule (restricted to the set's K/V heads)
    holds the row of global position ``positions[i]``, or nothing when that
    is :data:`EMPTY_SLOT` (an evicted row, whose position no query attends);
    ``last[i]`` is the row's last reader. Slots stay in position order:
    evicted rows are only marked, and the slots are compacted (in order) when
    the buffer is full or holds more dead slots than its growth step, so a
    step copies no rows most of the time and the attention reads the keys in
    the order the full sequence has them. ``counts`` are the live rows each
    rank holds, known on every rank from the same deterministic placement and
    eviction; every rank's live rows (their last readers and owners) are kept
    to recount after an eviction.

    A forward's plan, which each layer applies as it stores its rows: keep
    the slots ``compact`` (in order; None: all), size the buffer to
    ``capacity`` slots, then write after the first ``kept`` slots the inputs'
    rows ``take`` (all when None) or, after a prefill that rebalances, the rows ``gather`` names.
    """

    def __init__(self, rule: Retention, index: int, rank: int, world_size: int):
        self.rule, self.index, self.rank, self.world_size = rule, index, rank, world_size
        self.positions = torch.zeros(0, dtype=torch.long)
        self.last = torch.zeros(0, dtype=torch.long)
        self.counts = [0] * world_size
        self.dead = 0
        self.capacity = 0
        self._live_last = torch.zeros(0, dtype=torch.long)
        self._live_owner = torch.zeros(0, dtype=torch.long)
        self._pending: List[Tuple[Tensor, Tensor]] = []  # rows placed since the last recount: (last readers, owners)
        self.first_expiry = NO_EXPIRY
        self.version = 0
        self.compact: Optional[Tensor] = None
        self.kept = 0
        self.take: Optional[Tensor] = None
        self.gather: Optional[Tuple[Tensor, Tensor, Tensor, int]] = None  # (rows to send, source rank, index there, most sent)

    def held(self) -> Tensor:
        """Global positions of the live rows this rank holds, ascending."""
        return self.positions[self.positions != EMPTY_SLOT] if self.dead else self.positions

    def begin_prefill(self, seq_len: int, mine: Tensor, layout: str, rebalance: bool, ulysses: int = 1) -> None:
        """Plan the prefill: this rank's layout rows ``mine`` arrive, those still visible after it are kept.

        With ``rebalance``, unless the layout already gives every rank about
        an even share, the visible rows of all ranks are dealt out in position
        order, the i-th to rank ``i % world_size``.
        """
        self.version += 1
        self.compact, self.kept, self.gather, self.dead = None, 0, None, 0
        if not self.rule.evicts:
            self.positions, self.take = mine.clone(), None
            self.counts = shard_sizes(seq_len, self.world_size, layout, ulysses)
            self.capacity = int(mine.numel())  # the prefill is stored without spare room
            return
        everywhere = torch.arange(seq_len)
        last = self.rule.last_readers(everywhere, self.index)
        visible = last >= seq_len
        live = everywhere[visible]
        source = _ranks_of(seq_len, self.world_size, layout, ulysses)[live]
        sent = torch.bincount(source, minlength=self.world_size)
        if not rebalance or int(sent.max()) <= -(-live.numel() // self.world_size) + 1:
            self.take = torch.nonzero(visible[mine]).flatten()
            self.positions = mine[self.take]
            owners = source
        else:
            # Each rank sends its visible rows in its own (ascending) order: a row's index there is how many
            # visible rows of the same rank come before it.
            onehot = torch.nn.functional.one_hot(source, self.world_size)
            at_source = (onehot.cumsum(0) * onehot).sum(1) - 1
            owners = torch.arange(live.numel()) % self.world_size
            here = owners == self.rank
            self.take = None
            self.gather = (torch.nonzero(visible[mine]).flatten(), source[here], at_source[here], int(sent.max()))
            self.positions = live[here]
        self.capacity = int(self.positions.numel())
        self.last = last[self.positions]
        self._live_last, self._live_owner, self._pending = last[visible], owners, []
        self.counts = torch.bincount(owners, minlength=self.world_size).tolist()
        self.first_expiry = int(self._live_last.min()) if self._live_last.numel() else NO_EXPIRY

    def begin_step(self, first: int, num_new: int) -> None:
        """Plan a step of ``num_new`` tokens from position ``first``: evict what no query from there reads, place the new."""
        self.version += 1
        self.compact, self.gather = None, None
        if self.rule.evicts and first > self.first_expiry:
            self._evict(first)
        new = torch.arange(first, first + num_new)
        if self.rule.evicts:
            new_last = self.rule.last_readers(new, self.index)
            stored = torch.nonzero(new_last >= new).flatten()  # a row no query reads is never stored
        else:
            new_last, stored = None, torch.arange(num_new)
        owners = torch.tensor(place_tokens(self.counts, int(stored.numel())), dtype=torch.long)
        for r in owners.tolist():
            self.counts[r] += 1
        self.take = stored[owners == self.rank]
        slots, live = int(self.positions.numel()), int(self.positions.numel()) - self.dead
        need = slots + int(self.take.numel())
        if self.dead and (need > self.capacity or self.dead > growth_rows(live)):
            self.compact = torch.nonzero(self.positions != EMPTY_SLOT).flatten()
            self.positions, self.last, self.dead = self.positions[self.compact], self.last[self.compact], 0
            need = live + int(self.take.numel())
        if need > self.capacity or self.capacity - need > 2 * growth_rows(need):
            self.capacity = need + growth_rows(need)
        self.kept = int(self.positions.numel())
        self.positions = torch.cat([self.positions, new[self.take]])
        if new_last is not None:
            self.last = torch.cat([self.last, new_last[self.take]])
            if stored.numel():
                self._pending.append((new_last[stored], owners))
                self.first_expiry = min(self.first_expiry, int(new_last[stored].min()))

    def _evict(self, first: int) -> None:
        if self._pending:
            self._live_last = torch.cat([self._live_last] + [p[0] for p in self._pending])
            self._live_owner = torch.cat([self._live_owner] + [p[1] for p in self._pending])
            self._pending = []
        alive = self._live_last >= first
        self._live_last, self._live_owner = self._live_last[alive], self._live_owner[alive]
        self.counts = torch.bincount(self._live_owner, minlength=self.world_size).tolist()
        self.first_expiry = int(self._live_last.min()) if self._live_last.numel() else NO_EXPIRY
        gone = (self.last < first) & (self.positions != EMPTY_SLOT)
        if bool(gone.any()):
            self.positions = self.positions.masked_fill(gone, EMPTY_SLOT)
            self.dead += int(gone.sum())
