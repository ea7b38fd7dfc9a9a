"""Independent float64 reference: dense softmax attention with an explicit mask.

Shares no code with hf_ring: every mask is built here from positions.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def dense_mask(n: int, causal: bool = True, window: Optional[int] = None) -> torch.Tensor:
    """Boolean ``(n, n)``: entry ``[t, k]`` is True when query t may see key k."""
    t = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    allowed = torch.ones(n, n, dtype=torch.bool)
    if causal:
        allowed &= k <= t
    if window is not None:
        allowed &= k > t - window
    return allowed


def attention(q, k, v, *, bias: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """``softmax(scale·q·kᵀ + bias)·v`` in float64; ``bias`` is ``(H or 1, n, n)`` with -inf for masked.

    Rows whose every entry is masked give 0. GQA is handled by repeating K/V here.
    """
    q, k, v = q.double(), k.double(), v.double()
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale + bias.double()
    empty = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return torch.einsum("bhqk,bhkd->bhqd", p, v)


def dense_attention(q, k, v, *, causal=True, window=None, scale=None) -> torch.Tensor:
    n = q.shape[2]
    m = dense_mask(n, causal, window)
    bias = torch.zeros(n, n, dtype=torch.float64).masked_fill(~m, float("-inf"))
    return attention(q, k, v, bias=bias[None], scale=scale)


def with_grads(fn, q, k, v, dout, **kw):
    """Output and (dq, dk, dv) of ``fn`` in float64 for upstream gradient ``dout``."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, **kw)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def dilated_multiplicity(n: int, branches, head: int, causal: bool = True) -> torch.Tensor:
    """``m[p, q]``: how many branches let query p see key q for query head ``head`` (LongNet eqs. 9-10)."""
    p = torch.arange(n)[:, None]
    q = torch.arange(n)[None, :]
    m = torch.zeros(n, n, dtype=torch.long)
    for w, r in branches:
        wt = min(w, n)
        same_seg = (p // wt) == (q // wt)
        rho_p, rho_q = p - (p // wt) * wt, q - (q // wt) * wt
        o = head % r
        ok = same_seg & (rho_p % r == o) & (rho_q % r == o)
        if causal:
            ok &= q <= p
        m += ok.long()
    return m


def dilated_attention(q, k, v, *, branches, causal=True, scale=None) -> torch.Tensor:
    """Dense attention with bias ``log m`` per query head: the multiplicity-weighted single softmax."""
    n, hq = q.shape[2], q.shape[1]
    bias = torch.stack([
        torch.log(dilated_multiplicity(n, branches, h, causal).double()) for h in range(hq)
    ])
    return attention(q, k, v, bias=bias, scale=scale)
