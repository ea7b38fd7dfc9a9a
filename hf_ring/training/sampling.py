"""TRL trainers that sample their completions during training (GRPO, RLOO, distillation), with the sequence split.

Such a trainer generates completions for its prompts, scores them (GRPO and
RLOO gather the rewards of every process to compute each group's advantages),
and trains on prompt + completion. The ranks of one sequence-parallel group
hold the same prompts, so they act as one process of that trainer:

- they sample the same completions: the model's ``generate`` becomes
  :func:`hf_ring.generate` (the prompt's K/V sharded over the group, every
  rank the same tokens, checked), and every rank of the group is seeded as TRL
  seeds one process, with its data-parallel index (``seed + dp_rank``, where
  TRL adds the process index);
- while the trainer generates and scores, and while it runs the other methods
  :data:`~hf_ring.training.loss_kinds.SAMPLING` lists (GRPO's loss, the
  distillation trainer's sampler), its accelerator counts one process per
  group: ``process_index`` and ``num_processes`` are the data-parallel ones and
  ``gather`` keeps one copy per group, so rewards, advantages (group or batch
  scaled), token counts, logged statistics and generation batches are those of
  one process per group;
- GRPO's and RLOO's generation batch counts one process per group too.

The training forward is then a per-sequence loss over the split sequence
(:mod:`hf_ring.integration.readout`), or the distillation trainer's per-position
one (:mod:`hf_ring.training.distillation`). TRL's vLLM generation is refused:
an external engine is not hf_ring's to split.
"""
from __future__ import annotations

import functools
import sys
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Sequence

import torch
from accelerate.utils import recursively_apply, set_seed

from ..generation.cache import ShardedCache
from ..generation.generate import generate as sharded_generate
from ..integration.groups import SequenceParallel, current
from ..integration.seams import cache_argument
from ..patches import registry


def one_copy_per_replica(gathered: Any, sp: SequenceParallel) -> Any:
    """What ``accelerator.gather`` returned, with one copy per data-parallel replica (the ranks of a replica, its sp
    and tp ranks, gathered the same values)."""

    def keep(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(sp.dp_size, sp.sp_size * sp.tp_size, -1, *t.shape[1:])[:, 0]
        return t.reshape(-1, *t.shape[2:])

    return recursively_apply(keep, gathered)


def check(trainer: Any) -> None:
    """Refuse what a sampling trainer cannot do with the sequence split, before the setup."""
    name = type(trainer).__name__
    if getattr(trainer.args, "use_vllm", False):
        raise ValueError(f"{name} with use_vllm=True generates with an external engine, which hf_ring does not split; "
                         "set use_vllm=False (completions are then sampled with hf_ring.generate, the prompt split)")
    if getattr(trainer.args, "log_completions", False):
        raise ValueError(f"{name} with log_completions=True would list each completion once per rank of its "
                         "sequence-parallel group; set log_completions=False")


def _group_accelerator(accelerator: Any, sp: SequenceParallel) -> type:
    base = type(accelerator)

    class GroupAsProcess(base):
        process_index = property(lambda self: sp.dp_rank)
        num_processes = property(lambda self: sp.dp_size)

        def gather(self, tensor):
            return one_copy_per_replica(base.gather(self, tensor), sp)

    GroupAsProcess.__name__ = GroupAsProcess.__qualname__ = f"OneProcessPerGroup{base.__name__}"
    return GroupAsProcess


def _gather_one_copy(gather: Callable, sp: SequenceParallel) -> Callable:
    return lambda tensor: one_copy_per_replica(gather(tensor), sp)


def _gather_objects_one_copy(gather_object: Callable, sp: SequenceParallel) -> Callable:
    def gather(objects: Any) -> list:
        per_rank = gather_object([list(objects)])  # one list per rank, in rank order
        return [x for part in per_rank[:: sp.sp_size * sp.tp_size] for x in part]

    return gather


_GROUP_WHY = ("a sampling trainer counts the ranks of each sequence-parallel group as one process while it "
              "generates, scores and runs the methods that count processes")


@contextmanager
def one_process_per_group(trainer: Any, sp: SequenceParallel):
    """Inside, ``trainer`` counts the ranks of each sequence-parallel group as one process: its accelerator, and the
    ``gather``/``gather_object`` its TRL module calls (see the module docstring)."""
    accelerator = trainer.accelerator
    modules = {sys.modules[c.__module__] for c in type(trainer).__mro__ if c.__module__.startswith("trl.")}
    gathers = [(m, name, getattr(m, name)) for m in modules for name in ("gather", "gather_object") if hasattr(m, name)]
    with ExitStack() as scope:
        scope.enter_context(registry.scoped(accelerator, "__class__", _group_accelerator(accelerator, sp), _GROUP_WHY))
        for module, name, original in gathers:
            one_copy = (_gather_one_copy if name == "gather" else _gather_objects_one_copy)(original, sp)
            scope.enter_context(registry.scoped(module, name, one_copy, _GROUP_WHY))
        yield


def _as_one_process(method: Callable) -> Callable:
    @functools.wraps(method)
    def run(*args, **kwargs):
        sp = current()
        if sp is None:
            return method(*args, **kwargs)
        with one_process_per_group(method.__self__, sp):
            return method(*args, **kwargs)

    return run


def _generate_split(original: Callable) -> Callable:
    """``model.generate`` under a sequence-parallel setup: hf_ring.generate, which calls transformers' generate with
    its sharded cache (that call, and every call outside the setup, goes to ``original``)."""

    @functools.wraps(original)
    def generate(*args, **kwargs):
        if current() is None or isinstance(cache_argument(kwargs), ShardedCache) or "input_ids" not in kwargs:
            return original(*args, **kwargs)
        return sharded_generate(original.__self__, kwargs.pop("input_ids"), kwargs.pop("attention_mask", None),
                                **kwargs)

    return generate


_WHY = ("a trainer that samples completions (GRPO, RLOO, distillation) under sequence parallelism: its generate is "
        "hf_ring.generate and its scoring (and loss or sampler) count one process per sp group; undone by "
        "clear_sequence_parallel")


def _generation_batch(trainer: Any, sp: SequenceParallel) -> None:
    args = trainer.args
    # TRL sized the generation batch over every process; the ranks of a group share one.
    size = args.per_device_train_batch_size * sp.dp_size * args.steps_per_generation
    if size % trainer.num_generations:
        raise ValueError(
            f"the generation batch over the data-parallel replicas ({size} = per_device_train_batch_size x "
            f"{sp.dp_size} replicas x steps_per_generation) must be a multiple of num_generations "
            f"({trainer.num_generations}), as TRL requires of its processes; the ranks of a sequence-parallel "
            "group count as one process"
        )
    registry.replace(args, "generation_batch_size", lambda _: size, _WHY)


def prepare(trainer: Any, sp: SequenceParallel, methods: Sequence[str]) -> None:
    """Make a sampling trainer act as one process per sequence-parallel group while it samples and runs ``methods``
    (see the module docstring)."""
    if getattr(trainer.args, "generation_batch_size", None) is not None:  # GRPO's and RLOO's
        _generation_batch(trainer, sp)
    registry.replace(trainer.model, "generate", _generate_split, _WHY)
    for name in methods:
        registry.replace(trainer, name, _as_one_process, _WHY)
    # TRL seeds each process apart (seed + process index) so that they sample different completions; a group is one
    # process, its data-parallel replica's (the distillation trainer's device-specific seed is the same sum)
    set_seed(trainer.args.seed + sp.dp_rank)
