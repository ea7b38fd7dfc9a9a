"""Tensor parallelism beside sequence parallelism: the model's heads split over a tp group of the (dp, sp, tp) mesh.

transformers shards a model with its own tensor-parallel plan (``q/k/v_proj``
by output rows, ``o_proj`` by input rows, the MLP likewise), so tp rank r of
a group of t holds query heads ``r·Hq/t`` to ``(r+1)·Hq/t`` and the K/V heads
they use. The ring (and head parallelism) then attends those local heads over
the rank's sp group; the only thing it must know is where its heads start,
because a dilated head's offset counts from its global index
(:func:`tensor_parallel_head_base`).

``from_pretrained(tp_plan=..., device_mesh=...)`` in transformers 5 builds
its own tensor-parallel group over every process, whatever mesh it is
given, so a tp group that is one dim of a larger mesh is sharded here
instead (:func:`tensor_parallel`), with transformers' own plan and sharding
code; a model sharded at load time through ``DistributedConfig(tp_size=t,
fsdp_size=...)`` has the same tp groups (tp innermost) and is accepted as it is.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from transformers.distributed import DistributedConfig
from transformers.distributed.tensor_parallel import apply_tensor_parallelism

from ..engine.layout import head_split
from .config import model_heads
from .groups import SequenceParallel, current
from .seams import peft_base, tensor_parallel_problem, trainer_sharding_problem


def check_heads(heads: Optional[Tuple[int, int]], tp_size: int, ulysses_size: int) -> None:
    """Refuse ``(Hq, Hkv)`` heads that ``tp_size`` tensor-parallel ranks and ``ulysses_size`` head-parallel ranks
    cannot share in whole heads (None: the config does not say, nothing to check)."""
    if heads is None:
        return
    hq, hkv = heads
    if hq % tp_size:
        raise ValueError(
            f"tp_size={tp_size} does not divide the model's {hq} query heads: tensor parallelism gives each rank of "
            f"a tp group the same number of whole heads. Choose a tp_size that divides {hq} (1: no tensor parallelism)"
        )
    if hkv % tp_size:
        raise ValueError(
            f"tp_size={tp_size} does not divide the model's {hkv} key/value heads: the tensor-parallel plan splits "
            f"k_proj and v_proj into tp_size blocks of rows, so a rank would hold part of a key/value head. Choose a "
            f"tp_size that divides {hkv} (1: no tensor parallelism)"
        )
    # Head parallelism splits the heads one tensor-parallel rank holds.
    holder = "the model's" if tp_size == 1 else f"each of the tp_size={tp_size} tensor-parallel ranks'"
    head_split(hq // tp_size, hkv // tp_size, ulysses_size, holder, "" if tp_size == 1 else ", or another tp_size")


KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")
"""Names transformers gives the projection whose output holds the attention keys (fused or not)."""


def _splits_heads(plan: Any) -> bool:
    """Whether a tp plan splits the attention by heads: its key projection sharded by output rows, kept local."""
    return isinstance(plan, dict) and any(
        key.rsplit(".", 1)[-1] in KEY_PROJECTIONS and style in ("colwise", "packed_colwise") for key, style in plan.items())


def tp_ranks(model: torch.nn.Module) -> Optional[list]:
    """The ranks of this rank's tensor-parallel group the model's parameters are sharded over (None: not sharded).

    Read from the ``"tp"`` dim of a DTensor parameter's mesh (the name transformers and
    :func:`hf_ring.setup_sequence_parallel` give it; other dims are FSDP2's); a model whose parameters name
    different tp groups is refused.
    """
    found = None
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or "tp" not in (p.device_mesh.mesh_dim_names or ()):
            continue
        mesh = p.device_mesh
        ranks = sorted((mesh["tp"] if mesh.ndim > 1 else mesh).mesh.flatten().tolist())
        if found is not None and ranks != found:
            raise ValueError(f"the model's parameters are tensor-parallel over different groups ({found} and, for "
                             f"{name!r}, {ranks}); shard the whole model over one tp group")
        found = ranks
    return found


_CHECKED = "_hf_ring_tp_checked"


def sharding_error(model: torch.nn.Module, tp_rank: int, tp_size: int) -> Optional[str]:
    """Why ``model`` cannot run under a setup where this rank is ``tp_rank`` of a tp group of ``tp_size``
    (None: it can). Its tensor-parallel group must be that one: ``tp_size`` consecutive ranks, this rank the
    ``tp_rank``-th, as :func:`hf_ring.setup_sequence_parallel` and ``DistributedConfig`` both lay it out; none
    when ``tp_size`` is 1. Checked once per model and setting (the answer is kept on the model)."""
    if model.__dict__.get(_CHECKED) == (tp_rank, tp_size):
        return None
    ranks = tp_ranks(peft_base(model))
    rank = dist.get_rank() if dist.is_initialized() else 0
    want = list(range(rank - tp_rank, rank - tp_rank + tp_size))
    if ranks == want or (ranks is None and tp_size == 1):
        model.__dict__[_CHECKED] = (tp_rank, tp_size)
        return None
    if ranks is None:
        return (f"tp_size={tp_size}, but the model is not tensor-parallel: shard it over sp.tp_mesh with "
                "hf_ring.tensor_parallel(model), or load it with from_pretrained(..., distributed_config="
                f"DistributedConfig(tp_size={tp_size}, fsdp_size=...))")
    if tp_size == 1:
        return (f"the model is tensor-parallel over ranks {ranks}, but the sequence-parallel setup has tp_size=1; "
                f"pass tp_size={len(ranks)} to hf_ring.setup_sequence_parallel (or prepare_trainer)")
    return (f"the model is tensor-parallel over ranks {ranks}, but this setup's tensor-parallel group is {want} "
            f"(tp_size={tp_size}): from_pretrained(tp_plan=...) shards over every process, whatever device_mesh it "
            "is given. Load the model whole and call hf_ring.tensor_parallel(model), or load it with "
            f"distributed_config=DistributedConfig(tp_size={tp_size}, fsdp_size=...)")


def tensor_parallel(model: Any, sp: Optional[SequenceParallel] = None) -> Any:
    """Shard a model loaded whole over this rank's tensor-parallel group (``sp.tp_mesh``), with its own tp plan.

    Every rank loads the same weights (``from_pretrained`` without ``tp_plan``)
    and keeps its slice: transformers' plan for the model (``model.tp_plan``:
    attention heads and MLP split by rows and columns, embeddings and
    ``lm_head`` by the vocabulary) and its sharding code, on the tp dim of
    :func:`hf_ring.setup_sequence_parallel`'s ``(dp, sp, tp)`` mesh. Parameters
    become DTensors; :func:`hf_ring.sync_gradients` reduces their local shards.
    Refuses a setup without tensor parallelism, a model with no tp plan or
    already sharded, and heads that ``tp_size`` and ``ulysses_size`` cannot
    split. Returns the model.
    """
    sp = sp or current()
    if sp is None or sp.tp_size == 1:
        raise ValueError("hf_ring.tensor_parallel needs a setup with tp_size > 1: call "
                         "hf_ring.setup_sequence_parallel(..., tp_size=...) first")
    if not getattr(model, "supports_tp_plan", False) or not _splits_heads(model.tp_plan):
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan that splits its attention heads (transformers' "
            "tp_plan / base_model_tp_plan with a colwise key projection), so its weights cannot be split over the "
            "tp group; give it one (model.tp_plan = {...}), or use tp_size=1"
        )
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("the model is already sharded (its parameters are DTensors); load it whole, without "
                         "tp_plan or distributed_config, before hf_ring.tensor_parallel")
    check_heads(model_heads(model.config), sp.tp_size, sp.ulysses_size)
    unsupported = tensor_parallel_problem(model)
    if unsupported is not None:
        raise NotImplementedError(unsupported)
    # transformers' own resolution of the plan (wildcards to layer names, config overrides), as from_pretrained uses
    plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=sp.tp_size))
    known = set(dict(model.named_parameters())) | set(dict(model.named_modules()))
    tied = {name: style for name, style in plan.items() if name not in known}  # e.g. lm_head.weight = embeddings
    apply_tensor_parallelism(model, sp.tp_mesh, {k: v for k, v in plan.items() if k not in tied})
    if tied:
        model.tie_weights()  # the tied names get their owner's sharded parameter back
        _check_tied(model, tied)
    return model


def _check_tied(model: torch.nn.Module, tied: dict) -> None:
    """A tied weight shares its owner's sharding: refuse it where its own style wants another split."""
    for name, style in tied.items():
        module_name, _, param_name = name.rpartition(".")
        p = getattr(model.get_submodule(module_name), param_name)
        want = 0 if style.startswith(("colwise", "embedding_rowwise")) else 1 if style.startswith("rowwise") else None
        got = [q.dim % p.ndim for q in p.placements if isinstance(q, Shard)] if isinstance(p, DTensor) else []
        if want is None or got != [want]:
            raise ValueError(
                f"{name} is tied to another weight whose tensor-parallel split ({got or 'none'}) is not the one its "
                f"own plan entry {style!r} wants; untie them (config.tie_word_embeddings=False) or use tp_size=1"
            )


def loaded_tp_size(model: Any) -> int:
    """The tensor-parallel size transformers sharded ``model`` with at load time (``DistributedConfig``), else 1."""
    return getattr(peft_base(model), "tp_size", None) or 1


def check_trainer_model(model: Any, tp_size: int, deepspeed: bool) -> None:
    """Refuse a Trainer run whose tensor parallelism the Trainer would reduce wrongly, before any collective.

    The Trainer leaves the reduction of a model sharded at load time by
    transformers to that model (FSDP2, TP); a model sharded afterwards
    (:func:`tensor_parallel`) it would wrap in DDP, which averages DTensor
    shards as if they were whole. The model's tp groups must be the ones
    ``tp_size`` gives (consecutive ranks). Local checks: every rank alike.
    """
    unsupported = trainer_sharding_problem(model)
    if unsupported is not None:
        raise NotImplementedError(unsupported)
    if tp_size > 1 and deepspeed:
        raise ValueError(f"prepare_trainer(tp_size={tp_size}) does not combine with DeepSpeed; use tp_size=1 under "
                         "DeepSpeed, or FSDP2 with tensor parallelism (DistributedConfig(tp_size=..., fsdp_size=...))")
    if tp_size > 1 and not getattr(peft_base(model), "is_distributed_loading_by_transformers", False):
        raise ValueError(
            f"prepare_trainer(tp_size={tp_size}) needs the model sharded at load time by transformers, whose Trainer "
            "then leaves the gradient reduction to it: from_pretrained(path, attn_implementation='ring_dilated', "
            f"distributed_config=DistributedConfig(tp_size={tp_size}, fsdp_size=world_size // {tp_size})). A model "
            "sharded by hf_ring.tensor_parallel is for your own training loop (the Trainer would wrap its DTensor "
            "parameters in DDP)"
        )
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    if world % tp_size == 0:  # else the setup refuses tp_size itself
        error = sharding_error(model, rank % tp_size, tp_size)  # tp innermost: this rank's place in its tp group
        if error is not None:
            raise ValueError(error)


def tensor_parallel_head_base(tp_rank: int, tp_size: int, hq_local: int, hkv_local: int, config: Any) -> int:
    """The global index of the first of this rank's ``hq_local`` query heads: ``tp_rank·hq_local`` (0 without tp).

    transformers' tensor-parallel plan gives tp rank r the r-th contiguous
    slice of the heads; a dilated head's offset counts from its global index,
    so the ring must know where the slice starts. A layer whose local head
    counts are not the model's (``config``) split over ``tp_size`` ranks was
    sharded over another group, or not at all, and is refused.
    """
    if tp_size == 1:
        return 0
    heads = model_heads(config)
    if heads is not None and (hq_local * tp_size, hkv_local * tp_size) != heads:
        raise ValueError(
            f"tp_size={tp_size}: this rank's attention runs {hq_local} query and {hkv_local} key/value heads, but "
            f"the model's {heads[0]} query and {heads[1]} key/value heads over {tp_size} tensor-parallel ranks are "
            f"{heads[0] / tp_size:g} and {heads[1] / tp_size:g} each: the model is not sharded over this setup's "
            "tensor-parallel groups. Shard it with hf_ring.tensor_parallel(model) after "
            "hf_ring.setup_sequence_parallel(..., tp_size=...) (from_pretrained(tp_plan=...) shards over every "
            "process, whatever device_mesh it is given), or load it with distributed_config=DistributedConfig("
            "tp_size=..., fsdp_size=...) whose tp_size is the setup's"
        )
    return tp_rank * hq_local
