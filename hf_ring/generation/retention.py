"""Which cached rows a later query can still read: the index math of a cache that evicts.

A decoding query at position t reads key k under the ring's rules (see
:func:`hf_ring.engine.decode.cached_blocks`): ``k <= t``, ``k > t - window`` when the
layer has a window, and for each branch ``(w, r)`` of a dilated pattern the
keys of t's own segment ``t // w`` whose in-segment index has t's residue
``o = (t % w) % r``, for the query heads with ``h % r == o``. All queries of
the future are at or past the next position, and those that may read k form
a set bounded above, so every row has a *last reader*: the largest query
position that may still attend it. A row is still visible at ``t_next``
exactly when its last reader is ``>= t_next``; once it is not, no query will
read it again and the cache may drop it.

Rows of a dilated layer are kept per K/V head: K/V head ``u`` serves query
heads ``u*g .. u*g+g-1`` (``g = Hq / Hkv``, the grouping of
:func:`hf_ring.engine.pattern.head_groups`), so in branch ``(w, r)`` it needs only
the rows whose residue is one of theirs modulo r.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch

from ..engine.pattern import DENSE, Branches
from ..integration import config as ring_config

Tensor = torch.Tensor

NEVER_READ = -1
"""The last reader of a row no query reads (no branch serves its residue for these heads)."""


@dataclass(frozen=True)
class Retention:
    """What a layer's cache rows are kept for: its window, its branches and, per row set, the residues it serves.

    ``residues[s][b]`` are the residues modulo branch b's rate that the query
    heads of row set s use. A rule with one row set keeps the same rows for
    every K/V head; a dilated rule whose heads need different rows has one
    row set per K/V head. ``KEEP_ALL`` keeps every row (dense attention, or
    eviction turned off).
    """

    window: Optional[int] = None
    branches: Branches = DENSE
    residues: Tuple[Tuple[Tuple[int, ...], ...], ...] = (((0,),),)

    @property
    def sets(self) -> int:
        """Row sets of a layer under this rule: 1, or one per K/V head."""
        return len(self.residues)

    @property
    def evicts(self) -> bool:
        """Whether any row ever stops being visible."""
        return self.window is not None or tuple(self.branches) != tuple(DENSE)

    def last_readers(self, positions: Tensor, row_set: int = 0) -> Tensor:
        """The last query position that may read each row of ``positions`` in row set ``row_set``."""
        if positions.numel() <= FEW:  # a decoding step: plain integers cost less than tensor operations
            return torch.tensor([last_reader(int(p), window=self.window, branches=self.branches,
                                             residues=self.residues[row_set]) for p in positions.tolist()],
                                dtype=torch.long)
        return last_readers(positions, window=self.window, branches=self.branches, residues=self.residues[row_set])


KEEP_ALL = Retention()

FEW = 16
"""Up to this many positions the last readers are worked out on Python integers."""


@functools.lru_cache(maxsize=256)
def rule_for(window: Optional[int], branches: Branches, hq: int, hkv: int) -> Retention:
    """The rule of a layer with this window, these branches and ``hq`` query heads over ``hkv`` K/V heads.

    One row set when every K/V head needs the same rows (no dilation, or each
    K/V head's query heads cover every residue of every branch), else one per K/V head.
    """
    branches = tuple((int(w), int(r)) for w, r in branches)
    if hq % hkv:
        raise ValueError(f"{hq} query heads cannot share {hkv} K/V heads evenly")
    g = hq // hkv
    per_head = tuple(
        tuple(tuple(sorted({h % r for h in range(u * g, (u + 1) * g)})) for _, r in branches) for u in range(hkv)
    )
    if all(residues == per_head[0] for residues in per_head):
        per_head = per_head[:1]
    return Retention(window, branches, per_head)


def last_readers(positions: Tensor, *, window: Optional[int], branches: Sequence[Tuple[int, int]],
                 residues: Sequence[Sequence[int]]) -> Tensor:
    """Per row at ``positions``, the largest query position that may attend it (``NEVER_READ`` if none).

    ``residues[b]``: the residues modulo branch b's rate of the query heads
    reading these rows. In branch ``(w, r)`` a row k of residue ``o`` is read
    by the queries of its segment with residue o up to the segment's end
    (and before ``k + window`` when windowed); the last of them is the
    largest such position. The row's last reader is the largest over the
    branches that serve its residue.
    """
    pos = positions.to(torch.long)
    last = torch.full_like(pos, NEVER_READ)
    for (w, r), served in zip(branches, residues):
        start = pos // w * w
        hi = start + (w - 1)
        if window is not None:
            hi = torch.minimum(hi, pos + (window - 1))
        o = (pos - start) % r
        top = hi - start
        reader = start + top - (top - o) % r  # the largest in-segment index <= top with residue o
        ok = torch.isin(o, torch.tensor(list(served), dtype=torch.long))
        last = torch.where(ok, torch.maximum(last, reader), last)
    return last


def last_reader(position: int, *, window: Optional[int], branches: Sequence[Tuple[int, int]],
                residues: Sequence[Sequence[int]]) -> int:
    """:func:`last_readers` of one position, on Python integers."""
    last = NEVER_READ
    for (w, r), served in zip(branches, residues):
        start = position // w * w
        hi = start + w - 1
        if window is not None:
            hi = min(hi, position + window - 1)
        o = (position - start) % r
        if o in served:
            top = hi - start
            last = max(last, start + top - (top - o) % r)
    return last


def layer_rules(config: Any, evict: bool = True) -> Tuple[Retention, ...]:
    """Each layer's :class:`Retention` from a transformers config (its layer types, window and ``ring_dilated``)."""
    n = int(config.num_hidden_layers)
    if not evict or getattr(config, "num_attention_heads", None) is None:  # no attention (a state-space model)
        return (KEEP_ALL,) * n
    pattern = ring_config.parse(getattr(config, ring_config.CONFIG_KEY, None)).pattern
    branches = DENSE if pattern is None else pattern.branches
    hq = int(config.num_attention_heads)
    hkv = int(getattr(config, "num_key_value_heads", None) or hq)
    rules = []
    for window in ring_config.layer_windows(config):
        rule = rule_for(window, branches, hq, hkv)
        rules.append(rule if rule.evicts else KEEP_ALL)
    return tuple(rules)
