"""Local block attention that returns ``(out, lse)``, and its backward.

A block is one (query rows, key rows) pair. ``causal=True`` means the two row
sets hold the same positions (the diagonal block) so the kernel's top-left
causal mask is right; any other partial mask is passed as a boolean ``mask``
of shape ``(S_q, S_k)``, or ``(B, 1, S_q, S_k)`` with key padding (True = may
attend), or as a float additive bias ``(B, 1 or Hq, S_q, S_k)`` (-inf = masked;
dilated attention inside documents adds ``log m``). Rows with no allowed key get
``out = 0`` and ``lse = -inf`` so they vanish in a log-sum-exp merge.
``softcap`` caps the scores, ``cap·tanh(s/cap)``, before the mask (Gemma 2).

Backends: on CPU the fused aten flash kernels; on CUDA torch's flash kernel
for unmasked fp16/bf16 blocks; otherwise (and always with ``softcap``, which
the fused kernels cannot apply) an exact math path in fp32 (or fp64 for fp64
inputs) that never expands K/V to the query-head count.
"""
from __future__ import annotations

import math
import warnings
from typing import List, Optional, Tuple

import torch

from .blocks import allowed_pairs

Tensor = torch.Tensor

_NEG_INF = float("-inf")


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _backend(q: Tensor, mask: Optional[Tensor], softcap: Optional[float] = None) -> str:
    if softcap is not None:
        return "math"
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        return "cpu_flash"
    if q.device.type == "cuda" and mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return "cuda_flash"
    return "math"


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.is_floating_point():
        return mask.to(dtype)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~mask, _NEG_INF)


def accumulator_dtype(x: Tensor) -> torch.dtype:
    """Partial results and merges run in fp32 whatever the input, fp64 for fp64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _grouped(mask: Tensor, b: int, hkv: int) -> Tensor:
    """A ``(S_q, S_k)``, ``(B, 1, S_q, S_k)`` or ``(B, Hq, S_q, S_k)`` mask laid out like grouped scores."""
    if mask.dim() != 4:
        return mask
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.reshape(mask.shape[0], hkv, mask.shape[1] // hkv, *mask.shape[2:])


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool, mask: Optional[Tensor],
            softcap: Optional[float] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Masked scores ``(B, Hkv, G, S_q, S_k)`` (query heads grouped under their K/V head).

    With ``softcap`` also ``tanh(s/cap)`` of the raw scores, whose derivative the backward needs.
    """
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    dt = accumulator_dtype(q)
    qg = q.to(dt).reshape(b, hkv, hq // hkv, sq, d)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.to(dt)) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, _NEG_INF)
    if mask is not None:
        m = _grouped(mask, b, hkv)
        s = s + m.to(dt) if m.is_floating_point() else s.masked_fill(~m, _NEG_INF)
    return s, t


MATH_TILE = 1024
"""Rows per side of the math path's tiles: it materialises scores, so its memory stays ~B·H·tile²
whatever the block (a CUDA block of a whole 32K shard would otherwise need tens of GB)."""


def _row_tiles(n: int) -> List[slice]:
    return [slice(i, min(i + MATH_TILE, n)) for i in range(0, n, MATH_TILE)]


def _tile_args(causal: bool, mask: Optional[Tensor], qs: slice, ks: slice,
               device) -> Optional[Tuple[bool, Optional[Tensor]]]:
    """``(causal, mask)`` of the tile ``qs x ks`` of a block, or None when no pair in it is allowed.

    A block's ``causal`` is top-left aligned (both sides hold the same
    positions), so only a diagonal tile keeps it; other tiles get it as a mask.
    """
    sub = None if mask is None else mask[..., qs, ks]
    if not causal or qs == ks:
        return causal, sub
    if ks.start >= qs.stop:
        return None
    if ks.stop - 1 <= qs.start:
        return False, sub
    allowed = allowed_pairs(torch.arange(qs.start, qs.stop, device=device), torch.arange(ks.start, ks.stop, device=device),
                            True, None)
    return False, allowed if sub is None else sub & allowed


def _math_forward(q, k, v, scale, causal, mask, softcap=None):
    """Exact attention of a block by materialised scores, in tiles of at most ``MATH_TILE`` rows a side."""
    b, hq, sq, d = q.shape
    if sq <= MATH_TILE and k.shape[2] <= MATH_TILE:
        return _math_tile_forward(q, k, v, scale, causal, mask, softcap)
    out = torch.zeros(b, hq, sq, d, dtype=accumulator_dtype(q), device=q.device)
    lse = torch.full((b, hq, sq), _NEG_INF, dtype=torch.float32, device=q.device)
    for qs in _row_tiles(sq):
        for ks in _row_tiles(k.shape[2]):
            args = _tile_args(causal, mask, qs, ks, q.device)
            if args is not None:
                o_t, l_t = _math_tile_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], scale, *args, softcap)
                merge_into(out[:, :, qs], lse[:, :, qs], o_t, l_t)
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, scale, causal, mask, softcap=None):
    """Block gradients by materialised scores, in tiles: with the global ``lse`` every tile's share is exact."""
    sq, sk = q.shape[2], k.shape[2]
    if sq <= MATH_TILE and sk <= MATH_TILE:
        return _math_tile_backward(dout, q, k, v, out, lse, scale, causal, mask, softcap)
    acc = accumulator_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for qs in _row_tiles(sq):
        for ks in _row_tiles(sk):
            args = _tile_args(causal, mask, qs, ks, q.device)
            if args is not None:
                g_q, g_k, g_v = _math_tile_backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                                    out[:, :, qs], lse[:, :, qs], scale, *args, softcap)
                dq[:, :, qs].add_(g_q)
                dk[:, :, ks].add_(g_k)
                dv[:, :, ks].add_(g_v)
    return dq, dk, dv


def _math_tile_forward(q, k, v, scale, causal, mask, softcap=None):
    b, hq, sq, d = q.shape
    s, _ = _scores(q, k, scale, causal, mask, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.to(p.dtype))
    return out.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq).float()


def _math_tile_backward(dout, q, k, v, out, lse, scale, causal, mask, softcap=None):
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s, t = _scores(q, k, scale, causal, mask, softcap)
    dt = s.dtype
    p = torch.exp(s - lse.to(dt).reshape(b, hkv, g, sq, 1))
    do = dout.to(dt).reshape(b, hkv, g, sq, d)
    o = out.to(dt).reshape(b, hkv, g, sq, d)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", do, v.to(dt))
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    if t is not None:
        ds = ds * (1 - t * t)  # d(cap·tanh(x/cap))/dx
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.to(dt)) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q.to(dt).reshape(b, hkv, g, sq, d)) * scale
    return dq.reshape(b, hq, sq, d), dk, dv


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold_kv_grad(dx: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return dx
    b, hq, s, d = dx.shape
    return dx.reshape(b, hq // groups, groups, s, d).sum(2)


def block_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    causal: bool = False,
    mask: Optional[Tensor] = None,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Attention of one block: ``out`` in ``q.dtype`` ``(B, Hq, S_q, D)``, ``lse`` fp32 ``(B, Hq, S_q)``."""
    backend = _backend(q, mask, softcap)
    if backend == "cpu_flash":
        bias = None if mask is None else _additive(mask, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        if mask is not None:
            # The fused kernel reports lse = 0 for a row whose keys are all masked.
            seen = ~torch.isneginf(mask).all(-1) if mask.is_floating_point() else mask.any(-1)
            lse = lse.masked_fill(~seen, _NEG_INF)
        return out, lse
    if backend == "cuda_flash":
        g = q.shape[1] // k.shape[1]
        try:
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                q, _repeat_kv(k, g), _repeat_kv(v, g), 0.0, causal, False, scale=scale
            )
            return res[0], res[1]
        except RuntimeError as err:  # shapes or devices the flash kernel does not take
            _warn_fallback(err)
    return _math_forward(q, k, v, scale, causal, mask, softcap)


def merge_into(out: Tensor, lse: Tensor, o_blk: Tensor, l_blk: Tensor) -> None:
    """In-place log-sum-exp merge of one block's result into views of the accumulators.

    ``L = logaddexp(L1, L2)``, ``O = exp(L1-L)·O1 + exp(L2-L)·O2``; rows where
    neither side saw a key stay ``(0, -inf)`` instead of turning NaN.
    """
    new = torch.logaddexp(lse, l_blk)
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    o_blk = o_blk.to(out.dtype) if o_blk.dtype != out.dtype else o_blk
    out.mul_(torch.exp(lse - safe).unsqueeze(-1))
    out.add_(o_blk.mul_(torch.exp(l_blk - safe).unsqueeze(-1)))
    lse.copy_(new)


def block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    scale: float,
    causal: bool = False,
    mask: Optional[Tensor] = None,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *merged* ``out`` and ``lse`` of the whole attention.

    Using the global ``out``/``lse`` makes each block's gradient its exact share
    of the full gradient, so summing blocks needs no rescaling.
    """
    # A row with no key anywhere has lse = -inf; +inf makes every p = exp(s - lse) exactly 0.
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    backend = _backend(q, mask, softcap)
    if backend == "cpu_flash":
        bias = None if mask is None else _additive(mask, q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    if backend == "cuda_flash":
        g = q.shape[1] // k.shape[1]
        kr, vr = _repeat_kv(k, g), _repeat_kv(v, g)
        cum = torch.zeros(0, dtype=torch.int32, device=q.device)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        try:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, kr, vr, out, lse, cum, cum, q.shape[2], k.shape[2], 0.0, causal, seed, seed, scale=scale
            )
            return dq, _fold_kv_grad(dk, g), _fold_kv_grad(dv, g)
        except RuntimeError as err:
            _warn_fallback(err)
    return _math_backward(dout, q, k, v, out, lse, scale, causal, mask, softcap)


_WARNED = False


def _warn_fallback(err: Exception) -> None:
    """The exact math path takes over; say so once, since it is slower and uses more memory."""
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn(f"hf_ring: the CUDA flash kernel refused a block ({err}); using the exact math path", stacklevel=3)


def check_softcap(softcap) -> Optional[float]:
    """``softcap`` as a float, or None; it must be a finite number > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float > 0 or None (scores -> softcap·tanh(scores/softcap)), got {softcap!r}")
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap!r}")
    return float(softcap)


def check_sinks(sinks, hq: int) -> Optional[Tensor]:
    """``sinks``: one float logit per query head, shape ``(Hq,)``, or None."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a float tensor of shape (query heads,) = ({hq},) or None, "
                        f"got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must have shape (query heads,) = ({hq},): one logit per query head, "
                         f"got {tuple(sinks.shape)}")
    return sinks


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tuple[Tensor, Tensor]:
    """Join one sink logit per query head to the softmax denominator, with a zero value vector.

    ``out`` ``(B, H, S, D)`` and ``lse`` ``(B, H, S)`` are a finished (merged)
    attention; returns ``exp(L - L')·out`` and ``L' = logaddexp(L, sink_h)``
    in ``out``'s dtype and fp32 (fp64 for fp64). A row with no key gets 0.
    """
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    sink = sinks.to(device=lse.device, dtype=acc).view(1, -1, 1)
    new = torch.logaddexp(lse.to(acc), sink)
    return (out.to(acc) * torch.exp(lse.to(acc) - new).unsqueeze(-1)).to(out.dtype), new.to(lse.dtype)


def sinks_backward(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Gradient of the sink logits over these rows: ``-Σ_{b,t} exp(sink_h - L') · rowsum(dO·O')``.

    ``out`` and ``lse`` are the results *with* the sinks joined.
    """
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    p_sink = torch.exp(sinks.to(device=lse.device, dtype=acc).view(1, -1, 1) - lse.to(acc))
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    return -(p_sink * delta).sum((0, 2)).to(device=sinks.device, dtype=sinks.dtype)
