"""One block's attention on CUDA with torch's fused kernels: flash and memory-efficient, forward and backward.

Every function here is aten calls and views of its inputs: no Python
indexing, no ``copy_``, no repeated K/V. A GPU wants that anyway, and it is
what lets these functions run under ``FakeTensorMode`` on a CPU-only build,
where the tests check which kernel each block kind takes and what it is given.

Tensors come and go as the ring holds them, ``(B, H, S, D)`` views whose
last dimension is contiguous (strided rows and heads of a dilated branch
included); the kernels read ``(B, S, H, D)``, which is a transpose of the
same memory.

- **Flash** (fp16/bf16, head_dim a multiple of 8 up to 256): grouped-query
  attention natively (query head h reads K/V head ``h // (Hq/Hkv)``), the
  diagonal block's causal mask, and any *band* of allowed key offsets
  (``lo <= j - i <= hi``: causal and sliding-window blocks across shard
  borders, strided dilated rows) through the kernel's window sizes.
- **Memory-efficient** (fp32, fp16, bf16): anything with a mask (padding,
  packed documents, dilated multiplicities as a ``log m`` bias). The mask
  becomes an additive bias of the block's own size, the one tile the ring
  cut. The kernel takes equal head counts, so grouped-query blocks run one
  call per member of a query-head group, each over a strided view of its
  query heads against all K/V heads: K/V are never repeated.

The contracts that these kernels check at run time, and that fake tensors
do not, hold on every call: q, k, v, out and dout share one dtype
and have ``stride(-1) == 1``; a backward's logsumexp is fp32, 3-D and
contiguous; a dense flash backward gets ``cum_seq_q/k = None``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
aten = torch.ops.aten

Band = Tuple[Optional[int], int]
"""``(lo, hi)``: key ``j`` of a block is allowed for query ``i`` iff ``lo <= j - i <= hi``; ``lo=None`` is unbounded."""

FLASH_DTYPES = (torch.float16, torch.bfloat16)
EFFICIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_FLASH_HEAD_DIM = 256
BIAS_ALIGN = 16
"""The efficient kernel reads a bias whose row stride is a multiple of 16 elements (as torch's SDPA pads it)."""
LSE_ALIGN = 32
"""The efficient kernel's logsumexp has its rows padded to a multiple of 32."""

_INF = float("inf")


def flash_supports(q: Tensor) -> bool:
    """Whether torch's flash kernel takes blocks of ``q``'s dtype and head size."""
    d = q.shape[-1]
    return q.dtype in FLASH_DTYPES and d % 8 == 0 and d <= MAX_FLASH_HEAD_DIM


def efficient_supports(q: Tensor) -> bool:
    """Whether torch's memory-efficient kernel takes blocks of ``q``'s dtype and head size."""
    return q.dtype in EFFICIENT_DTYPES and q.shape[-1] % 8 == 0


def check_contract(q: Tensor, k: Tensor, v: Tensor, *others: Tensor, lse: Optional[Tensor] = None) -> None:
    """Raise when an argument breaks what the fused kernels require (they would refuse it, or read it wrongly)."""
    for name, t in [("q", q), ("k", k), ("v", v)] + [(f"argument {i + 4}", t) for i, t in enumerate(others)]:
        if t.dtype != q.dtype:
            raise RuntimeError(f"hf_ring: a fused kernel got {name} in {t.dtype} beside q in {q.dtype}")
        if t.stride(-1) != 1:
            raise RuntimeError(f"hf_ring: a fused kernel got {name} with a non-contiguous last dimension")
    if lse is not None and (lse.dtype != torch.float32 or lse.dim() != 3 or not lse.is_contiguous()):
        raise RuntimeError("hf_ring: a fused backward needs its logsumexp fp32, (B, H, S) and contiguous")


def band_cut(sq: int, sk: int, lo: Optional[int], hi: int) -> Optional[Tuple[int, int, int, int, int, int]]:
    """The part of a ``sq x sk`` block where band ``(lo, hi)`` allows pairs, as flash's window sizes.

    Flash aligns its window to the bottom-right corner: key ``j`` is allowed
    for query ``i`` iff ``-left <= j - i - (sk - sq) <= right``, each side
    either ``>= 0`` or unbounded. Returns ``(i0, nq, k0, nk, left, right)``:
    query rows ``i0 .. i0+nq-1`` and keys ``k0 .. k0+nk-1`` (the rows that see
    a key and the keys that are seen), with ``left = -1`` for an unbounded
    band; None when no pair is allowed. Rows outside get ``(0, -inf)``.
    """
    lo_eff = -sq if lo is None else lo  # j - i > -sq always holds
    i0 = max(0, -hi)
    i1 = min(sq - 1, sk - 1 - lo_eff)
    if i0 > i1 or hi < lo_eff:
        return None
    k0 = max(0, i0 + lo_eff)
    k1 = min(sk - 1, i1 + hi)
    if k0 > k1:
        return None
    nq, nk = i1 - i0 + 1, k1 - k0 + 1
    right = hi + i0 - k0 - (nk - nq)
    left = -1 if lo is None else (nk - nq) - (lo + i0 - k0)
    return i0, nq, k0, nk, left, right


def _rows_first(x: Tensor) -> Tensor:
    return x.transpose(1, 2)


def _heads(x: Tensor, first: int, step: int) -> Tensor:
    """Heads ``first, first+step, ...`` of a ``(B, H, ...)`` tensor, as a view."""
    return x if step == 1 else aten.slice.Tensor(x, 1, first, None, step)


def _packed_heads(x: Tensor) -> Tensor:
    """``x`` with heads ``D`` elements apart in memory: the efficient backward reads out and dout that way."""
    rows = _rows_first(x)
    if rows.stride(2) == x.shape[-1] or x.shape[1] == 1:
        return x
    return _rows_first(rows.clone(memory_format=torch.contiguous_format))


def _pad_rows(x: Tensor, start: int, total: int, dim: int, value: float) -> Tensor:
    """``x`` placed at ``start`` of ``total`` rows along ``dim``, the other rows filled with ``value``."""
    after = total - start - x.shape[dim]
    if start == 0 and after == 0:
        return x
    parts = []
    for rows in (start, None, after):
        if rows is None:
            parts.append(x)
        elif rows:
            shape = list(x.shape)
            shape[dim] = rows
            parts.append(torch.full(shape, value, dtype=x.dtype, device=x.device))
    return torch.cat(parts, dim)


def _flash_windows(left: int, right: int) -> dict:
    return {"window_size_left": None if left < 0 else left, "window_size_right": None if right < 0 else right}


def flash_forward(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool = False,
                  band: Optional[Band] = None) -> Tuple[Tensor, Tensor]:
    """``(out (B, Hq, S_q, D) in q's dtype, lse fp32 (B, Hq, S_q))`` of one block by the flash kernel.

    ``causal``: the diagonal block (both sides the same positions); ``band``:
    the allowed key offsets of any other partially visible block.
    """
    sq = q.shape[2]
    i0, k0, left, right = 0, 0, -1, -1
    if band is not None:
        cut = band_cut(sq, k.shape[2], *band)
        if cut is None:
            return empty_result(q)
        i0, nq, k0, nk, left, right = cut
        q, k, v = q.narrow(2, i0, nq), k.narrow(2, k0, nk), v.narrow(2, k0, nk)
    check_contract(q, k, v)
    res = aten._flash_attention_forward(
        _rows_first(q), _rows_first(k), _rows_first(v), None, None, q.shape[2], k.shape[2], 0.0, causal, False,
        scale=scale, **_flash_windows(left, right))
    out, lse = _rows_first(res[0]), res[1]
    lse = lse.masked_fill(torch.isposinf(lse), -_INF)  # flash reports +inf for a row that saw no key
    return _pad_rows(out, i0, sq, 2, 0.0), _pad_rows(lse, i0, sq, 2, -_INF)


def flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, scale: float,
                   causal: bool = False, band: Optional[Band] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block by the flash kernel, given the merged ``out`` and ``lse`` of the whole attention.

    ``lse`` is +inf on rows that saw no key anywhere, so they add nothing.
    """
    sq, sk = q.shape[2], k.shape[2]
    i0, k0, left, right = 0, 0, -1, -1
    if band is not None:
        cut = band_cut(sq, sk, *band)
        if cut is None:
            return empty_grads(q, k)
        i0, nq, k0, nk, left, right = cut
        dout, q, out, lse = dout.narrow(2, i0, nq), q.narrow(2, i0, nq), out.narrow(2, i0, nq), lse.narrow(2, i0, nq)
        k, v = k.narrow(2, k0, nk), v.narrow(2, k0, nk)
    if not lse.is_contiguous():  # the kernel reads it as contiguous rows: a strided slice would be read wrongly
        lse = lse.clone(memory_format=torch.contiguous_format)
    check_contract(q, k, v, out, dout, lse=lse)
    rng = torch.empty(2, dtype=torch.uint64, device=q.device)  # read only with dropout, which is never used
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = aten._flash_attention_backward(
        _rows_first(dout), _rows_first(q), _rows_first(k), _rows_first(v), _rows_first(out), lse, None, None,
        q.shape[2], k.shape[2], 0.0, causal, rng, unused, scale=scale, **_flash_windows(left, right))
    return (_pad_rows(_rows_first(dq), i0, sq, 2, 0.0), _pad_rows(_rows_first(dk), k0, sk, 2, 0.0),
            _pad_rows(_rows_first(dv), k0, sk, 2, 0.0))


def aligned_bias(mask: Tensor, b: int, h: int, sq: int, sk: int, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = allowed) or float bias as the efficient kernel reads a bias: ``(B, H, S_q, S_k)``.

    In ``dtype``, rows padded to a multiple of :data:`BIAS_ALIGN`, broadcast
    dimensions as stride-0 views: its memory is the mask's own, one tile.
    """
    if mask.dim() == 2:
        mask = mask.view(1, 1, sq, sk)
    if mask.is_floating_point():
        bias = mask.to(dtype)
    else:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask.logical_not(), -_INF)
    pad = (-sk) % BIAS_ALIGN
    if pad:
        bias = F.pad(bias, (0, pad)).narrow(-1, 0, sk)
    return bias.expand(b, h, sq, sk)


def _seen(mask: Tensor) -> Tensor:
    """Which query rows of a mask or bias have an allowed key, shaped to broadcast over ``(B, H, S_q)``."""
    seen = mask.any(-1) if not mask.is_floating_point() else torch.isneginf(mask).all(-1).logical_not()
    return seen if seen.dim() == 3 else seen.view(1, 1, -1)


def efficient_forward(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool = False,
                      mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(out, lse)`` of one block by the memory-efficient kernel; ``mask`` bool or float, as ``block_forward`` takes it."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    bias = None if mask is None else aligned_bias(mask, b, hq, sq, sk, q.dtype)
    check_contract(q, k, v)
    outs: List[Tensor] = []
    lses: List[Tensor] = []
    for j in range(g):  # query heads j, j+g, ... read K/V heads 0, 1, ...: one call each, K/V as they are
        res = aten._scaled_dot_product_efficient_attention(
            _heads(q, j, g), k, v, None if bias is None else _heads(bias, j, g), True, 0.0, causal, scale=scale)
        outs.append(res[0])
        lses.append(res[1].narrow(2, 0, sq))
    out, lse = (outs[0], lses[0]) if g == 1 else (
        torch.stack(outs, 2).reshape(b, hq, sq, d), torch.stack(lses, 2).reshape(b, hq, sq))
    if mask is not None:  # rows with no allowed key: (0, -inf), whatever the kernel made of them
        seen = _seen(mask)
        out = torch.where(seen.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        lse = lse.masked_fill(seen.logical_not(), -_INF)
    return out, lse


def efficient_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, scale: float,
                       causal: bool = False, mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block by the memory-efficient kernel, given the merged ``out`` and ``lse``."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    bias = None if mask is None else aligned_bias(mask, b, hq, sq, sk, q.dtype)
    # The kernel reads LSE rows padded to a multiple of 32, contiguous.
    padded = F.pad(lse, (0, (-sq) % LSE_ALIGN), value=_INF)
    seed = torch.empty((), dtype=torch.int64, device=q.device)  # read only with dropout, which is never used
    offset = torch.empty((), dtype=torch.int64, device=q.device)
    dqs: List[Tensor] = []
    dk = dv = None
    for j in range(g):
        lse_j = _heads(padded, j, g)
        if not lse_j.is_contiguous():
            lse_j = lse_j.clone(memory_format=torch.contiguous_format)
        q_j, dout_j, out_j = _heads(q, j, g), _packed_heads(_heads(dout, j, g)), _packed_heads(_heads(out, j, g))
        check_contract(q_j, k, v, out_j, dout_j, lse=lse_j)
        gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout_j, q_j, k, v, None if bias is None else _heads(bias, j, g), out_j, lse_j, seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale)
        dqs.append(gq)
        dk, dv = (gk, gv) if dk is None else (dk + gk, dv + gv)
    dq = dqs[0] if g == 1 else torch.stack(dqs, 2).reshape(b, hq, sq, d)
    return dq, dk, dv


def empty_result(q: Tensor) -> Tuple[Tensor, Tensor]:
    """``(0, -inf)`` for every query row: a block in which no pair is allowed."""
    b, h, s, d = q.shape
    return (torch.zeros((b, h, s, d), dtype=q.dtype, device=q.device),
            torch.full((b, h, s), -_INF, dtype=torch.float32, device=q.device))


def empty_grads(q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    return (torch.zeros(q.shape, dtype=q.dtype, device=q.device), torch.zeros(k.shape, dtype=k.dtype, device=k.device),
            torch.zeros(k.shape, dtype=k.dtype, device=k.device))
