"""The fused CUDA kernels' documented semantics in float64 on the CPU, to check the code around them.

What a GPU run would show about ``hf_ring.engine.cuda_kernels`` apart from the kernels
themselves (which rows and keys each call gets, the window sizes, how query-head
groups are split and stacked back, the padded logsumexp, rows that see no key) is
checked here by routing the ring's blocks through these stand-ins, which compute
what torch documents for each op (flash: grouped-query heads, a window aligned to
the bottom-right corner, +inf logsumexp on a row with no key; memory-efficient
attention: equal head counts, top-left causal mask, an additive bias, logsumexp
rows padded to 32), and asserting the kernels' argument contracts on real tensors.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from hf_ring.engine import cuda_kernels

from hf_ring.engine import kernels


def _contract(*tensors, lse=None):
    assert len({t.dtype for t in tensors}) == 1, [t.dtype for t in tensors]
    assert all(t.stride(-1) == 1 for t in tensors)
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.dim() == 3 and lse.is_contiguous()


def _flash_allowed(sq, sk, causal, left, right):
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = i + sk - sq
    right = 0 if causal else (-1 if right is None else right)
    left = -1 if left is None else left
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def _heads_up(k, hq):
    return k.repeat_interleave(hq // k.shape[1], dim=1)


def _scores(q, k, scale, allowed, bias=None):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if bias is not None:
        s = s + bias.double()
    return s.masked_fill(~allowed, float("-inf"))


def flash_forward(q, k, v, cum_q, cum_k, max_q, max_k, dropout, causal, debug, *, scale,
                  window_size_left=None, window_size_right=None):
    assert cum_q is None and cum_k is None and dropout == 0.0
    _contract(q, k, v)
    qd, kd, vd = (t.transpose(1, 2).double() for t in (q, k, v))  # (B, H, S, D)
    hq = qd.shape[1]
    kd, vd = _heads_up(kd, hq), _heads_up(vd, hq)
    allowed = _flash_allowed(qd.shape[2], kd.shape[2], causal, window_size_left, window_size_right)
    s = _scores(qd, kd, scale, allowed)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0).unsqueeze(-1))
    out = torch.einsum("bhqk,bhkd->bhqd", p, vd)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # flash's mark of a row with no key
    return (out.transpose(1, 2).to(q.dtype).contiguous(), lse.float(), torch.empty(2, dtype=torch.uint64),
            torch.empty((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype))


def _grads(dout, q, k, v, out, lse, scale, allowed, bias=None):
    """Attention gradients from the merged out/lse; q, k, v ``(B, H, S, D)`` float64 with equal heads."""
    s = _scores(q, k, scale, allowed, bias)
    p = torch.exp(s - lse.double().unsqueeze(-1))
    dv = torch.einsum("bhqk,bhqd->bhkd", p, dout)
    dp = torch.einsum("bhqd,bhkd->bhqk", dout, v)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    return (torch.einsum("bhqk,bhkd->bhqd", ds, k) * scale, torch.einsum("bhqk,bhqd->bhkd", ds, q) * scale, dv)


def _fold(x, hkv):
    b, hq, s, d = x.shape
    return x.reshape(b, hkv, hq // hkv, s, d).sum(2)


def flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout, causal, rng, unused, *, scale,
                   window_size_left=None, window_size_right=None):
    assert cum_q is None and cum_k is None
    _contract(q, k, v, out, dout, lse=lse)
    qd, kd, vd, od, dd = (t.transpose(1, 2).double() for t in (q, k, v, out, dout))
    hq, hkv = qd.shape[1], kd.shape[1]
    allowed = _flash_allowed(qd.shape[2], kd.shape[2], causal, window_size_left, window_size_right)
    dq, dk, dv = _grads(dd, qd, _heads_up(kd, hq), _heads_up(vd, hq), od, lse, scale, allowed)
    return tuple(g.transpose(1, 2).to(q.dtype) for g in (dq, _fold(dk, hkv), _fold(dv, hkv)))


def _check_bias(bias, q):
    assert bias.dtype == q.dtype and bias.stride(-1) == 1 and bias.stride(2) % 16 == 0
    assert tuple(bias.shape) == (q.shape[0], q.shape[1], q.shape[2], bias.shape[3])


def efficient_forward(q, k, v, bias, compute_lse, dropout, causal, *, scale):
    assert compute_lse and dropout == 0.0 and q.shape[1] == k.shape[1]
    _contract(q, k, v)
    if bias is not None:
        _check_bias(bias, q)
    sq, sk = q.shape[2], k.shape[2]
    allowed = torch.ones(sq, sk, dtype=torch.bool).tril() if causal else torch.ones(sq, sk, dtype=torch.bool)
    s = _scores(q.double(), k.double(), scale, allowed, bias)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0).unsqueeze(-1))
    out = torch.einsum("bhqk,bhkd->bhqd", p, v.double())
    out = out.masked_fill(torch.isneginf(lse).unsqueeze(-1), float("nan"))  # whatever: the caller must not trust it
    padded = torch.full((*lse.shape[:2], -(-sq // 32) * 32), float("nan"))
    padded[..., :sq] = lse
    return (out.transpose(1, 2).to(q.dtype).contiguous().transpose(1, 2), padded.float(),
            torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64))


def efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout, grad_mask, causal, *, scale):
    assert q.shape[1] == k.shape[1] and list(grad_mask) == [True, True, True, False]
    _contract(q, k, v, out, dout, lse=lse)
    assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= q.shape[2]
    for t in (out, dout):  # the kernel reads heads head_dim apart
        assert t.transpose(1, 2).stride(2) == t.shape[-1] or t.shape[1] == 1
    if bias is not None:
        _check_bias(bias, q)
    sq, sk = q.shape[2], k.shape[2]
    allowed = torch.ones(sq, sk, dtype=torch.bool).tril() if causal else torch.ones(sq, sk, dtype=torch.bool)
    grads = _grads(dout.double(), q.double(), k.double(), v.double(), out.double(), lse[..., :sq], scale, allowed,
                   bias)
    return tuple(g.to(q.dtype) for g in grads) + (torch.empty(0),)


class _Aten:
    """``torch.ops.aten`` with the four fused ops replaced by their float64 stand-ins."""

    _flash_attention_forward = staticmethod(flash_forward)
    _flash_attention_backward = staticmethod(flash_backward)
    _scaled_dot_product_efficient_attention = staticmethod(efficient_forward)
    _scaled_dot_product_efficient_attention_backward = staticmethod(efficient_backward)

    def __getattr__(self, name):
        return getattr(torch.ops.aten, name)


@contextlib.contextmanager
def emulated(route: str):
    """Blocks of CPU tensors take ``route`` ("flash": flash wherever there is no mask, fp32 too; "efficient":
    memory-efficient attention for every block) through :mod:`hf_ring.engine.cuda_kernels` and the stand-ins."""
    saved = kernels.KERNELS, cuda_kernels.aten
    table = {kn.name: kn for kn in kernels.KERNELS}

    def fused(q, softcap):
        return softcap is None and q.dtype != torch.float64

    flash = dataclasses.replace(table["cuda_flash"],
                                supports=lambda q, masked, cap: route == "flash" and fused(q, cap) and not masked)
    efficient = dataclasses.replace(table["cuda_efficient"], supports=lambda q, masked, cap: fused(q, cap))
    kernels.KERNELS, cuda_kernels.aten = (flash, efficient, table["math"]), _Aten()
    try:
        yield
    finally:
        kernels.KERNELS, cuda_kernels.aten = saved


def emulated_case(route: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the blocks on ``route`` (picklable, for the rank pools)."""
    with emulated(route):
        return fn(*args, **kwargs)

