"""Which rows each rank holds of a packed row, chosen from its documents so that attention work is even.

Pure index math. A positional layout (zigzag) balances causal work for one
document; in a packed row a document's work grows with the square of its
length and lands on whichever ranks hold its rows. :func:`plan_documents`
balances by document instead (``p`` ring groups; work counted in causal
pairs, ``L(L+1)/2`` for a document of ``L`` rows):

- documents stay whole where they can, dealt out in row order: rank ``r``
  takes the documents whose middle of cumulative work falls in its ``r``-th
  share of their total (a contiguous stretch of them, so a rank holds few
  runs and adjacent documents join into one);
- while that leaves the worst rank above ``1 + ε`` of the mean
  (:data:`CUT_SHARE`) and a whole document holds more than ``ε`` of one
  rank's mean work, the longest such document is cut as
  zigzag cuts a row: ``2p`` near-equal pieces, rank ``r`` taking pieces ``r``
  and ``2p-1-r``, which gives every rank the same work up to the pieces'
  one-row rounding.

Bound: the worst rank's work is at most ``(1 + ε) · mean`` plus ``2L`` per cut
document of ``L`` rows (the rounding of its pieces). Cutting stops at the first
plan within ``1 + ε``, or once no whole document holds more than ``ε · mean``:
a whole document moves a rank's load from its target share by at most half
its work on each side. With ``ε = 1/32`` that keeps the worst rank within 1.05
of the mean on 2, 4 and 8 ranks alike. One document per row (the usual case)
is zigzag exactly. The plan is the same on every rank of a group (it reads only
the documents, which every rank holds alike) and costs O(documents) per try,
at most ``p / ε`` tries (one per cut document).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from .layout import Plan, Run, chunk_bounds

CUT_SHARE = 1 / 32
"""``ε``: a document with more causal pairs than this share of one rank's mean is cut over every rank."""


def causal_pairs(length: int) -> int:
    """Query-key pairs of causal attention over one document of ``length`` rows."""
    return length * (length + 1) // 2


def _lengths(starts: Sequence[int], seq_len: int) -> List[int]:
    return [b - a for a, b in zip(starts, list(starts[1:]) + [seq_len])]


def plan_documents(seq_len: int, starts: Sequence[int], groups: int, cut_share: float = CUT_SHARE) -> Plan:
    """The rows each of ``groups`` ring groups holds of a row of ``seq_len`` rows whose documents start at
    ``starts`` (ascending, beginning with 0); see the module docstring for the rule and its bound."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    if not starts or starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])) or starts[-1] >= max(seq_len, 1):
        raise ValueError(f"starts must ascend from 0 below seq_len={seq_len}, got {tuple(starts)[:8]}")
    lengths = _lengths(starts, seq_len)
    mean = sum(causal_pairs(n) for n in lengths) / groups
    cuttable = sorted(range(len(lengths)) if groups > 1 else (), key=lambda i: -lengths[i])
    cut: set = set()
    while True:
        plan = _placed(seq_len, starts, lengths, groups, cut)
        biggest = next((i for i in cuttable if i not in cut), None)
        if (biggest is None or causal_pairs(lengths[biggest]) <= cut_share * mean
                or worst_over_mean(plan.runs, starts, seq_len) <= 1 + cut_share):
            return plan
        cut.add(biggest)


def _placed(seq_len: int, starts: Sequence[int], lengths: Sequence[int], groups: int, cut: set) -> Plan:
    """The documents whose indices are in ``cut`` cut over every group, the others dealt out whole."""
    runs: List[List[Run]] = [[] for _ in range(groups)]
    whole: List[Tuple[int, int]] = []  # (start, length) of the documents kept whole, in row order
    for i, (start, length) in enumerate(zip(starts, lengths)):
        if i in cut:
            pieces = chunk_bounds(length, 2 * groups)
            for r in range(groups):
                for a, b in (pieces[r], pieces[2 * groups - 1 - r]):
                    runs[r].append((start + a, start + b))
        else:
            whole.append((start, length))
    total = sum(causal_pairs(n) for _, n in whole)
    done = 0
    for start, length in whole:
        work = causal_pairs(length)
        rank = min(groups - 1, int((done + work / 2) * groups / total)) if total else 0
        runs[rank].append((start, start + length))
        done += work
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


def work_by_rank(runs_by_rank: Sequence[Sequence[Run]], starts: Sequence[int], seq_len: int) -> List[int]:
    """Causal pairs each rank's queries attend under the documents at ``starts``: per held row, the rows of its
    document up to and including it."""
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
                first, last = row - bounds[d] + 1, stop - bounds[d]  # rows seen by the run's first and last query
                pairs += (first + last) * (stop - row) // 2
                row = stop
            d = 0
        out.append(pairs)
    return out


def worst_over_mean(runs_by_rank: Sequence[Sequence[Run]], starts: Sequence[int], seq_len: int) -> float:
    """The worst rank's causal pairs over the mean's (1.0: even)."""
    work = work_by_rank(runs_by_rank, starts, seq_len)
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0
