"""Rank functions of the sharded-model tests: training steps, logits, the forward's agreement and its refusals
(module-level so they pickle)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hf_ring
from hf_ring.integration.seams import enable_checkpointing
from attention_cases import make_qkv
from helpers import raises_on_rank


def sp_train_case(path, sp_size, seed, b, n, pattern=None, layout="zigzag", pad="none"):
    """One training step of a tiny model with the sequence split over ``sp_size`` ranks."""
    from models import batch, load

    sp = hf_ring.setup_sequence_parallel(None, sp_size, layout=layout)
    try:
        model = load(path, "ring_dilated").train()
        hf_ring.configure(model, pattern=pattern, layout=layout)
        data = batch(seed + sp.dp_rank, b, n, pad=pad)
        out = model(**hf_ring.shard_batch(data), return_logits=True)  # logits to compare; the loss tiling is off
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
            out = model(**hf_ring.shard_batch(data), return_logits=True)
        return hf_ring.gather_sequence(out.logits, n)
    finally:
        hf_ring.clear_sequence_parallel()


def counted_collectives_case(path, n, layers, checkpointing=False):
    """Collectives and host agreements of one sharded training step (forward and backward) under sp = world."""
    from models import batch, load

    hf_ring.setup_sequence_parallel(None)
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce", "broadcast", "all_gather_into_tensor")}

    def spy(name):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return wrapped

    try:
        model = load(path, "ring_dilated").train()
        assert model.config.num_hidden_layers == layers
        if checkpointing:
            enable_checkpointing(model)
        sharded = hf_ring.shard_batch(batch(3, 1, n))
        for name in originals:
            setattr(dist, name, spy(name))
        try:
            out = model(**sharded)
            forward_calls = list(calls)
            out.loss.backward()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        return {"forward": forward_calls, "step": list(calls), "agreed": sharded["ring_context"].collectives}
    finally:
        hf_ring.clear_sequence_parallel()


def unsharded_forward_case(path, n, shard_ranks=()):
    """A forward under sequence parallelism where the ranks in ``shard_ranks`` shard their batch and the others do not."""
    from models import batch, load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        data = batch(5 + dist.get_rank(), 1, n)  # what a stock Trainer does: each rank its own batch

        def forward():
            sharded = hf_ring.shard_batch(data) if dist.get_rank() in shard_ranks else data
            with torch.no_grad():
                return model(**sharded)

        return raises_on_rank(forward)
    finally:
        hf_ring.clear_sequence_parallel()


def different_batches_case(path, n):
    """Every rank shards a batch of its own (an error: an sp group must share one batch)."""
    from models import batch, load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        with torch.no_grad():
            return raises_on_rank(model, **hf_ring.shard_batch(batch(7 + dist.get_rank(), 1, n)))
    finally:
        hf_ring.clear_sequence_parallel()


def mixed_dtype_case(n):
    """ring_attention with fp16 on rank 0 and bf16 elsewhere: same byte size, different numbers (an error)."""
    dtype = torch.float16 if dist.get_rank() == 0 else torch.bfloat16
    q, k, v, _ = make_qkv(0, 1, 2, 2, n, 8, dtype)
    pos = hf_ring.local_positions(n, dist.get_rank(), dist.get_world_size())
    return raises_on_rank(hf_ring.ring_attention, q[:, :, pos], k[:, :, pos], v[:, :, pos])


def packed_train_case(path, features, pattern=None, layout="zigzag", ulysses_size=1):
    """One training step on a DataCollatorWithFlattening batch with the sequence split over the whole world (a
    balanced layout weighing documents by the model's attention); also the rows each rank held."""
    from models import load
    from transformers import DataCollatorWithFlattening

    model = load(path, "ring_dilated").train()
    hf_ring.configure(model, pattern=pattern, layout=layout)
    sp = hf_ring.setup_sequence_parallel(None, layout=layout, ulysses_size=ulysses_size, balance_for=model)
    try:
        batch = DataCollatorWithFlattening()(features)
        n = batch["input_ids"].shape[1]
        sharded = hf_ring.shard_batch(batch)
        out = model(**sharded, return_logits=True)
        out.loss.backward()
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        layout = hf_ring.layout_of(batch)
        return {"loss": float(loss), "logits": hf_ring.gather_sequence(out.logits.detach(), n, layout=layout),
                "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
                "rows": sharded["ring_context"].rows(torch.device("cpu")).tolist()}
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


def one_rank_bad_batch_case(n):
    """shard_batch where only the last rank's labels have the wrong shape."""
    hf_ring.setup_sequence_parallel(None)
    try:
        ids = torch.arange(n)[None]
        bad = dist.get_rank() == dist.get_world_size() - 1
        labels = ids[:, :-1] if bad else ids
        return raises_on_rank(hf_ring.shard_batch, {"input_ids": ids, "labels": labels})
    finally:
        hf_ring.clear_sequence_parallel()


def head_parallel_refusal_case(path, ulysses, config_ulysses=None):
    """One sharded forward under ``setup_sequence_parallel(ulysses_size=ulysses)``: (error type, message) or None."""
    from models import batch, load

    def step():
        hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses)
        model = load(path, "ring_dilated")
        if config_ulysses is not None:
            model.config.ring_dilated = {"ulysses_size": config_ulysses}
        model(**hf_ring.shard_batch(batch(0, 1, 16)))

    try:
        return raises_on_rank(step)
    finally:
        hf_ring.clear_sequence_parallel()


def custom_mask_sharded_case(path):
    """A 4-D mask of the caller's own under sequence parallelism: what shard_batch raises for it, and what the
    model raises when the mask comes with a sharded batch anyway (each rank's message)."""
    from helpers import raises_on_rank
    from models import batch, load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        data = batch(1, 1, 12)
        mask = torch.ones(1, 1, 12, 12, dtype=torch.bool).tril()
        by_batch = raises_on_rank(hf_ring.shard_batch, dict(data, attention_mask=mask))
        sharded = hf_ring.shard_batch({k: v for k, v in data.items() if k != "attention_mask"})
        by_model = raises_on_rank(lambda: model(**dict(sharded, attention_mask=mask)))
        return by_batch, by_model
    finally:
        hf_ring.clear_sequence_parallel()
