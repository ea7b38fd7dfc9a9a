"""What one attention computes, frozen: built and checked once per call, then passed whole.

The public entry points (:func:`hf_ring.ring_attention`, the ``ring_dilated``
backend) turn their arguments into one :class:`AttentionSpec`
(:func:`hf_ring.engine.checks.check_spec`); the ring, head parallelism, the
schedule and the kernels read it and never re-derive it. A spec is the same
on every rank of a ring (the ranks agree on it before any K/V row moves)
and for every layer of a kind.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from .documents import Documents
from .pattern import DENSE, Branches, DilatedPattern, branches_of
from .spans import Spans

Tensor = torch.Tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes ring attention runs in (their index is what the agreement compares)."""


@dataclass(frozen=True)
class AttentionSpec:
    """One attention's semantics and placement.

    ``window=W``: query t sees keys ``t-W < k <= t``; ``pattern``: dilated
    attention (None is exact dense attention); ``softcap``: scores become
    ``softcap·tanh(s/softcap)``; ``sinks`` ``(Hq,)``: one logit per query head
    joins the softmax denominator; ``key_mask`` ``(B, S_local)`` bool: the keys
    that may be attended (None when no rank has padding); ``documents``: the
    global start rows of the documents packed into each batch row (None: one
    sequence per row); ``spans``: per batch row, the runs of global rows
    whose pairs attend both ways on top of causality (an image's tokens, a
    prefix; see :mod:`hf_ring.engine.spans`); ``layout``: how the rows are spread over the ranks;
    ``seq_len``: the global rows (None until the ranks agree on it);
    ``message_rows``: K/V rows per ring message (None: the default);
    ``head_base``: the global index of the first local query head (head and
    tensor parallelism give a rank a slice of the heads, and a head's dilation
    offset counts from its global index).
    """

    scale: float
    causal: bool = True
    window: Optional[int] = None
    pattern: Optional[DilatedPattern] = None
    softcap: Optional[float] = None
    layout: str = "zigzag"
    seq_len: Optional[int] = None
    documents: Optional[Documents] = None
    spans: Optional[Spans] = None
    message_rows: Optional[int] = None
    head_base: int = 0
    key_mask: Optional[Tensor] = field(default=None, compare=False, repr=False)
    sinks: Optional[Tensor] = field(default=None, compare=False, repr=False)

    @property
    def branches(self) -> Branches:
        """The ``(segment, rate)`` branches the schedule plans for (``DENSE`` without a pattern)."""
        return branches_of(self.pattern)

    @property
    def dilated_in_documents(self) -> bool:
        """Dilation counted from each document's start: a dense plan with a per-tile multiplicity bias."""
        return self.documents is not None and self.pattern is not None

    @property
    def planned_branches(self) -> Branches:
        """The branches the ring's plan takes: inside documents dilation rides a bias, so the plan is dense."""
        return DENSE if self.dilated_in_documents else self.branches

    def at(self, **changes) -> "AttentionSpec":
        """The same spec with ``changes`` (e.g. the agreed ``seq_len``, a rank's ``head_base``)."""
        return replace(self, **changes)
