"""Bidirectional spans inside a causal sequence: where they lie, and which pairs only they allow.

Pure index math. Vision-language models let the tokens of one image (Gemma 3)
or of a whole prefix (PaliGemma, GIT) attend each other in both directions
while the rest of the row stays causal: a query sees a key when causality
(with the window and its document) allows it, or when both lie in one span.
Spans are given per batch row as ascending, disjoint ``(start, stop)`` runs of
global rows (hashable, like :mod:`hf_ring.engine.documents`), and never cross a
document border.

The ring computes what causality allows as it would without spans and adds,
for each span, blocks of the pairs only the span allows (its later keys, and
with a window its keys further back than the window): the two sets are
disjoint, so every allowed pair joins the softmax exactly once, and a span's
extra blocks are the size of the span.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import List, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor

Span = Tuple[int, int]
Spans = Tuple[Tuple[Span, ...], ...]
"""Per batch row, the ascending, disjoint ``(start, stop)`` rows of each bidirectional span."""


def spans_of_ids(ids: Tensor) -> Spans:
    """Spans of ``(B, n)`` block ids (-1 or below: no block): each maximal run of one id >= 0.

    A block whose rows are not one run cannot be told apart from two blocks by
    position alone; it is refused rather than split.
    """
    if ids.dim() != 2:
        raise ValueError(f"block ids must be (batch, rows), got shape {tuple(ids.shape)}")
    rows = ids.detach().to("cpu", torch.long)
    out = []
    for b in range(rows.shape[0]):
        row = rows[b]
        change = torch.nonzero(row[1:] != row[:-1]).flatten() + 1
        bounds = [0] + change.tolist() + [row.numel()]
        found, seen = [], set()
        for start, stop in zip(bounds, bounds[1:]):
            block = int(row[start])
            if block < 0:
                continue
            if block in seen:
                raise ValueError(
                    f"bidirectional block {block} of batch row {b} is not one run of rows (it appears again at row "
                    f"{start}); ring_dilated computes blocks that are contiguous runs of the sequence"
                )
            seen.add(block)
            if stop - start > 1:
                found.append((start, stop))
        out.append(tuple(found))
    return tuple(out)


def check_spans(spans, batch: int, seq_len: Optional[int]) -> Optional[Spans]:
    """Validated spans, or None when no batch row has a span of two rows or more (nothing to add)."""
    if spans is None:
        return None
    if not isinstance(spans, tuple) or len(spans) != batch:
        raise ValueError(f"spans must be a tuple of {batch} tuples (one per batch row) of (start, stop) runs, as "
                         f"hf_ring.engine.spans.spans_of_ids returns; got {spans!r:.200}")
    for b, row in enumerate(spans):
        last = 0
        for span in row if isinstance(row, tuple) else [None]:
            ok = (isinstance(span, tuple) and len(span) == 2
                  and all(isinstance(x, int) and not isinstance(x, bool) for x in span))
            if not ok or span[0] < last or span[1] <= span[0] or (seq_len is not None and span[1] > seq_len):
                raise ValueError(f"spans[{b}] must be ascending, disjoint (start, stop) runs of ints within the "
                                 f"sequence length {seq_len}; got {row!r:.200}")
            last = span[1]
    if all(stop - start < 2 for row in spans for start, stop in row):
        return None
    return spans


def within_documents(spans: Optional[Spans], documents, seq_len: int) -> Optional[Spans]:
    """``spans`` cut at every document start (None: one document per row): no pair of a span crosses a document."""
    if spans is None or documents is None:
        return spans
    out = []
    for row, starts in zip(spans, documents):
        cut = []
        for start, stop in row:
            bounds = [start] + [s for s in starts if start < s < stop] + [stop]
            cut.extend((a, c) for a, c in zip(bounds, bounds[1:]) if c - a > 1)
        out.append(tuple(cut))
    return check_spans(tuple(out), len(spans), seq_len)


def merged(spans: Spans) -> List[Span]:
    """The spans of every batch row as one ascending list of disjoint runs (overlapping ones joined): what the
    plan of a batch must cover."""
    runs = sorted(span for row in spans for span in row)
    out: List[Span] = []
    for start, stop in runs:
        if out and start < out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def touching(runs: Sequence[Span], lo: int, hi: int) -> List[Span]:
    """The runs (of :func:`merged`) holding some row of ``[lo, hi]``."""
    i = max(bisect_right([s for s, _ in runs], lo) - 1, 0)
    out = []
    while i < len(runs) and runs[i][0] <= hi:
        if runs[i][1] > lo:
            out.append(runs[i])
        i += 1
    return out


def extra_pairs_possible(q_lo: int, q_hi: int, k_lo: int, k_hi: int, window: Optional[int]) -> bool:
    """Whether rows ``[q_lo, q_hi]`` and keys ``[k_lo, k_hi]`` of one span can hold a pair that causality (with
    ``window``) does not allow: a key after its query, or one the window leaves out."""
    return k_hi > q_lo or (window is not None and k_lo <= q_hi - window)


def _ids(spans: Spans, pos: Tensor) -> Tensor:
    """``(B, len(pos))``: the span (numbered from 0 in each batch row) holding each position, -1 outside."""
    out = torch.full((len(spans), pos.numel()), -1, dtype=torch.long, device=pos.device)
    for b, row in enumerate(spans):
        for i, (start, stop) in enumerate(row):
            out[b, (pos >= start) & (pos < stop)] = i
    return out


def extra_pairs(spans: Spans, q_pos: Tensor, k_pos: Tensor, causal: bool, window: Optional[int]) -> Tensor:
    """``(B, 1, nq, nk)`` bool: the pairs of queries at ``q_pos`` and keys at ``k_pos`` (1-D positions of one
    progression each) that share a span and that causality with ``window`` does not already allow."""
    sq, sk = _ids(spans, q_pos), _ids(spans, k_pos)
    same = (sq[:, :, None] == sk[:, None, :]) & (sq[:, :, None] >= 0)
    q, k = q_pos[:, None], k_pos[None, :]
    base = k <= q if causal else torch.ones_like(same[0])
    if window is not None:
        base = base & (k > q - window)
    return (same & ~base[None])[:, None]
