"""What one block of the ring hands the kernels: its parts under key padding, and its mask or band.

A block's mask comes from causality and a window (a band where the kernel takes
one), packed documents (a same-document mask, or for dilation inside documents
the bias ``log m``, m the branches allowing a pair), bidirectional spans (a
span's block holds only the pairs causality leaves out) and the keys' padding.
Every block gets the same keywords whichever of these apply.
"""
from __future__ import annotations

from typing import Optional

import torch

from .blocks import KeyValidity, Progression, band_of, block_mask, padding_parts
from .documents import dilated_multiplicity, same_document, within_one
from .schedule import Block
from .spans import extra_pairs
from .spec import AttentionSpec

Tensor = torch.Tensor

PADDED_TILE = 2048
"""Rows per side of the tiles a block is cut into where padding starts or ends inside it: only those tiles
need a built mask, which whole-shard blocks would make quadratic in the shard. Blocks whose keys are all
valid run unmasked and whole, blocks whose keys are all padding are skipped."""


def block_parts(spec: AttentionSpec, blk: Block, mask: Optional[Tensor], valid: Optional[KeyValidity],
                 tile: Optional[int]):
    """What one block computes under the call's padding (:func:`blocks.padding_parts`)."""
    keys = Progression(blk.k_off * blk.q.stride, blk.k_pos, blk.nk, blk.q.stride)
    return padding_parts(blk.q, keys, blk.kind, spec.causal, spec.window, valid, mask, tile, PADDED_TILE,
                         spec.documents is None)


def _call(causal: bool, mask: Optional[Tensor], softcap: Optional[float], band=None) -> dict:
    """A block's keywords for the kernels beside ``scale``: the same keys whichever way the block is masked."""
    return {"causal": causal, "mask": mask, "softcap": softcap, "band": band}


def kernel_args(spec: AttentionSpec, q: Progression, k_pos: int, nk: int, kind: str, device,
                 key_valid: Optional[Tensor] = None, heads: Optional[range] = None) -> Optional[dict]:
    """Kernel arguments of one block (``heads``: its query heads); ``key_valid`` ``(B, nk)`` adds key padding.

    None when documents leave the block no allowed pair.
    """
    docs = spec.documents
    if kind == "span":  # spans lie inside documents: only the key padding joins their pairs
        step = q.stride
        mask = extra_pairs(spec.spans, torch.arange(q.pos, q.pos + q.count * step, step, device=device),
                           torch.arange(k_pos, k_pos + nk * step, step, device=device), spec.causal, spec.window)
        if key_valid is not None:
            mask = mask & key_valid[:, None, None, :]
        return _call(False, mask, spec.softcap) if bool(mask.any()) else None
    if spec.dilated_in_documents:
        heads = range(heads.start + spec.head_base, heads.stop + spec.head_base, heads.step)
        m = dilated_multiplicity(docs, q.pos, q.count, k_pos, nk, spec.pattern.branches, heads, spec.causal, device)
        if key_valid is not None:
            m = m * key_valid[:, None, None, :]
        if not bool(m.any()):
            return None
        return _call(False, torch.log(m.to(torch.float32)), spec.softcap)
    doc_mask = None
    if docs is not None and not within_one(docs, q.pos, q.last_pos, k_pos, k_pos + nk - 1):
        doc_mask = same_document(docs, q.pos, q.count, k_pos, nk, device)
    if key_valid is None and doc_mask is None:
        band = band_of(q, k_pos, spec.causal, spec.window) if kind == "mask" else None
        return _call(kind == "causal", None, spec.softcap, band)
    mask = block_mask(q, k_pos, nk, kind, spec.causal, spec.window, device)
    if key_valid is not None:
        mask = mask[None, None] & key_valid[:, None, None, :]
    if doc_mask is not None:
        mask = mask & doc_mask
        if not bool(mask.any()):
            return None
    return _call(False, mask, spec.softcap)
