"""Attention of new tokens over cached K/V rows held at arbitrary global positions.

A decode step gives every rank the same few new queries. Each rank attends
them over the cache rows it holds and gets a partial ``(out, lse)``; the ranks
merge those with one all-gather of ``B·H·S·(D+1)`` numbers per layer, never the
cache. Which keys a query sees follows the ring's rules (causal, sliding
window, dilated branches with per-head offsets) read from global positions,
so decoding token t reproduces row t of the full forward. Dense attention is
the one-branch pattern whose segment outlasts any position. Soft-capping
applies per block; attention sinks join once, after the ranks' partials merge.
Packed documents are not supported here (a cache holds one sequence per row).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .blocks import allowed_pairs
from .checks import check_sinks, check_softcap
from .comm import RingComm
from .kernels import block_forward
from .merge import accumulator_dtype, add_sinks, merge_into, merge_stacked
from .pattern import DENSE, head_groups, head_slice

Tensor = torch.Tensor


@dataclass(frozen=True)
class CachedBlock:
    """Query heads ``q_heads`` (K/V heads ``kv_heads``) of query rows ``q_rows`` against cache rows ``k_rows``.

    ``None`` rows mean all of them; ``mask`` is ``(len(q_rows), len(k_rows))``
    bool (True = allowed), ``None`` when every pair is allowed.
    """

    q_heads: range
    kv_heads: range
    q_rows: Optional[Tensor]
    k_rows: Optional[Tensor]
    mask: Optional[Tensor]


def cached_blocks(
    q_pos: Tensor, k_pos: Tensor, *, hq: int, hkv: int, causal: bool = True,
    window: Optional[int] = None, branches: Sequence[Tuple[int, int]] = DENSE, documents=None, head_offset: int = 0,
) -> List[CachedBlock]:
    """Kernel calls that attend queries at global positions ``q_pos`` over keys at ``k_pos``.

    Pure index math on position tensors: for branch ``(w, r)`` and head
    offset ``o`` a query takes part when its in-segment index is ``o`` mod
    ``r``, and sees the keys of its own segment with the same residue (and
    ``k <= t``, ``k > t - window`` as asked). Segments are ``p // w``: for any
    position below the sequence length that equals the full forward's
    ``p // min(w, N)``, so a cache gives the same rows as the whole sequence.
    ``documents`` must be None: decoding over a cache holds one document per row.
    ``head_offset``: the pattern's number of the first query head given (the
    heads of one K/V head whose rows are kept apart); returned heads count from 0.
    """
    check_no_documents(documents)
    blocks: List[CachedBlock] = []
    nq, nk = q_pos.numel(), k_pos.numel()
    if nq == 0 or nk == 0:
        return blocks
    if _every_pair_allowed(q_pos, k_pos, causal, window, branches):
        return [CachedBlock(q_heads, kv_heads, None, None, None) for q_heads, kv_heads in head_groups(hq, hkv, 1, 0)]
    if nq == 1:
        return _one_query_blocks(int(q_pos[0]), k_pos, hq, hkv, causal, window, branches, head_offset)
    for w, rate in branches:
        q_seg, k_seg = q_pos // w, k_pos // w
        q_res, k_res = (q_pos % w) % rate, (k_pos % w) % rate
        for offset in sorted(set(q_res.tolist())):  # only the residues some query has take part
            groups = head_groups(hq, hkv, rate, (offset - head_offset) % rate)
            if not groups:
                continue
            qi = torch.nonzero(q_res == offset).flatten()
            if qi.numel() == 0:
                continue
            qp, qs = q_pos[qi], q_seg[qi]
            keep = (k_res == offset) & (k_seg >= qs.min()) & (k_seg <= qs.max())
            if causal:
                keep &= k_pos <= qp.max()
            if window is not None:
                keep &= k_pos > qp.min() - window
            ki = torch.nonzero(keep).flatten()
            if ki.numel() == 0:
                continue
            kp = k_pos[ki]
            allowed = (qs[:, None] == k_seg[ki][None, :]) & allowed_pairs(qp, kp, causal, window)
            if not bool(allowed.any()):
                continue
            mask = None if bool(allowed.all()) else allowed
            q_rows = None if qi.numel() == nq else qi
            k_rows = None if ki.numel() == nk else ki
            for q_heads, kv_heads in groups:
                blocks.append(CachedBlock(q_heads, kv_heads, q_rows, k_rows, mask))
    return blocks


def _one_query_blocks(t: int, k_pos: Tensor, hq: int, hkv: int, causal: bool, window: Optional[int],
                      branches: Sequence[Tuple[int, int]], head_offset: int) -> List[CachedBlock]:
    """:func:`cached_blocks` of one query, a decoding step's usual case.

    The query's segment and residue are integers, so a branch whose residue
    none of the given heads uses costs no tensor operation, and every key
    kept for a branch is allowed (no pair mask).
    """
    blocks: List[CachedBlock] = []
    for w, rate in branches:
        start = t // w * w
        offset = (t - start) % rate
        groups = head_groups(hq, hkv, rate, (offset - head_offset) % rate)
        if not groups:
            continue
        lo = start if window is None else max(start, t - window + 1)
        keep = (k_pos >= lo) & (k_pos < start + w) & ((k_pos - start) % rate == offset)
        if causal:
            keep &= k_pos <= t
        ki = torch.nonzero(keep).flatten()
        if ki.numel() == 0:
            continue
        k_rows = None if ki.numel() == k_pos.numel() else ki
        blocks.extend(CachedBlock(q_heads, kv_heads, None, k_rows, None) for q_heads, kv_heads in groups)
    return blocks


def _every_pair_allowed(q_pos: Tensor, k_pos: Tensor, causal: bool, window: Optional[int],
                        branches: Sequence[Tuple[int, int]]) -> bool:
    """One undilated branch whose single segment holds every query and key, all of them visible.

    The usual decoding step of dense attention: the general path would find
    the same one unmasked call per head group, but through about ten passes
    over the cache's positions (a millisecond per step at 32K rows); this
    needs one.
    """
    if len(branches) != 1 or branches[0][1] != 1:
        return False
    w = branches[0][0]
    k_lo, k_hi = (int(x) for x in torch.aminmax(k_pos))
    q_lo, q_hi = (int(x) for x in torch.aminmax(q_pos))
    if min(k_lo, q_lo) // w != max(k_hi, q_hi) // w:
        return False
    if causal and k_hi > q_lo:
        return False
    return window is None or k_lo > q_hi - window


def check_no_documents(documents) -> None:
    """Decoding keeps one sequence per batch row; packed documents are refused rather than mixed."""
    if documents is not None:
        raise ValueError(
            "decoding over a KV cache does not support packed documents (several documents in one row); "
            "give each document its own batch row (with padding) when generating"
        )


def _block_mask(blk: CachedBlock, key_mask: Optional[Tensor], pair_mask: Optional[Tensor], sq: int,
                device) -> Optional[Tensor]:
    """The block's mask with key padding and a per-sample pair mask folded in: ``(S_q, S_k)``, ``(B, 1, S_q, S_k)`` or None."""
    mask = None if blk.mask is None else blk.mask.to(device)
    if pair_mask is not None:
        pm = pair_mask.to(device)
        if blk.q_rows is not None:
            pm = pm[:, :, blk.q_rows.to(device)]
        if blk.k_rows is not None:
            pm = pm[..., blk.k_rows.to(device)]
        mask = pm if mask is None else pm & mask
    if key_mask is None:
        return mask
    keys = key_mask if blk.k_rows is None else key_mask[:, blk.k_rows.to(key_mask.device)]
    if bool(keys.all()):
        return mask
    pad = keys[:, None, None, :].expand(-1, 1, sq, -1).to(device)
    return pad if mask is None else pad & mask


def cached_attention(
    q: Tensor, k: Tensor, v: Tensor, blocks: Sequence[CachedBlock], *, scale: float,
    key_mask: Optional[Tensor] = None, pair_mask: Optional[Tensor] = None, softcap: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """This process's partial attention: ``out`` ``(B, Hq, S, D_v)`` (fp32, fp64 for fp64) and ``lse`` ``(B, Hq, S)``.

    ``k``/``v`` are the cache rows ``(B, Hkv, L, D)`` and ``(B, Hkv, L, D_v)``; ``key_mask`` ``(B, L)``
    bool marks the rows that may be attended (False for padding);
    ``pair_mask`` ``(B, 1, S, L)`` bool, when given, further restricts which
    query may see which row (a KV cache's own mask). A query with no allowed
    row here gets ``(0, -inf)``, which a merge ignores. ``softcap`` caps the
    scores (``softcap·tanh(s/softcap)``) before masking.
    """
    softcap = check_softcap(softcap)
    b, hq, s, _ = q.shape
    acc = accumulator_dtype(q)
    if len(blocks) == 1 and blocks[0].q_rows is None and blocks[0].q_heads == range(hq):
        out, lse = _attend_block(q, k, v, blocks[0], scale, key_mask, pair_mask, softcap)
        return out.to(acc), lse  # the usual dense step: nothing to merge it with
    out = torch.zeros(b, hq, s, v.shape[3], dtype=acc, device=q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)
    for blk in blocks:
        hs = head_slice(blk.q_heads)
        o_blk, l_blk = _attend_block(q, k, v, blk, scale, key_mask, pair_mask, softcap)
        if blk.q_rows is None:
            merge_into(out[:, hs], lse[:, hs], o_blk, l_blk)
        else:
            rows = blk.q_rows.to(q.device)
            o_sub, l_sub = out[:, hs][:, :, rows], lse[:, hs][:, :, rows]
            merge_into(o_sub, l_sub, o_blk, l_blk)
            out[:, hs, rows], lse[:, hs, rows] = o_sub, l_sub
    return out, lse


def _attend_block(q: Tensor, k: Tensor, v: Tensor, blk: CachedBlock, scale: float, key_mask: Optional[Tensor],
                  pair_mask: Optional[Tensor], softcap: Optional[float]) -> Tuple[Tensor, Tensor]:
    """One block's ``(out, lse)``: its heads, query and cache rows and mask taken from the whole tensors."""
    qb, kb, vb = q[:, head_slice(blk.q_heads)], k[:, head_slice(blk.kv_heads)], v[:, head_slice(blk.kv_heads)]
    if blk.q_rows is not None:
        qb = qb[:, :, blk.q_rows.to(q.device)]
    if blk.k_rows is not None:
        rows = blk.k_rows.to(k.device)
        kb, vb = kb.index_select(2, rows), vb.index_select(2, rows)
    mask = _block_mask(blk, key_mask, pair_mask, qb.shape[2], q.device)
    return _grouped_forward(qb, kb, vb, scale, mask, softcap)


def _grouped_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Optional[Tensor],
                     softcap: Optional[float]) -> Tuple[Tensor, Tensor]:
    """:func:`block_forward` with the query heads that share a K/V head run as that head's rows.

    A decoding step's few queries read the whole cache: given as ``g`` query
    heads per K/V head, a kernel reads each cached row ``g`` times; as ``g·S``
    rows of one head it reads it once (a quarter to a third off the CPU
    kernel's time at ``g = 2``, ``python -m bench generate``). The rows keep
    their mask; a head's own scores are unchanged.
    """
    b, hq, s, d = q.shape
    g = hq // k.shape[1]
    if g == 1:
        return block_forward(q, k, v, scale=scale, mask=mask, softcap=softcap)
    if mask is not None:
        mask = mask.repeat(g, 1) if mask.dim() == 2 else mask.repeat(1, 1, g, 1)
    out, lse = block_forward(q.reshape(b, k.shape[1], g * s, d), k, v, scale=scale, mask=mask, softcap=softcap)
    return out.reshape(b, hq, s, v.shape[3]), lse.reshape(b, hq, s)


def merge_partials(outs: Tensor, lses: Tensor) -> Tensor:
    """Log-sum-exp merge of stacked partial results ``outs`` ``(P, B, H, S, D)``, ``lses`` ``(P, B, H, S)``.

    Queries no partial could attend come out as 0.
    """
    return merge_stacked(outs, lses)[0]


class RanksDivergedError(ValueError):
    """The ranks of one :func:`hf_ring.generate` call fed different tokens to the model."""

    def __init__(self, what: str):
        super().__init__(
            f"{what}: their logits differed although every rank computed them from the same numbers, which "
            "happens when ranks run on different hardware or thread counts. Pass broadcast_logits=True to "
            "hf_ring.generate to take rank 0's logits on every rank"
        )


def _id_halves(ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Token ids as two 16-bit halves, exact in any float dtype the partials travel in."""
    ids = ids.reshape(-1).to(torch.long)
    return torch.cat([ids >> 16, ids & 0xFFFF]).to(dtype)


MERGE_WHAT = "the decode merge across ranks"
"""How errors and timings name the decode merge's exchange."""


def merge_ranks(out: Tensor, lse: Tensor, comm: Optional[RingComm], sinks: Optional[Tensor] = None,
                same_ids: Optional[Tensor] = None) -> Tensor:
    """Every rank's partial ``(out, lse)`` merged: one all-gather, bitwise the same result on every rank.

    Each rank merges the gathered partials in rank order, so all hold the same
    numbers. ``sinks`` ``(Hq,)`` (one logit per query head, zero value) join
    the merged result once, so generation matches the full forward.
    ``same_ids``: token ids every rank must hold alike (the tokens this step
    runs, which each rank picked from its own logits); they ride in the same
    all-gather, and ranks that differ raise :class:`RanksDivergedError` on
    every rank.
    """
    sinks = check_sinks(sinks, out.shape[1])
    if comm is not None and comm.world_size > 1:
        packed = torch.cat([out, lse.to(out.dtype).unsqueeze(-1)], dim=-1).reshape(-1)
        extra = 0
        if same_ids is not None:
            ids = _id_halves(same_ids, packed.dtype).to(packed.device)
            extra = ids.numel()
            packed = torch.cat([packed, ids])
        parts = comm.all_gather(packed, MERGE_WHAT)
        if extra:
            got = parts[:, parts.shape[1] - extra:]
            if not bool((got == got[0]).all()):
                differ = [r for r in range(parts.shape[0]) if not bool((got[r] == got[0]).all())]
                raise RanksDivergedError(
                    f"the ranks ran different tokens at this decoding step (ranks {differ} differ from rank 0)")
            parts = parts[:, : parts.shape[1] - extra]
        parts = parts.view(parts.shape[0], *out.shape[:-1], out.shape[-1] + 1)
        out, lse = merge_stacked(parts[..., :-1], parts[..., -1])
    if sinks is not None:
        out, _ = add_sinks(out, lse, sinks)
    return out
