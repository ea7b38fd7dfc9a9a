"""A mixture of experts' training step with its router's load-balancing loss on: one process against the sequence
split (rank functions for :mod:`dist_pool`).

Every causal-LM type whose forward adds its modeling module's ``load_balancing_loss_func`` is found from the
modeling code (:func:`hf_ring.patches.router_loss.function_of`), built tiny (:mod:`sweep`, experts per token kept
one, some or all as released) with ``output_router_logits`` on and a coefficient large enough that the router
term moves every router gradient well above the bound of a comparison, and run on a padded batch and on a packed
row.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hybrid_models
import sweep
from hf_ring.patches import router_loss

COEF = 0.5
"""The router term's coefficient in these tests: released models use 0.001-0.02, which would let a router term
computed per shard pass a 1e-5 comparison of the router's gradients by its smallness alone."""
N = 53
DOCUMENTS = (19, 11, 23)
"""A packed row's documents (a collator's ``position_ids`` restarting at each), N tokens in all."""


def routed_types() -> List[str]:
    """Causal-LM types whose forward computes its module's load-balancing loss."""
    found = []
    for model_type, name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        cls = getattr(transformers, name, None)
        if cls is not None and router_loss.function_of(cls) is not None:
            found.append(model_type)
    return found


def reduced_over_shards(model_type: str) -> bool:
    """Whether ``model_type``'s module function is the load-balancing loss hf_ring reduces (measured)."""
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return router_loss.matches(router_loss.function_of(cls))


def build(model_type: str, attn: str, dtype: torch.dtype = torch.float64):
    """The sweep's tiny ``model_type`` with the router loss on (``None, why`` where it cannot be built)."""
    model, why = sweep.build(model_type, attn, dtype)
    if model is None:
        return None, why
    model.config.output_router_logits = True
    for holder in (model.config, model):  # the model copied it from the config when built
        for name in router_loss.COEFFICIENTS:
            if hasattr(holder, name):
                setattr(holder, name, COEF)
    return model.eval(), None  # no stochastic routing (PhiMoE samples experts in training)


def saved_moe(directory, vocab_size, dtype, router_logits=True):
    """A tiny Qwen3-MoE with the router loss's coefficient :data:`COEF`, saved; ``router_logits``:
    the config's ``output_router_logits`` (off, only the trainer's calls that ask for them return them)."""
    model, why = sweep.build("qwen3_moe", "eager", dtype, vocab_size=vocab_size)
    assert model is not None, why
    model.config.output_router_logits = router_logits
    model.config.router_aux_loss_coef = COEF
    model.save_pretrained(str(directory))
    return str(directory)


def batch(model_type: str, packed: bool) -> Dict[str, torch.Tensor]:
    """Two rows, the second padded at its end, or one packed row of :data:`DOCUMENTS`; labels on every real token."""
    if packed:
        ids = sweep.inputs(model_type, batch=1, n=N, seed=3)["input_ids"]
        positions = torch.cat([torch.arange(n) for n in DOCUMENTS]).unsqueeze(0)
        labels = ids.masked_fill(positions == 0, -100)  # no document's last token predicts the next one's first
        return {"input_ids": ids, "position_ids": positions, "labels": labels}
    ids = sweep.inputs(model_type, batch=2, n=N, seed=3)["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # fewer padded rows than the sweep's window: eager gives a query that sees no key NaN
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _grads(model) -> Dict[str, torch.Tensor]:
    return {name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()}


class NoExperts(Exception):
    """The tiny model has no layer of experts (the sweep kept only its dense layers)."""


def one_process(model_type: str, packed: bool) -> Dict[str, Any]:
    """``eager`` in one process: the loss (router term included), the router term, every gradient. A packed row's
    documents run one by one (a hybrid's recurrent layers would carry their state across them): the loss is their
    summed token losses over the row's count plus the coefficient times the module's own router loss of every
    document's router logits together."""
    model, why = build(model_type, "eager")
    assert model is not None, why
    data = batch(model_type, packed)
    if not model(input_ids=data["input_ids"][:, :4], use_cache=False).router_logits:
        raise NoExperts(f"the tiny {model_type} has no layer of experts")
    with hybrid_models.model_in_float64(model):
        if not packed:
            out = model(**data, use_cache=False)
            out.loss.backward()
            return {"loss": out.loss.detach(), "aux_loss": out.aux_loss.detach(), "grads": _grads(model)}
        total, counted, routers, start = 0.0, 0, [], 0
        for n in DOCUMENTS:
            ids, labels = data["input_ids"][:, start:start + n], data["labels"][:, start:start + n]
            out = model(input_ids=ids, use_cache=False, output_router_logits=True)
            total = total + F.cross_entropy(out.logits[0, :-1].double(), labels[0, 1:], ignore_index=-100,
                                            reduction="sum")
            counted += int((labels[0, 1:] != -100).sum())
            routers.append(out.router_logits)
            start += n
        merged = tuple(torch.cat(layer, dim=0) for layer in zip(*routers))
        function = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func")
        aux = function(merged, model.num_experts, model.num_experts_per_tok, None)
        loss = total / counted + COEF * aux
        loss.backward()
    return {"loss": loss.detach(), "aux_loss": aux.detach(), "grads": _grads(model)}


def sharded_step(model_type: str, packed: bool, ulysses: int = 1, tiled: Optional[bool] = None) -> Dict[str, Any]:
    """Rank function: the same step through ``shard_batch`` and ``sync_gradients``: the ranks' losses summed, the
    ``aux_loss`` this rank reports, the summed gradients (rank 0), or what it raised."""
    import torch.distributed as dist

    import hf_ring

    sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses)
    try:
        model, why = build(model_type, "ring_dilated")
        if model is None:
            return {"unbuilt": why}
        if tiled is not None:
            hf_ring.configure_tiling(model, loss=tiled, mlp=False, norm=False)
        try:
            data = hf_ring.shard_batch(batch(model_type, packed))
            with hybrid_models.model_in_float64(model):
                out = model(**data)
                out.loss.backward()
        except (NotImplementedError, ValueError, TypeError) as err:
            return {"refused": f"{type(err).__name__}: {err}"}
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        return {"loss": loss, "aux_loss": out.aux_loss.detach(), "logits": out.logits is not None,
                "grads": _grads(model) if dist.get_rank() == 0 else None}
    finally:
        hf_ring.clear_sequence_parallel()
