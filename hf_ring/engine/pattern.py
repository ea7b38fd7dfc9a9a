"""``DilatedPattern``: the (segment length, dilation rate) branches of LongNet attention.

For query head h and branch (w, r) over a global length N, position p sits in
segment ``p // min(w, N)`` and may attend key q of the same segment when both
in-segment indices are congruent to the head offset ``h % r`` modulo r (and
q <= p when causal). Branches mix by a single softmax whose weights count how
many branches allow a pair. One branch with ``w >= N`` and ``r = 1`` is exact
dense attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from .arguments import positive_int

Branches = Tuple[Tuple[int, int], ...]

DENSE: Branches = ((1 << 62, 1),)
"""Exact dense attention as a branch: one segment longer than any sequence, rate 1."""


def _positive_ints(name: str, values: Any) -> Tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a list of positive ints, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must hold ints, got {v!r} ({type(v).__name__})")
        if v < 1:
            raise ValueError(f"{name} must hold positive ints, got {v}")
        out.append(int(v))
    return tuple(out)


@dataclass(frozen=True)
class DilatedPattern:
    """Branches ``(segment_lengths[i], dilation_rates[i])`` of dilated attention.

    >>> DilatedPattern([2048, 4096, 8192], [1, 2, 4])
    """

    segment_lengths: Tuple[int, ...]
    dilation_rates: Tuple[int, ...]

    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int]):
        lengths = _positive_ints("segment_lengths", segment_lengths)
        rates = _positive_ints("dilation_rates", dilation_rates)
        if len(lengths) != len(rates):
            raise ValueError(
                f"segment_lengths has {len(lengths)} entries but dilation_rates has {len(rates)}; "
                "give one rate per segment length"
            )
        if not lengths:
            raise ValueError("a DilatedPattern needs at least one (segment length, dilation rate) branch")
        object.__setattr__(self, "segment_lengths", lengths)
        object.__setattr__(self, "dilation_rates", rates)

    @property
    def branches(self) -> Tuple[Tuple[int, int], ...]:
        return tuple(zip(self.segment_lengths, self.dilation_rates))

    @classmethod
    def geometric(cls, seq_len: int, base_segment: int, max_rate: int) -> "DilatedPattern":
        """LongNet's linear-cost pattern: segments ``base_segment·2ⁱ`` up to ``seq_len``, rates ``2ⁱ``.

        Every query of branch i then sees about ``base_segment`` keys, so the cost
        grows linearly in ``seq_len``. Rates stop at ``max_rate`` (give the query
        heads, so that :meth:`coverage_gaps` is empty); the branches above it see
        more keys, and the cost grows as ``seq_len²/max_rate²`` once ``seq_len``
        passes ``base_segment·max_rate``. The last segment is ``seq_len`` itself.

        >>> DilatedPattern.geometric(16384, 2048, 16)
        DilatedPattern([2048, 4096, 8192, 16384], [1, 2, 4, 8])
        """
        positive_int(seq_len, "seq_len")
        positive_int(base_segment, "base_segment")
        positive_int(max_rate, "max_rate")
        lengths, rates = [], []
        w, r = base_segment, 1
        while True:
            lengths.append(min(w, seq_len))
            rates.append(min(r, max_rate, lengths[-1]))
            if w >= seq_len:
                return cls(lengths, rates)
            w, r = 2 * w, 2 * r

    def to_dict(self) -> Dict[str, List[int]]:
        return {"segment_lengths": list(self.segment_lengths), "dilation_rates": list(self.dilation_rates)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DilatedPattern":
        if not isinstance(data, Mapping):
            raise TypeError(f"a pattern dict must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {"segment_lengths", "dilation_rates"}
        if unknown:
            raise ValueError(f"unknown pattern keys {sorted(unknown)}; expected segment_lengths and dilation_rates")
        missing = {"segment_lengths", "dilation_rates"} - set(data)
        if missing:
            raise ValueError(f"pattern dict is missing {sorted(missing)}")
        return cls(data["segment_lengths"], data["dilation_rates"])

    def flops(self, seq_len: int, heads: int, head_dim: int, causal: bool = True) -> Dict[str, float]:
        """Attention matmul FLOPs (QKᵀ and PV, forward) of this pattern and of dense attention.

        Per head and branch the work is ``N/w̃`` segments of ``(w̃/r)²`` pairs
        over ``r`` offsets, i.e. about ``N·w̃/r²`` pairs for the heads of each offset.
        """
        n = seq_len
        pairs = 0.0
        for w, r in self.branches:
            w = min(w, n)
            for start in range(0, n, w):
                length = min(w, n - start)
                for o in range(min(r, length)):
                    m = len(range(o, length, r))
                    per_head = m * (m + 1) / 2 if causal else m * m
                    # heads h with h % r == o
                    pairs += per_head * len(range(o, heads, r))
        dense = heads * (n * (n + 1) / 2 if causal else n * n)
        per_pair = 4 * head_dim
        return {"pattern": pairs * per_pair, "dense": dense * per_pair, "ratio": pairs / dense if dense else 0.0}

    def coverage_gaps(self, num_heads: int) -> List["CoverageGap"]:
        """The distances at which fewer positions read a key with ``num_heads`` query heads than with enough.

        Head h reads branch (w, r) at the in-segment positions congruent to
        ``h % r``: with fewer heads than r, the residues ``num_heads .. r-1``
        are no head's, and a position that only such a branch lets reach a
        distance reads nothing there (neither as query nor as key). For each
        band of distances between consecutive segment lengths, the share of
        the positions that read some key at that distance with every residue
        covered but read none with ``num_heads`` heads; bands that lose
        nothing are left out, so the list is empty when the heads cover it all.
        """
        positive_int(num_heads, "num_heads")
        if all(r <= num_heads for r in self.dilation_rates):
            return []
        # The pattern repeats with this period; a very long one is sampled from its start.
        period = min(math.lcm(*self.segment_lengths, *self.dilation_rates), 1 << 22)
        p = torch.arange(period)
        edges = [0] + sorted(set(self.segment_lengths))
        gaps = []
        for start, end in zip(edges, edges[1:]):
            full = torch.zeros(period, dtype=torch.bool)
            seen = torch.zeros(period, dtype=torch.bool)
            for w, r in self.branches:
                nearest = -(-start // r) * r  # the shortest distance in the band this branch can reach
                if nearest >= end or nearest >= w:
                    continue
                reach = (p % w) >= nearest
                full |= reach
                seen |= reach & ((p % w) % r < num_heads)
            lost = int((full & ~seen).sum())
            if lost:
                rates = tuple(sorted({r for w, r in self.branches if r > num_heads and w > start}))
                gaps.append(CoverageGap(start, end, num_heads, rates, lost / int(full.sum())))
        return gaps

    def __repr__(self) -> str:
        return f"DilatedPattern({list(self.segment_lengths)}, {list(self.dilation_rates)})"


@dataclass(frozen=True)
class CoverageGap:
    """Distances ``[start, end)`` at which a ``share`` of the positions that enough heads would read, no head reads."""

    start: int
    end: int
    num_heads: int
    rates: Tuple[int, ...]  # the rates above num_heads among the branches that reach these distances
    share: float

    def describe(self) -> str:
        return f"{self.share:.0%} at distances {self.start}-{self.end - 1}"


def coverage_message(pattern: DilatedPattern, num_heads: int) -> Optional[str]:
    """Why and where ``pattern`` leaves positions unread with ``num_heads`` query heads, and the fix; None if nowhere."""
    gaps = pattern.coverage_gaps(num_heads)
    if not gaps:
        return None
    rates = sorted({r for r in pattern.dilation_rates if r > num_heads})
    return (f"{pattern!r} with {num_heads} query heads leaves positions unread: head h reads a branch of rate r at "
            f"offset h % r only, so the branches of rates {rates} read offsets 0-{num_heads - 1} and no other. "
            "Positions the pattern reaches but no head reads: " + ", ".join(g.describe() for g in gaps)
            + f". Use dilation rates of at most {num_heads} (the query heads), or a model with at least "
            f"{max(rates)} query heads")


def branches_of(pattern: Optional[DilatedPattern]) -> Branches:
    """The branches of ``pattern``; ``None`` (dense attention) is the one branch :data:`DENSE`."""
    return DENSE if pattern is None else pattern.branches


def head_slice(heads: range) -> slice:
    """The heads of a ``range`` as a slice, to index a tensor's head dimension without a copy."""
    return slice(heads.start, heads.stop, heads.step)


def head_groups(hq: int, hkv: int, rate: int, offset: int) -> List[Tuple[range, range]]:
    """Query heads with ``h % rate == offset``, split into kernel calls ``(q_heads, kv_heads)``.

    In each pair, query head ``q_heads[i]`` uses K/V head ``kv_heads[i // (len(q_heads) // len(kv_heads))]``,
    the grouping a GQA kernel expects, so K/V are never repeated per query head.
    """
    g = hq // hkv
    q_heads = range(offset, hq, rate)
    if not q_heads:
        return []
    if rate % g == 0:  # each K/V head serves at most one query head of this offset
        return [(q_heads, range(offset // g, hkv, rate // g))]
    if g % rate == 0:  # every K/V head serves g / rate consecutive query heads of this offset
        return [(q_heads, range(hkv))]
    groups = []
    for u in range(hkv):
        first = u * g + (offset - u * g) % rate
        qs = range(first, (u + 1) * g, rate)
        if qs:
            groups.append((qs, range(u, u + 1)))
    return groups
