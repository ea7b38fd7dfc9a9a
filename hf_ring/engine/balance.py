"""Which rows each rank holds of a packed row, chosen from its documents so that attention work is even.

Pure index math. A positional layout (zigzag) balances causal work for one
document; in a packed row a document's work grows with the square of its
length and lands on whichever ranks hold its rows. :func:`plan_documents`
balances by document instead (``p`` ring groups; work counted as the keys
every row attends, :class:`Work`: causal pairs, ``L(L+1)/2`` for a document
of ``L`` rows, unless the model's layers attend a window or a dilated
pattern):

- documents stay whole where they can, dealt out in row order: rank ``r``
  takes the documents whose middle of cumulative work falls in its ``r``-th
  share of their total, each share what the cut documents leave of the
  rank's mean (a contiguous stretch of them, so a rank holds few runs and
  adjacent documents join into one);
- while that leaves the worst rank above ``1 + ε`` of the mean
  (:data:`CUT_SHARE`) and a whole document holds more than ``ε`` of one
  rank's mean work, the longest such document is cut as
  zigzag cuts a row: ``2p`` near-equal pieces, rank ``r`` taking pieces ``r``
  and ``2p-1-r`` (the ``k``-th cut document turned ``k`` ranks on), which
  gives every rank the same causal work up to the pieces' one-row rounding.

Bound (causal pairs): the worst rank's work is at most ``(1 + ε) · mean`` plus
``2L`` per cut document of ``L`` rows (the rounding of its pieces). Under a
window ``w`` a row costs at most ``w``, and a cut document's pieces differ by
their rounding and by the first ``w`` rows' ramp (at most ``w²/2``); dilated
branches likewise by one segment's ramp. Cutting stops at the first
plan within ``1 + ε``, or once no whole document holds more than ``ε · mean``:
a whole document moves a rank's load from its target share by at most half
its work on each side. With ``ε = 1/32`` that keeps the worst rank within 1.05
of the mean on 2, 4 and 8 ranks alike. One document per row (the usual case)
is zigzag exactly. The plan is the same on every rank of a group (it reads only
the documents, which every rank holds alike) and costs O(documents) per try,
at most ``p / ε`` tries (one per cut document).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .layout import Plan, Run, chunk_bounds

CUT_SHARE = 1 / 32
"""``ε``: a document with more causal pairs than this share of one rank's mean is cut over every rank."""


def causal_pairs(length: int) -> int:
    """Query-key pairs of causal attention over one document of ``length`` rows."""
    return length * (length + 1) // 2


def _windowed(rows: int, window: int) -> int:
    ramp = min(rows, window)
    return causal_pairs(ramp) + (rows - ramp) * window


def _dilated(rows: int, segment: int, rate: int) -> int:
    """Keys the first ``rows`` rows of a document attend in one branch: segments restart every ``segment`` rows,
    and a row at offset ``j`` of its segment attends the ``j // rate + 1`` rows of its residue class up to it."""
    def within(k: int) -> int:
        q, t = divmod(k, rate)
        return rate * causal_pairs(q) + t * (q + 1)
    full, rest = divmod(rows, segment)
    return full * within(segment) + within(rest)


Layer = Tuple[int, Optional[int], Tuple[Tuple[int, int], ...]]
"""``(layers, window, branches)``: how many attention layers attend a window (None: every earlier row of the
document) or dilated ``(segment, rate)`` branches (empty: dense; a dilated layer's window is not counted)."""


@dataclass(frozen=True)
class Work:
    """What the rows of a document cost to attend, summed over a model's attention layers (:data:`Layer` each).
    No attention layer (a model of recurrent layers alone): every row costs one, the work is the rows."""

    layers: Tuple[Layer, ...] = ((1, None, ()),)

    def prefix(self, rows: int) -> int:
        """Keys the first ``rows`` rows of a document attend, over every attention layer."""
        if not self.layers:
            return rows
        total = 0
        for count, window, branches in self.layers:
            if branches:
                total += count * sum(_dilated(rows, s, r) for s, r in branches)
            elif window is not None:
                total += count * _windowed(rows, window)
            else:
                total += count * causal_pairs(rows)
        return total


CAUSAL = Work()
"""Every row attends every earlier row of its document, once: the work is causal pairs."""


def _lengths(starts: Sequence[int], seq_len: int) -> List[int]:
    return [b - a for a, b in zip(starts, list(starts[1:]) + [seq_len])]


def plan_documents(seq_len: int, starts: Sequence[int], groups: int, work: Work = CAUSAL,
                   cut_share: float = CUT_SHARE) -> Plan:
    """The rows each of ``groups`` ring groups holds of a row of ``seq_len`` rows whose documents start at
    ``starts`` (ascending, beginning with 0), its documents weighed by ``work``; see the module docstring for the
    rule and its bound."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    if not starts or starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])) or starts[-1] >= max(seq_len, 1):
        raise ValueError(f"starts must ascend from 0 below seq_len={seq_len}, got {tuple(starts)[:8]}")
    lengths = _lengths(starts, seq_len)
    mean = sum(work.prefix(n) for n in lengths) / groups
    cuttable = sorted(range(len(lengths)) if groups > 1 else (), key=lambda i: -lengths[i])
    cut: set = set()
    while True:
        plan = _placed(seq_len, starts, lengths, groups, cut, work)
        biggest = next((i for i in cuttable if i not in cut), None)
        if (biggest is None or work.prefix(lengths[biggest]) <= cut_share * mean
                or worst_over_mean(plan.runs, starts, seq_len, work) <= 1 + cut_share):
            return plan
        cut.add(biggest)


def _placed(seq_len: int, starts: Sequence[int], lengths: Sequence[int], groups: int, cut: set,
            work: Work) -> Plan:
    """The documents whose indices are in ``cut`` cut over every group, the others dealt out whole into what the
    cut pieces leave of each group's share."""
    runs: List[List[Run]] = [[] for _ in range(groups)]
    whole: List[Tuple[int, int]] = []  # (start, length) of the documents kept whole, in row order
    turn = 0  # cut documents so far
    for i, (start, length) in enumerate(zip(starts, lengths)):
        if i in cut:
            pieces = chunk_bounds(length, 2 * groups)
            # Each cut document starts its pairing one group on, so what its pieces leave uneven (their rounding,
            # a window's ramp over its first rows) does not pile up on group 0.
            for r in range(groups):
                q = (r + turn) % groups
                for a, b in (pieces[q], pieces[2 * groups - 1 - q]):
                    runs[r].append((start + a, start + b))
            turn += 1
        else:
            whole.append((start, length))
    held = work_by_rank(runs, starts, seq_len, work)
    total = sum(work.prefix(n) for _, n in whole)
    room = [max(0.0, (total + sum(held)) / groups - w) for w in held]
    scale = total / sum(room) if sum(room) else 0.0
    ends, at = [], 0.0
    for r in room:
        at += r * scale
        ends.append(at)
    done, rank = 0, 0
    for start, length in whole:
        cost = work.prefix(length)
        while rank < groups - 1 and done + cost / 2 >= ends[rank]:
            rank += 1
        runs[rank].append((start, start + length))
        done += cost
    return Plan(seq_len, tuple(_joined(sorted(r)) for r in runs))


def _joined(runs: Sequence[Run]) -> Tuple[Run, ...]:
    out: List[Run] = []
    for a, b in runs:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def work_by_rank(runs_by_rank: Sequence[Sequence[Run]], starts: Sequence[int], seq_len: int,
                 work: Work = CAUSAL) -> List[int]:
    """The work (:class:`Work`; causal pairs by default) of each rank's queries under the documents at ``starts``:
    per held row, the keys of its document it attends."""
    bounds = list(starts) + [seq_len]
    out = []
    for runs in runs_by_rank:
        pairs, d = 0, 0
        for a, b in runs:
            row = a
            while row < b:
                while bounds[d + 1] <= row:
                    d += 1
                stop = min(b, bounds[d + 1])
                pairs += work.prefix(stop - bounds[d]) - work.prefix(row - bounds[d])
                row = stop
            d = 0
        out.append(pairs)
    return out


def worst_over_mean(runs_by_rank: Sequence[Sequence[Run]], starts: Sequence[int], seq_len: int,
                    work: Work = CAUSAL) -> float:
    """The worst rank's work over the mean's (1.0: even)."""
    found = work_by_rank(runs_by_rank, starts, seq_len, work)
    mean = sum(found) / len(found)
    return max(found) / mean if mean else 1.0
