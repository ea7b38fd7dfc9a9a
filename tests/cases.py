"""Functions that run on every rank of a pool (module-level so they pickle)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hf_ring


def make_qkv(seed, b, hq, hkv, n, d, dtype=torch.float32):
    """Global q, k, v, dout from a seed: every rank and the test build the same tensors."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, hq, n, d), (b, hkv, n, d), (b, hkv, n, d), (b, hq, n, d)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def ring_case(seed, b, hq, hkv, n, d, *, dtype=torch.float32, layout="zigzag", **kw):
    """This rank's positions, output and gradients of ring_attention on its shard."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    q, k, v, dout = make_qkv(seed, b, hq, hkv, n, d, dtype)
    pos = hf_ring.local_positions(n, rank, world, layout)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    out = hf_ring.ring_attention(ql, kl, vl, layout=layout, **kw)
    out.backward(dout[:, :, pos])
    return {"pos": pos, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def assemble(results, name, n):
    """Put every rank's rows of ``name`` back in global order."""
    first = results[0][name]
    full = torch.zeros(first.shape[:2] + (n,) + first.shape[3:], dtype=first.dtype)
    for r in results:
        full[:, :, r["pos"]] = r[name]
    return full


def raises_on_rank(fn, *args, **kwargs):
    """Run fn and return (exception type name, message), or None if it did not raise."""
    try:
        fn(*args, **kwargs)
    except Exception as err:  # the test inspects type and message
        return type(err).__name__, str(err)
    return None
