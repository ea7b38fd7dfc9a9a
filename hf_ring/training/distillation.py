"""TRL's ``DistillationTrainer`` with the sequence split.

Its loss is a divergence between the student's and the teacher's next-token
distributions, summed over the completion tokens of a batch and divided by
their count. Both distributions at a position come from the two backbones'
last hidden states at that position, so the sum splits over the positions the
ranks hold: each rank computes its own positions' part, as a shard's share of a
token-averaged loss, and neither hidden states nor logits cross ranks.

TRL runs the backbones itself (``_get_last_hidden_state``, not the models'
calls) and projects their hidden states through the heads in chunks. Under a
sequence-parallel setup:

- ``_compute_loss`` is handed this rank's view of the batch (:func:`rank_view`):
  the rows the rank holds as the completion, masked to those whose next token
  TRL trains on, and no prompt. TRL's own code computes the divergence over them
  (its beta, temperature, logit scales and soft-capping untouched), divided by
  the whole batch's token count;
- while it runs, the trainer's ``_get_last_hidden_state`` gives each backbone
  (student, then teacher) this rank's shard of the whole sequence
  (:func:`hf_ring.shard_batch`), so attention runs over the ring, and returns
  the hidden states of the rows the rank holds;
- TRL scales each process's loss for DDP's (or DeepSpeed's) average over every
  process, which then adds the ranks' parts up.

Completions are sampled with one process per group (:mod:`hf_ring.training.sampling`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

import torch

from ..integration.context import CONTEXT_KEY
from ..integration.groups import current
from ..integration.seams import peft_base
from ..patches import registry
from .data import shard_batch

Tensor = torch.Tensor

TRL_BATCH = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask")
"""The token fields of a batch TRL's distillation trainer generated (``_generate_and_score_completions``)."""


def predicted_tokens(rows: Tensor, prompt_len: int, completion_len: int) -> Tensor:
    """For each global position in ``rows``, the index of the completion token its hidden state predicts: the
    position's own index minus ``prompt_len - 1``; -1 where that is no completion token (a prompt position before the
    last, the last position)."""
    target = rows - (prompt_len - 1)
    return torch.where((target >= 0) & (target < completion_len), target, torch.full_like(target, -1))


def loss_mask(inputs: Dict[str, Any]) -> Tensor:
    """The completion tokens TRL trains on, ``(B, K)``: generated ones (``completion_mask``), less tool results."""
    mask = inputs["completion_mask"]
    return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]


def rank_view(inputs: Dict[str, Any], rows: Tensor, held: Tensor) -> Dict[str, Any]:
    """``inputs`` as this rank computes its part of the loss: no prompt, and as the completion the ``held`` tokens
    ``(B, rows held)`` at global positions ``rows`` (fewer: a placeholder row, which nothing reads), each masked to
    whether the token its hidden state predicts is one TRL trains on."""
    mask = loss_mask(inputs)
    target = predicted_tokens(rows, inputs["prompt_ids"].shape[1], mask.shape[1])
    local = mask.new_zeros(held.shape)
    local[:, : len(rows)] = torch.where(target >= 0, mask[:, target.clamp(min=0)], mask.new_zeros(()))
    view = {k: v for k, v in inputs.items() if k not in TRL_BATCH}
    view.update(prompt_ids=held[:, :0], prompt_mask=local[:, :0], completion_ids=held, completion_mask=local)
    return view


class _ShardedBackbones:
    """The trainer's ``_get_last_hidden_state`` while one rank view is computed: each call runs the model's backbone
    on this rank's shard of ``batch`` and returns its last hidden states, ``(B, rows held, H)``; the arguments TRL
    builds from the view are not read."""

    def __init__(self, batch: Dict[str, Tensor], first: Dict[str, Any]):
        self.batch, self.first = batch, first

    def __call__(self, model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int,
                 **media: Any) -> Tensor:
        if media:
            raise ValueError(f"multimodal distillation inputs ({', '.join(sorted(media))}) are not split by hf_ring")
        kwargs = self.first if self.first is not None else shard_batch(self.batch)  # the first one made the view
        self.first = None
        return peft_base(model).base_model(**kwargs).last_hidden_state  # PEFT unwrapped, as TRL unwraps it


_BACKBONES_WHY = ("while a distillation trainer computes a rank's part of its loss, each backbone it runs gets this "
                  "rank's shard of the whole sequence")


def _on_held_rows(original: Callable) -> Callable:
    """``_compute_loss`` under a sequence-parallel setup: TRL's, over :func:`rank_view` (see the module docstring)."""

    @functools.wraps(original)
    def compute(unwrapped_student: torch.nn.Module, inputs: Dict[str, Any], num_items_in_batch: Optional[Any]):
        if current() is None:
            return original(unwrapped_student, inputs, num_items_in_batch)
        trainer = original.__self__
        batch = {"input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                 "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)}
        first = shard_batch(batch)
        held = first["input_ids"]
        view = rank_view(inputs, first[CONTEXT_KEY].rows(held.device), held)
        if num_items_in_batch is None:
            # evaluation: TRL divides by the count of the tokens it is given, which here are this rank's
            num_items_in_batch = loss_mask(inputs).sum().clamp(min=1)
        with registry.scoped(trainer, "_get_last_hidden_state", _ShardedBackbones(batch, first), _BACKBONES_WHY):
            return original(unwrapped_student, view, num_items_in_batch)

    return compute


def check(trainer: Any, tp_size: int) -> None:
    """Refuse, before the setup, what hf_ring does not split in a distillation trainer."""
    name = type(trainer).__name__
    if getattr(trainer, "_is_vlm", False):
        raise ValueError(f"{name} with a vision-language processor: hf_ring splits text-only distillation; run it "
                         "without prepare_trainer, one sequence per process")
    if getattr(trainer, "teacher_model", None) is None:
        raise ValueError(f"{name} without a teacher model: its teacher's hidden states come from elsewhere, which "
                         "hf_ring does not split; pass teacher_model=...")
    if tp_size > 1:
        raise ValueError(f"{name} with tensor parallelism (tp_size={tp_size}): its loss is checked with the sequence "
                         "split over data-parallel replicas (DDP or DeepSpeed) only; load the model without tp_plan")
    if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
        raise ValueError(f"{name} with an IterableDataset: TRL sizes its stream's generation batches over every "
                         "process, where the ranks of a sequence-parallel group are one; pass a map-style dataset")


_WHY = ("the distillation trainer under sequence parallelism: its loss is computed over the rows each rank holds, "
        "each backbone given this rank's shard; undone by clear_sequence_parallel")


def prepare(trainer: Any) -> None:
    """Make a distillation trainer compute each rank's part of its loss (see the module docstring)."""
    registry.replace(trainer, "_compute_loss", _on_held_rows, _WHY)
