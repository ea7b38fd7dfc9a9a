"""Rank functions for the vision-language families (module-level so they pickle)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

import hf_ring
from helpers import gradient_errors, rel_err
import hybrid_models
from vlm import family as family_of
from vlm import packed

TOL = 1e-5


def _result(model, loss: torch.Tensor) -> Dict[str, Any]:
    return {"loss": loss, "grads": {k: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                    for k, p in model.named_parameters()}}


def step(name: str, path: str, n: int = 64, where: Sequence[Sequence[int]] = ((14, 45),), pad: Sequence[int] = (),
         ulysses: int = 1, dtype: torch.dtype = torch.float64, attn: str = "eager",
         layout: Optional[str] = None, pack: bool = False) -> Dict[str, Any]:
    """One training step of family ``name`` (its model saved at ``path``): ``attn`` in one process (no process group), or ``ring_dilated`` with
    the sequence split over every rank through ``shard_batch``; the loss and every parameter gradient (vision
    tower and projector included). ``pack``: the rows go to the ring packed into one (:func:`vlm.packed`)."""
    family = family_of(name)
    batch = family.batch(0, n, where, pad)
    if not dist.is_initialized():
        model = family.load(attn, dtype, path).train()
        with hybrid_models.model_in_float64(model):
            out = model(**batch)
            out.loss.backward()
        return _result(model, out.loss.detach())
    kw = {} if layout is None else {"layout": layout}
    sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses, **kw)
    try:
        model = family.load("ring_dilated", dtype, path).train()
        if pack:
            batch = packed(batch, mrope_positions(model, batch))
        with hybrid_models.model_in_float64(model):
            out = model(**hf_ring.shard_batch(batch))
            out.loss.backward()
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        return _result(model, loss)
    finally:
        hf_ring.clear_sequence_parallel()


def mrope_positions(model, batch: Dict[str, Any]) -> Optional[torch.Tensor]:
    """The rows' mRoPE positions as a Qwen-VL model computes them (None for other models)."""
    if not hasattr(model.model, "get_rope_index"):
        return None
    return model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                      image_grid_thw=batch.get("image_grid_thw"))[0]


def worst(got: Dict[str, Any], want: Dict[str, Any]):
    """The loss's and every gradient's relative error, and the worst of them."""
    errs = {"loss": rel_err(got["loss"], want["loss"]), **gradient_errors(got["grads"], want["grads"])}
    name = max(errs, key=errs.get)
    return name, errs[name], errs


def generate(name: str, path: str, new: int = 4, n: int = 64, where: Sequence[Sequence[int]] = ((14, 45),),
             pad: Sequence[int] = (), dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Greedy tokens for the family's batch (images included): ``model.generate`` with ``sdpa`` in one process, or
    ``hf_ring.generate`` with the prompt split over every rank."""
    family = family_of(name)
    inputs = {k: v for k, v in family.batch(0, n, where, pad).items() if k != "labels"}
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    settings = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
    if not dist.is_initialized():
        model = family.load("sdpa", dtype, path).eval()
        with hybrid_models.model_in_float64(model):
            return model.generate(ids, attention_mask=mask, **inputs, **settings)
    hf_ring.setup_sequence_parallel(None)
    try:
        model = family.load("ring_dilated", dtype, path).eval()
        with hybrid_models.model_in_float64(model):
            return hf_ring.generate(model, ids, mask, **inputs, **settings)
    finally:
        hf_ring.clear_sequence_parallel()


def refused(model_path: str, batch: Dict[str, Any], attn: Any = "ring_dilated", text_model: bool = False) -> str:
    """The error a 2-rank forward of ``batch`` through ``shard_batch`` raises (``attn``: how the model at
    ``model_path`` is loaded; ``text_model``: it is a causal LM), or '' when it runs."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    hf_ring.setup_sequence_parallel(None)
    try:
        auto = AutoModelForCausalLM if text_model else AutoModelForImageTextToText
        model = auto.from_pretrained(model_path, attn_implementation=attn, dtype=torch.float32)
        try:
            model(**hf_ring.shard_batch(batch))
        except (ValueError, NotImplementedError) as err:
            return str(err)
        return ""
    finally:
        hf_ring.clear_sequence_parallel()


def trainer(name: str, path: str, sp_size: Optional[int] = None, steps: int = 2, accum: int = 2,
            dtype: torch.dtype = torch.float64) -> Dict[str, Any]:
    """Train family ``name`` with ``transformers.Trainer`` on rows holding images (one row per batch, as a
    vision collator with batch size 1 makes them), prepared for ``sp_size`` ranks when given: the logged losses
    and every optimizer step's gradients (rank 0's)."""
    import tempfile

    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from trainer_cases import GradRecorder, trainer_env

    trainer_env()
    AcceleratorState._reset_state()
    family = family_of(name)
    rows = [family.batch(seed, 64, where=((14 + seed, 45 - seed),)) for seed in range(steps * accum)]
    model = family.load("eager" if sp_size is None else "ring_dilated", dtype, path).train()
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf_ring_vlm_"), per_device_train_batch_size=1,
        gradient_accumulation_steps=accum, max_steps=steps, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, use_cpu=True,
        train_sampling_strategy="sequential", disable_tqdm=True, save_strategy="no", remove_unused_columns=False)
    recorder = GradRecorder()
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=lambda batch: batch[0],
                      callbacks=[recorder.callback])
    if sp_size is not None:
        hf_ring.prepare_trainer(trainer, sp_size)
    try:
        trainer.train()
        return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "grads": recorder.steps}
    finally:
        hf_ring.clear_sequence_parallel()
