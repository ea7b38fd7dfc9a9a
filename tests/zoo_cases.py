"""Rank functions of the model-zoo tests (module-level so they pickle)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hf_ring
from models import batch, load


def zero_if_none(p):
    """A parameter's gradient; zeros when backward never reached it (a parameter the computation skipped)."""
    return torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()


def zoo_train_case(path, b, n, seed, ulysses=1):
    """One training step on 2 ranks: loss, logits, summed gradients; and the logits without the rotary patch."""
    sp = hf_ring.setup_sequence_parallel(None, 2, ulysses_size=ulysses)
    try:
        model = load(path, "ring_dilated").train()
        hf_ring.patches.apply(model)
        data = hf_ring.shard_batch(batch(seed, b, n))
        out = model(**data, return_logits=True)
        out.loss.backward()
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        logits = hf_ring.gather_sequence(out.logits.detach(), n)
        grads = {name: zero_if_none(p) for name, p in model.named_parameters()} if dist.get_rank() == 0 else None
        # A fresh model (no RoPE state from the run above) with every shard using its own length: the patches
        # undone, and the guard on the model's call kept from making them again.
        hf_ring.patches.revert_all()
        patch_rotary, hf_ring.patches.rope.patch_rotary = hf_ring.patches.rope.patch_rotary, lambda cls: False
        try:
            with torch.no_grad():
                unpatched = hf_ring.gather_sequence(load(path, "ring_dilated")(**data).logits, n)
        finally:
            hf_ring.patches.rope.patch_rotary = patch_rotary
            hf_ring.patches.apply_all()
        return {"loss": float(loss), "logits": logits, "grads": grads, "unpatched_logits": unpatched}
    finally:
        hf_ring.clear_sequence_parallel()


def zoo_generate_case(path, ids, **kwargs):
    """hf_ring.generate with the prompt split over the whole world."""
    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        hf_ring.patches.apply(model)
        return hf_ring.generate(model, ids, **kwargs)
    finally:
        hf_ring.clear_sequence_parallel()


def zoo_short_case(path, b, n, seed, ulysses=1):
    """One training step (sequence tiling on) with fewer tokens than ranks: some rank holds none."""
    sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses)
    try:
        model = load(path, "ring_dilated").train()
        hf_ring.patches.apply(model)
        data = hf_ring.shard_batch(batch(seed, b, n))
        out = model(**data)
        out.loss.backward()
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        grads = {name: zero_if_none(p) for name, p in model.named_parameters()} if dist.get_rank() == 0 else None
        return {"loss": float(loss), "grads": grads, "rows": data["input_ids"].shape[1],
                "placeholder": data["ring_context"].placeholder}
    finally:
        hf_ring.clear_sequence_parallel()
