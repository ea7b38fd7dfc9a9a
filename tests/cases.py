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


def ring_case(seed, b, hq, hkv, n, d, *, dtype=torch.float32, layout="zigzag", message_rows=None, pad=0,
              padded_tile=None, **kw):
    """This rank's positions, output and gradients of ring_attention on its shard.

    ``message_rows`` shrinks the per-message budget so shards travel in many small messages.
    ``pad`` masks the first ``pad`` keys of sample 0 (left padding); ``padded_tile`` sets the
    forward tile used with padding. ``max_mask`` reports the largest mask side any kernel got.
    """
    if padded_tile is not None:
        import hf_ring.ring as ring

        saved_tile, saved_forward = ring.PADDED_TILE, ring.block_forward
        sides = [0]

        def spy(q, k, v, *, mask=None, **kernel_kw):
            if mask is not None:
                sides.append(max(mask.shape[-2:]))
            return saved_forward(q, k, v, mask=mask, **kernel_kw)

        ring.PADDED_TILE, ring.block_forward = padded_tile, spy
        try:
            res = ring_case(seed, b, hq, hkv, n, d, dtype=dtype, layout=layout, message_rows=message_rows, pad=pad, **kw)
        finally:
            ring.PADDED_TILE, ring.block_forward = saved_tile, saved_forward
        res["max_mask"] = max(sides)
        return res
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
    if pad:
        key_mask = torch.ones(b, n, dtype=torch.bool)
        key_mask[0, :pad] = False
        kw["key_mask"] = key_mask[:, pos]
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


class ListStreamer:
    """A streamer that records what ``generate`` puts into it."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.ended = True


def sp_generate_case(path, ids, mask=None, *, layout="zigzag", pattern=None, seed=None, stream=False,
                     ids_by_rank=None, cache_from=None, continue_with=None, **kwargs):
    """``hf_ring.generate`` with the sequence split over the whole world.

    Returns the sequences (and the step logits when asked), this rank's cache
    rows after every forward, and what a streamer saw. ``ids_by_rank`` gives
    each rank its own prompt (to provoke errors); ``cache_from`` passes a cache
    made for ``(rank, world, layout)``; ``continue_with`` runs a second call on
    the returned cache with these many more tokens.
    """
    from models import load
    from transformers import set_seed

    rank = dist.get_rank()
    hf_ring.setup_sequence_parallel(None, layout=layout)
    try:
        model = load(path, "ring_dilated")
        hf_ring.configure(model, pattern=pattern, layout=layout)
        lengths = []
        hook = model.register_forward_hook(
            lambda m, a, o: lengths.append(hf_ring.generation.active().cache.local_length()))
        if ids_by_rank is not None:
            ids = ids_by_rank[rank]
        if cache_from is not None:
            kwargs["past_key_values"] = hf_ring.ShardedCache(*cache_from)
        if seed is not None:
            set_seed(seed)
        streamer = ListStreamer() if stream else None
        out = hf_ring.generate(model, ids, attention_mask=mask, streamer=streamer, **kwargs)
        if continue_with is not None:
            seq = out.sequences
            more = None if mask is None else torch.cat([mask, torch.ones_like(seq[:, mask.shape[1]:])], 1)
            out = hf_ring.generate(model, seq, attention_mask=more, past_key_values=out.past_key_values,
                                   **dict(kwargs, max_new_tokens=continue_with))
        hook.remove()
        res = {"lengths": lengths, "stream": None if streamer is None else (streamer.chunks, streamer.ended)}
        if isinstance(out, torch.Tensor):
            res["sequences"] = out
        else:
            res["sequences"] = out.sequences
            res["logits"] = None if out.logits is None else torch.stack(out.logits, 1)
            res["cache_bytes"] = out.past_key_values.nbytes()
        return res
    finally:
        hf_ring.clear_sequence_parallel()


def unseeded_sampling_case(path, ids):
    """Sampling with a different random state on each rank (an error)."""
    torch.manual_seed(100 + dist.get_rank())
    return sp_generate_case(path, ids, do_sample=True, max_new_tokens=3, pad_token_id=0)


def sdpa_sharded_case(path, ids, **kwargs):
    """hf_ring.generate of an sdpa model under sequence parallelism (an error)."""
    from models import load

    hf_ring.setup_sequence_parallel(None)
    try:
        return hf_ring.generate(load(path, "sdpa"), ids, **kwargs)
    finally:
        hf_ring.clear_sequence_parallel()


def sp_cache_forward_case(path):
    """A forward with transformers' own cache while the sequence is split (an error)."""
    from models import load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        ids = torch.arange(8).view(1, 8)
        with torch.no_grad():
            out = model(**dict(hf_ring.shard_batch({"input_ids": ids}), use_cache=True))
            return model(input_ids=ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
    finally:
        hf_ring.clear_sequence_parallel()


def sp_tiled_train_case(path, seed, b, n, loss_chunk_rows, row_chunk_rows, *, pattern=None, pad="right",
                        return_logits=False, spy_vocab=None):
    """One sharded training step with sequence tiling left at its default (on under sequence parallelism).

    Returns the loss summed over the sp group, rank 0's synced gradients, whether
    logits came back (gathered when they did) and, with ``spy_vocab``, the shapes
    of every tensor whose last dimension is ``spy_vocab``, with this rank's row count.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from models import batch, load

    class VocabShapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == spy_vocab:
                    self.shapes.append(tuple(t.shape))
            return out

    from hf_ring.patches import tiling

    sp = hf_ring.setup_sequence_parallel(None)
    model = load(path, "ring_dilated").train()
    try:
        hf_ring.configure(model, pattern=pattern)
        hf_ring.configure_tiling(model, loss_chunk_rows=loss_chunk_rows, row_chunk_rows=row_chunk_rows)
        data = hf_ring.shard_batch(batch(seed, b, n, pad=pad))
        if return_logits:
            data["return_logits"] = True
        spy = VocabShapes() if spy_vocab is not None else None
        if spy is not None:
            with spy:
                out = model(**data)
                out.loss.backward()
        else:
            out = model(**data)
            out.loss.backward()
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        logits = None if out.logits is None else hf_ring.gather_sequence(out.logits.detach(), n)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()} if dist.get_rank() == 0 else None
        return {"loss": float(loss), "grads": grads, "logits": logits, "rows": data["input_ids"].shape[1],
                "vocab_shapes": None if spy is None else spy.shapes}
    finally:
        tiling.revert(model)
        hf_ring.clear_sequence_parallel()
