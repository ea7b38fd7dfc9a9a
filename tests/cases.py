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


def ring_case(seed, b, hq, hkv, n, d, *, dtype=torch.float32, layout="zigzag", message_rows=None, **kw):
    """This rank's positions, output and gradients of ring_attention on its shard.

    ``message_rows`` shrinks the per-message budget so shards travel in many small messages.
    """
    if message_rows is not None:
        import hf_ring.schedule as schedule

        saved = schedule.MIN_MESSAGE_ROWS, schedule.MESSAGES_PER_SHARD
        schedule.MIN_MESSAGE_ROWS, schedule.MESSAGES_PER_SHARD = message_rows, 10**9
        try:
            return ring_case(seed, b, hq, hkv, n, d, dtype=dtype, layout=layout, **kw)
        finally:
            schedule.MIN_MESSAGE_ROWS, schedule.MESSAGES_PER_SHARD = saved
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


def sp_train_case(path, sp_size, seed, b, n, pattern=None, layout="zigzag", pad="none"):
    """One training step of a tiny model with the sequence split over ``sp_size`` ranks."""
    from models import batch, load

    sp = hf_ring.setup_sequence_parallel(None, sp_size, layout=layout)
    try:
        model = load(path, "ring_dilated").train()
        hf_ring.configure(model, pattern=pattern, layout=layout)
        data = batch(seed + sp.dp_rank, b, n, pad=pad)
        out = model(**hf_ring.shard_batch(data))
        out.loss.backward()
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        logits = hf_ring.gather_sequence(out.logits.detach(), n)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()} if dist.get_rank() == 0 else None
        return {"dp_rank": sp.dp_rank, "loss": float(loss), "logits": logits, "grads": grads}
    finally:
        hf_ring.clear_sequence_parallel()


def sp_logits_case(path, n, seed=0):
    """Logits of a model run with the sequence split over the whole world (no grad)."""
    from models import batch, load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        data = batch(seed, 1, n)
        with torch.no_grad():
            out = model(**hf_ring.shard_batch(data))
        return hf_ring.gather_sequence(out.logits, n)
    finally:
        hf_ring.clear_sequence_parallel()
