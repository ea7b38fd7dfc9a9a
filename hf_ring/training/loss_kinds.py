"""The kinds of loss :func:`hf_ring.prepare_trainer` splits, and which trainer classes it takes with which kind.

A kind is a record (:class:`LossKind`) of what differs between losses under
sequence parallelism; :class:`hf_ring.SequenceParallelTrainerMixin` reads it:

- **per token** (:data:`TOKENS`: ``transformers.Trainer`` on a causal LM, TRL's
  ``SFTTrainer``): each rank's loss is its shard's share of the batch's
  token-averaged loss;
- **per sequence** (:data:`SEQUENCES`: TRL's ``DPOTrainer``, ``KTOTrainer``,
  ``RewardTrainer``, ``GRPOTrainer`` and ``RLOOTrainer``, and any trainer
  given a sequence classifier): the loss is a function of whole sequences (a
  sum of log-probabilities, the score of a row's last token), so every rank is
  handed those values for the whole batch and computes the whole batch's loss
  (:mod:`hf_ring.integration.readout`);
- **per position, from the backbones** (:data:`BACKBONES`: TRL's
  ``DistillationTrainer``): the trainer runs its student's and teacher's
  backbones itself and compares their next-token distributions token by
  token, so each rank adds up the positions it holds
  (:mod:`hf_ring.training.distillation`).

GRPO, RLOO and distillation sample their completions as well:
:mod:`hf_ring.training.sampling` makes the ranks of a group sample and score as
one process. TRL's other trainers are refused by name before anything is set
up; a trainer class of the user's own (not TRL's) is taken as its base.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..entry.media import MediaForward
from ..integration.context import CONTEXT_KEY, ShardedForward
from ..integration.readout import fused_output, is_fused_output, scores_head
from . import distillation


def _nothing(*_: Any) -> None:
    return None


@dataclass(frozen=True)
class LossKind:
    """What differs between losses under sequence parallelism, and what :func:`hf_ring.prepare_trainer` sets up."""

    name: str
    shards_calls: bool  # the model's own calls shard their batch (their logits come back in global order); else the
    # trainer runs backbones whose calls hf_ring shards itself
    whole_loss: bool  # every rank computes the whole batch's loss from per-sequence values handed to every rank
    eval_parts_add_up: bool  # the ranks' evaluation losses are parts of the group's (else each is the group's mean)
    check: Callable[[Any, int], None] = _nothing  # (trainer, tp_size): refuses what the kind cannot split, early
    prepare: Callable[[Any], None] = _nothing  # (trainer): what the kind changes in the trainer


TOKENS = LossKind("per token", shards_calls=True, whole_loss=False, eval_parts_add_up=False)
SEQUENCES = LossKind("per sequence", shards_calls=True, whole_loss=True, eval_parts_add_up=False)
BACKBONES = LossKind("per position, from the backbones", shards_calls=False, whole_loss=False, eval_parts_add_up=True,
                     check=distillation.check, prepare=distillation.prepare)

TRL_TAKEN: Dict[str, LossKind] = {"SFTTrainer": TOKENS, "DPOTrainer": SEQUENCES, "KTOTrainer": SEQUENCES,
                                  "RewardTrainer": SEQUENCES, "GRPOTrainer": SEQUENCES, "RLOOTrainer": SEQUENCES,
                                  "DistillationTrainer": BACKBONES}
"""TRL trainers prepare_trainer takes, by class name, and the kind of their loss (a subclass TRL defines, such as
its experimental ``ServerDistillationTrainer``, is a trainer of its own: refused until checked)."""


def _trl_class(trainer: Any) -> Optional[type]:
    """The first of the trainer's classes that TRL defines (None: a transformers Trainer or the user's own)."""
    for cls in type(trainer).__mro__:
        if cls.__module__.split(".")[0] == "trl":
            return cls
    return None


def refuse_trainer(trainer: Any) -> None:
    """``ValueError`` naming the class and the reason when ``trainer`` is one of TRL's that prepare_trainer does not
    take (see :data:`TRL_TAKEN`); nothing for the others."""
    trl = _trl_class(trainer)
    if trl is None or trl.__name__ in TRL_TAKEN:
        return
    taken = ", ".join(sorted(TRL_TAKEN))
    raise ValueError(f"prepare_trainer does not take TRL's {trl.__name__} ({type(trainer).__name__}): its loss has "
                     "not been checked against one process with the sequence split. "
                     f"Trainers it takes: transformers.Trainer and TRL's {taken}; train with {trl.__name__} without "
                     "prepare_trainer, one sequence per process")


SAMPLING: Dict[str, Tuple[str, ...]] = {
    "GRPOTrainer": ("_generate_and_score_completions", "_compute_loss"),
    "RLOOTrainer": ("_generate_and_score_completions", "_compute_loss"),
    "DistillationTrainer": ("_generate_and_score_completions", "_get_train_sampler"),
}
"""TRL trainers that sample their completions with the model's ``generate`` during training, and their methods that
count processes, gather over them or size the batch by them (:mod:`hf_ring.training.sampling` runs these with one
process per sequence-parallel group)."""


def sampled_methods(trainer: Any) -> Tuple[str, ...]:
    """The methods of ``trainer`` that :data:`SAMPLING` lists (none: the trainer does not sample)."""
    trl = _trl_class(trainer)
    return () if trl is None else SAMPLING.get(trl.__name__, ())


def loss_kind(trainer: Any, model: torch.nn.Module) -> LossKind:
    """:data:`TOKENS`, :data:`SEQUENCES` or :data:`BACKBONES`: how a trainer :func:`refuse_trainer` lets through
    computes its loss. ``model``: the trainer's model with any PEFT wrapper taken off."""
    trl = _trl_class(trainer)
    if trl is not None:
        return TRL_TAKEN[trl.__name__]
    return SEQUENCES if scores_head(model) is not None else TOKENS


def _whole_sequences(module: torch.nn.Module, args: tuple, kwargs: Dict[str, Any], output: Any) -> Any:
    forward = kwargs.get(CONTEXT_KEY)
    if isinstance(forward, MediaForward):
        forward = forward.sharded
    if not isinstance(forward, ShardedForward) or not is_fused_output(output):
        return None
    return fused_output(output, forward, kwargs.get("num_items_in_batch"))


_OUTPUT_HOOK_ATTR = "_hf_ring_sequence_outputs"


def attach_sequence_outputs(model: torch.nn.Module) -> None:
    """Make a fused LM head's per-token outputs (TRL's ``fused_lm_head=True`` calls) of ``model`` come back over the
    whole sequence, in one process's shape, when its batch was sharded (idempotent)."""
    if getattr(model, _OUTPUT_HOOK_ATTR, None) is None:
        setattr(model, _OUTPUT_HOOK_ATTR, model.register_forward_hook(_whole_sequences, with_kwargs=True))
