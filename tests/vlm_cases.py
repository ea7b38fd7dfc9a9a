"""Rank functions for the vision-language families (module-level so they pickle)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

import hf_ring
from helpers import gradient_errors, rel_err
from vlm import FAMILIES

TOL = 1e-5


def _result(model, loss: torch.Tensor) -> Dict[str, Any]:
    return {"loss": loss, "grads": {k: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                    for k, p in model.named_parameters()}}


def step(name: str, path: str, n: int = 64, where: Sequence[Sequence[int]] = ((14, 45),), pad: Sequence[int] = (),
         ulysses: int = 1, dtype: torch.dtype = torch.float64, attn: str = "eager",
         layout: Optional[str] = None) -> Dict[str, Any]:
    """One training step of family ``name`` (its model saved at ``path``): ``attn`` in one process (no process group), or ``ring_dilated`` with
    the sequence split over every rank through ``shard_batch``; the loss and every parameter gradient (vision
    tower and projector included)."""
    family = FAMILIES[name]
    batch = family.batch(0, n, where, pad)
    if not dist.is_initialized():
        model = family.load(attn, dtype, path).train()
        out = model(**batch)
        out.loss.backward()
        return _result(model, out.loss.detach())
    kw = {} if layout is None else {"layout": layout}
    sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses, **kw)
    try:
        model = family.load("ring_dilated", dtype, path).train()
        out = model(**hf_ring.shard_batch(batch))
        out.loss.backward()
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        return _result(model, loss)
    finally:
        hf_ring.clear_sequence_parallel()


def worst(got: Dict[str, Any], want: Dict[str, Any]):
    """The loss's and every gradient's relative error, and the worst of them."""
    errs = {"loss": rel_err(got["loss"], want["loss"]), **gradient_errors(got["grads"], want["grads"])}
    name = max(errs, key=errs.get)
    return name, errs[name], errs


def generate(name: str, path: str, new: int = 4, n: int = 64, where: Sequence[Sequence[int]] = ((14, 45),),
             pad: Sequence[int] = (), dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Greedy tokens for the family's batch (images included): ``model.generate`` with ``sdpa`` in one process, or
    ``hf_ring.generate`` with the prompt split over every rank."""
    family = FAMILIES[name]
    inputs = {k: v for k, v in family.batch(0, n, where, pad).items() if k != "labels"}
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    settings = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
    if not dist.is_initialized():
        model = family.load("sdpa", dtype, path).eval()
        return model.generate(ids, attention_mask=mask, **inputs, **settings)
    hf_ring.setup_sequence_parallel(None)
    try:
        model = family.load("ring_dilated", dtype, path).eval()
        return hf_ring.generate(model, ids, mask, **inputs, **settings)
    finally:
        hf_ring.clear_sequence_parallel()
