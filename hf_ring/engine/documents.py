"""Documents packed into one batch row: where they start, and which (query, key) pairs they allow.

Pure index math. A row may hold several documents, marked as transformers'
``DataCollatorWithFlattening`` marks them: ``position_ids`` restart inside the
row, and a document is a maximal run of position ids that increase by one.
Documents are described by their global start rows, one ascending tuple per
batch row beginning with 0 (hashable, so plans built from them can be cached).
A query sees only keys of its own document; causality, windows and dilation
are counted from the document's start.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Any, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor

Documents = Tuple[Tuple[int, ...], ...]
"""Per batch row, the ascending global rows where a document starts; always starting with 0."""

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""Flash-style varlen keys (``DataCollatorWithFlattening``, TRL's padding-free collator): they describe the global
rows, so hf_ring reads them into the forward's documents and does not pass them on to the model."""


def document_starts(position_ids: Tensor) -> Documents:
    """Document starts of global ``position_ids`` ``(B, N)``: row 0 and every row whose id is not its predecessor's + 1."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (batch, rows), got shape {tuple(position_ids.shape)}")
    pos = position_ids.detach().to("cpu", torch.long)
    breaks = pos[:, 1:] != pos[:, :-1] + 1
    starts = []
    for b in range(pos.shape[0]):
        rows = (torch.nonzero(breaks[b]).flatten() + 1).tolist()
        starts.append(tuple([0] + rows))
    return tuple(starts)


def starts_of_ids(*ids: Optional[Tensor]) -> Optional[Documents]:
    """Per batch row, row 0 and every row where one of the ``(B, n)`` id tensors changes: the parts their
    combinations cut a row into (packed documents, and chunks inside them), or None when no tensor is given."""
    given = [t.detach().to("cpu", torch.long) for t in ids if t is not None]
    if not given:
        return None
    changes = torch.zeros_like(given[0][:, 1:], dtype=torch.bool)
    for t in given:
        changes |= t[:, 1:] != t[:, :-1]
    return tuple(tuple([0] + (torch.nonzero(row).flatten() + 1).tolist()) for row in changes)


def chunk_ids(chunk: int, start: Tensor, positions: Optional[Tensor], seq_len: int) -> Tensor:
    """``(B, n)``: the chunk of each row under chunked attention of ``chunk`` rows counted from ``start`` ``(B,)``
    (left padding), at the rows' ``positions`` ``(B, n)`` (None: the rows themselves), as transformers counts."""
    rows = torch.arange(seq_len).view(1, -1) if positions is None else positions.detach().to("cpu", torch.long)
    return torch.div(rows - start.view(-1, 1).to("cpu", torch.long), chunk, rounding_mode="floor")


def left_padding(mask: Optional[torch.Tensor]) -> Optional[Tuple[int, ...]]:
    """Each batch row's padded rows before its first token, as transformers counts them for chunked attention
    (None: no mask)."""
    if mask is None:
        return None
    return tuple(int(x) for x in (mask.cumsum(-1) == 0).sum(-1).tolist())


def check_documents(documents, batch: int, seq_len: int) -> Optional[Documents]:
    """Validated document starts, or None when every batch row is one document (nothing to mask)."""
    if documents is None:
        return None
    if not isinstance(documents, tuple) or len(documents) != batch:
        raise ValueError(
            f"documents must be a tuple of {batch} tuples (one per batch row) of document start rows, "
            f"as hf_ring.engine.documents.document_starts returns; got {documents!r:.200}"
        )
    for b, starts in enumerate(documents):
        if (not isinstance(starts, tuple) or not starts or starts[0] != 0
                or any(isinstance(s, bool) or not isinstance(s, int) for s in starts)
                or any(a >= c for a, c in zip(starts, starts[1:])) or (seq_len and starts[-1] >= seq_len)):
            raise ValueError(
                f"documents[{b}] must be an ascending tuple of ints starting with 0 and below the sequence "
                f"length {seq_len}; got {starts!r:.200}"
            )
    if all(len(starts) == 1 for starts in documents):
        return None
    return documents


def documents_of_call(batch: int, seq_len: int, position_ids: Any, cu_seq_lens_q: Any, cu_seq_lens_k: Any,
                      masked: bool, seq_idx: Any = None) -> Optional[Documents]:
    """Documents packed into the rows of a batch or a forward, as transformers and its collators mark them.

    Runs of ``position_ids`` that increase by one are documents when the
    model was given no attention mask (``masked`` False); flash-style
    ``cu_seq_lens_q/k`` say the same for a flattened row, and ``seq_idx`` (the
    document of each row, as causal-conv1d and mamba-ssm read it) for every
    row: what is given must agree, or the batch is refused naming both.
    """
    b, n = batch, seq_len
    found = None
    cu = cu_seq_lens_k if cu_seq_lens_q is None else cu_seq_lens_q
    if cu is not None:
        offsets = [int(x) for x in cu.reshape(-1).tolist()]
        if cu_seq_lens_k is not None and [int(x) for x in cu_seq_lens_k.reshape(-1).tolist()] != offsets:
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ; packed causal rows need the same offsets for both")
        if b != 1 or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != n:
            raise ValueError(f"cu_seq_lens_q must rise from 0 to the row length {n} of a single flattened row "
                             f"(batch size {b}), got {offsets[:8]}")
        found = (tuple(offsets[:-1]),)
    if isinstance(seq_idx, torch.Tensor):
        if seq_idx.shape[-1] != n or seq_idx.dim() > 2:
            raise ValueError(f"seq_idx must give the document of each of the {n} rows, (batch, rows); got shape "
                             f"{tuple(seq_idx.shape)}")
        from_ids = starts_of_ids(seq_idx.reshape(-1, n).expand(b, n))
        if found is not None and found != from_ids:
            raise ValueError("cu_seq_lens_q and seq_idx mark different documents; pass the ones the collator made "
                             "together")
        found = from_ids
    if not masked and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[-1] == n:
        from_positions = document_starts(position_ids.expand(b, n))
        if found is not None and found != from_positions:
            raise ValueError("position_ids and cu_seq_lens_q (or seq_idx) mark different documents; pass the ones the "
                             "collator made together")
        found = from_positions
    return check_documents(found, b, n)


def longest(documents: Documents, seq_len: int) -> int:
    """Rows of the longest document in any batch row."""
    best = 0
    for starts in documents:
        bounds = list(starts) + [seq_len]
        best = max(best, max(b - a for a, b in zip(bounds, bounds[1:])))
    return best


def _doc(starts: Sequence[int], row: int) -> int:
    return bisect_right(starts, row) - 1


def _bounds(starts: Sequence[int], d: int, seq_len: int) -> Tuple[int, int]:
    return starts[d], (starts[d + 1] if d + 1 < len(starts) else seq_len)


def reach(documents: Documents, seq_len: int, lo: int, hi: int) -> Tuple[int, int]:
    """First and last row of the documents (in any batch row) that hold rows ``lo`` and ``hi``."""
    first = min(s[_doc(s, lo)] for s in documents)
    last = max(_bounds(s, _doc(s, hi), seq_len)[1] - 1 for s in documents)
    return first, last


def key_span(documents: Documents, seq_len: int, q_lo: int, q_hi: int, k_lo: int, k_hi: int,
             causal: bool, window: Optional[int]) -> Optional[Tuple[int, int]]:
    """First and last key row in ``[k_lo, k_hi]`` that some query row in ``[q_lo, q_hi]`` may see, or None.

    A query may see a key of its own document (in some batch row), not later
    than itself when causal, and less than ``window`` rows back with a window.
    """
    first_key, last_key = None, None
    for starts in documents:
        lo_doc = max(_doc(starts, q_lo), _doc(starts, k_lo))
        hi_doc = min(_doc(starts, q_hi), _doc(starts, k_hi))
        for d in range(lo_doc, hi_doc + 1):
            start, stop = _bounds(starts, d, seq_len)
            a, b = max(q_lo, start), min(q_hi, stop - 1)  # the document's queries in the tile
            lo, hi = max(k_lo, start), min(k_hi, stop - 1)  # and its keys
            if causal:
                hi = min(hi, b)
            if window is not None:
                lo = max(lo, a - window + 1)
            if a > b or lo > hi:
                continue
            first_key = lo if first_key is None else min(first_key, lo)
            last_key = hi if last_key is None else max(last_key, hi)
    return None if first_key is None else (first_key, last_key)


def within_one(documents: Documents, q_lo: int, q_hi: int, k_lo: int, k_hi: int) -> bool:
    """Whether, in every batch row, all the query and key rows lie in a single document."""
    return all(_doc(s, q_lo) == _doc(s, q_hi) == _doc(s, k_lo) == _doc(s, k_hi) for s in documents)


def document_ids(documents: Documents, lo: int, count: int, device=None) -> Tensor:
    """``(B, count)``: the document of rows ``lo .. lo+count-1`` in each batch row."""
    rows = torch.arange(lo, lo + count, device=device)
    starts = [torch.tensor(s, dtype=torch.long, device=device) for s in documents]
    return torch.stack([torch.bucketize(rows, s, right=True) - 1 for s in starts])


def in_document_index(documents: Documents, lo: int, count: int, device=None) -> Tensor:
    """``(B, count)``: each row's index inside its document (row minus the document's start)."""
    rows = torch.arange(lo, lo + count, device=device)
    out = []
    for s in documents:
        starts = torch.tensor(s, dtype=torch.long, device=device)
        out.append(rows - starts[torch.bucketize(rows, starts, right=True) - 1])
    return torch.stack(out)


def same_document(documents: Documents, q_lo: int, nq: int, k_lo: int, nk: int, device=None) -> Tensor:
    """``(B, 1, nq, nk)`` bool: query row and key row lie in one document."""
    dq = document_ids(documents, q_lo, nq, device)
    dk = document_ids(documents, k_lo, nk, device)
    return (dq[:, :, None] == dk[:, None, :])[:, None]


def dilated_multiplicity(documents: Documents, q_lo: int, nq: int, k_lo: int, nk: int,
                         branches: Sequence[Tuple[int, int]], heads: range, causal: bool, device=None) -> Tensor:
    """``(B, len(heads), nq, nk)``: how many dilated branches allow each pair, counted inside documents.

    For branch ``(w, r)`` and query head h a pair is allowed when both rows
    lie in one document, in one segment ``i // w`` of in-document index i,
    both in-segment indices are ``h % r`` mod r, and (causal) the key is not
    later. ``i // w`` equals the whole-sequence rule ``i // min(w, L)`` for a
    document of length L, since ``i < L``.
    """
    same = same_document(documents, q_lo, nq, k_lo, nk, device)[:, 0]
    iq = in_document_index(documents, q_lo, nq, device)
    ik = in_document_index(documents, k_lo, nk, device)
    if causal:
        rows_q = torch.arange(q_lo, q_lo + nq, device=device)
        rows_k = torch.arange(k_lo, k_lo + nk, device=device)
        same = same & (rows_k[None, :] <= rows_q[:, None])[None]
    m = torch.zeros(len(documents), len(heads), nq, nk, dtype=torch.int32, device=device)
    for w, r in branches:
        seg = same & ((iq // w)[:, :, None] == (ik // w)[:, None, :])
        rq, rk = (iq % w) % r, (ik % w) % r
        for j, h in enumerate(heads):
            o = h % r
            m[:, j] += (seg & (rq == o)[:, :, None] & (rk == o)[:, None, :]).int()
    return m


DOCUMENT_TILE = 1024
"""Most rows per side of tiles over documents (the tile is about half the longest document)."""

DILATED_DOCUMENT_TILE = 512
"""Most rows per side of tiles of dilated attention over documents: each carries a per-head bias."""


def document_tile(documents: Documents, seq_len: int, dilated: bool) -> int:
    """Tile side over documents: about half the longest document, a multiple of 64, bounded.

    Work is then about ``n·(longest + 2·tile)`` pairs, whatever the number of documents.
    """
    half = -(-longest(documents, seq_len) // 2)
    side = max(64, -(-half // 64) * 64)
    return min(side, DILATED_DOCUMENT_TILE if dilated else DOCUMENT_TILE)
