"""Sequence parallelism inside ``transformers.Trainer`` and its subclasses (TRL's ``SFTTrainer``).

One call after the trainer is built::

    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val)
    hf_ring.prepare_trainer(trainer, sp_size=2)
    trainer.train()

and a launch with ``accelerate launch`` or ``torchrun``. What the call arranges:

- data: every rank of a sequence-parallel group gets the same batch, only the
  data-parallel replicas differ (accelerate is handed a device mesh whose
  ``"cp"`` dim is the sp group, which is how it feeds its own context parallelism);
- model: every forward of the trainer's model goes through
  :func:`hf_ring.shard_batch` (train, evaluate, predict, a subclass's own loss);
- loss: the trainer counts the label tokens of the global batch once per sp
  group (its context-parallel size is the sp size), so the loss it logs is the
  global one and DDP / FSDP, which average over every rank, leave the shard
  gradients summed over sp and averaged over dp;
- evaluation: logits come back in global order and metrics are gathered over
  the data-parallel replicas only;
- DeepSpeed (ZeRO 1-3): the engine averages over every rank as DDP does, so the
  same loss scaling holds; its config is told the sp size so that its
  ``train_batch_size`` counts each sequence once (:mod:`hf_ring.training.zero`).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from accelerate.data_loader import DataLoaderDispatcher
from accelerate.utils import recursively_apply
from torch.distributed.device_mesh import DeviceMesh

from ..engine.comm import all_reduce
from ..engine.layout import check_ulysses_size
from ..integration import config as ring_config
from ..integration.context import CONTEXT_KEY
from ..integration.readout import is_fused_output, pool_over_shards
from ..integration.groups import SequenceParallel, current
from ..entry.guard import head_error
from ..entry.parallel import check_tp_size, setup_sequence_parallel
from ..integration.seams import TRAINER_DIVIDES_TOKEN_COUNT, cache_argument, peft_base
from ..integration.tp import check_heads, check_trainer_model, loaded_tp_size
from ..patches import multimodal_problem, registry, router_loss
from . import sampling, zero
from .data import batch_shape, gather_sequence, layout_of, model_rows, shard_batch
from .loss_kinds import TOKENS, LossKind, attach_sequence_outputs, loss_kind, refuse_trainer, sampled_methods

_HOOK_ATTR = "_hf_ring_shard_hook"
_PREPARED_ATTR = "_hf_ring_prepared"


def shard_model_inputs(kwargs: Dict[str, Any], sp: Optional[SequenceParallel] = None) -> Dict[str, Any]:
    """The keyword arguments of a model call with the batch sharded for this rank.

    A ``num_items_in_batch`` given by the caller (the trainer's count over the
    gradient-accumulation window) is kept; a batch already sharded is returned as is.
    """
    if CONTEXT_KEY in kwargs:
        return kwargs
    sharded = shard_batch(kwargs, sp)
    if kwargs.get("num_items_in_batch") is not None:
        sharded["num_items_in_batch"] = kwargs["num_items_in_batch"]
    return sharded


@torch.compiler.disable  # shards the batch with a check exchange: outside a compiled graph, on purpose
def _shard_hook(module: torch.nn.Module, args: tuple, kwargs: Dict[str, Any]):
    if current() is None:
        return None
    if cache_argument(kwargs) is not None or kwargs.get("use_cache"):
        return None  # generation: hf_ring.generate splits the prompt and the cache itself
    if args:
        raise TypeError(
            f"under sequence parallelism {type(module).__name__} must be called with keyword arguments "
            "(input_ids=..., labels=...), so the batch can be sharded; got positional arguments"
        )
    if CONTEXT_KEY in kwargs:  # sharded by the caller: the guard saw the call as such
        return None
    kwargs = shard_model_inputs(kwargs)
    # The model's call saw this call unsharded, so the head of a sequence classifier is hooked here, and a mixture
    # of experts' router loss reduced over the group, for this call.
    pool_over_shards(module, kwargs[CONTEXT_KEY], kwargs)
    router_loss.enter(module, kwargs[CONTEXT_KEY])
    return args, kwargs


def router_scale(kind: LossKind, forward: Any, output: Any) -> int:
    """What the gradient of a call's router term is multiplied by for a trainer of ``kind`` (see
    :func:`hf_ring.patches.router_loss.report`): a fused LM head's output feeds TRL's SFT, which adds the term to
    a rank's share of its token loss and leaves it unscaled for the average over every rank, so the group's
    size; 1 for a whole loss (scaled for that average as a whole) and for a model's own loss (a share)."""
    if is_fused_output(output) and not kind.whole_loss:
        return getattr(forward, "world_size", 1)
    return 1


def _sharded_call_done(module: torch.nn.Module, args: tuple, kwargs: Dict[str, Any], output: Any, *,
                       kind: LossKind):
    forward = kwargs.get(CONTEXT_KEY)
    return router_loss.leave(module, forward, output, router_scale(kind, forward, output))


def attach_shard_hook(model: torch.nn.Module, kind: LossKind) -> None:
    """Make every call of ``model`` shard its batch when a sequence-parallel setup is active, its router term
    reported for a trainer of ``kind`` (idempotent: the first kind stays)."""
    if getattr(model, _HOOK_ATTR, None) is None:
        setattr(model, _HOOK_ATTR, model.register_forward_pre_hook(_shard_hook, with_kwargs=True))
        model.register_forward_hook(functools.partial(_sharded_call_done, kind=kind), with_kwargs=True,
                                    always_call=True)


def data_mesh(sp: SequenceParallel, deepspeed: bool = False):
    """The sp setup as a device mesh accelerate's data loaders read, over the same groups.

    Its dims are ``("dp_replicate", "cp")``, or ``("dp", "tp")`` under DeepSpeed, whose branch of accelerate's
    loader preparation reads only a ``"tp"`` dim: either way the ranks of one sp group load the same batches.
    """
    names = ("dp", "tp") if deepspeed else ("dp_replicate", "cp")
    groups = [sp.dp_group, sp.sp_group]
    if sp.tp_size > 1:  # a tp group (sp.mesh's innermost dim) shares one batch too: accelerate's own "tp" dim
        groups, names = groups + [sp.tp_group], names + ("tp",)
    return DeviceMesh.from_group(groups, sp.mesh.device_type, mesh=sp.mesh.mesh, mesh_dim_names=names)


@contextmanager
def _mesh_for_data(accelerator: Any, mesh: Any):
    # Only data loaders may see the mesh: accelerate's FSDP2 and TP preparation read the same attribute.
    state = accelerator.state
    saved = state.device_mesh
    state.device_mesh = mesh
    try:
        yield
    finally:
        state.device_mesh = saved


def _refuse_dispatch(loader: Any) -> None:
    if isinstance(loader, DataLoaderDispatcher):
        raise ValueError(
            "under sequence parallelism every rank must load its own batches: dispatching batches from rank 0 "
            "(an IterableDataset, or accelerator_config={'dispatch_batches': True}) would give the ranks of one "
            "sequence different rows; pass TrainingArguments(accelerator_config={'dispatch_batches': False})"
        )


def _global_order(tree: Any, n: int, local: int, layout: Any) -> Any:
    """Every tensor of ``tree`` whose dim 1 is this rank's shard length, put back in global order."""
    if isinstance(tree, torch.Tensor):
        return gather_sequence(tree, n, layout=layout) if tree.dim() >= 2 and tree.shape[1] == local else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(_global_order(t, n, local, layout) for t in tree)
    if isinstance(tree, Mapping):
        return type(tree)({k: _global_order(v, n, local, layout) for k, v in tree.items()})
    return tree


def _sp_sum(loss: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The sum over the sp group of the ranks' (shard) losses, held by each of them."""
    loss = loss.detach().clone()
    all_reduce(loss, sp.sp_group, "the loss sum over the sequence-parallel group")
    return loss


def _sp_mean(loss: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The mean over the sp group of the ranks' (shard) losses, held by each of them."""
    return _sp_sum(loss, sp) / sp.sp_size


def _once_per_group(before: int, after: int, sp: SequenceParallel) -> int:
    """A count the trainer moved from ``before`` to ``after`` by adding up every rank's batch, counted once per sp
    group (its ranks share one batch)."""
    return before + (after - before) // sp.sp_size


class SequenceParallelTrainerMixin:
    """Put before a ``transformers.Trainer`` class to train with the sequence split over the sp group.

    :func:`prepare_trainer` applies it to a built trainer, with the kind of the
    trainer's loss (:class:`hf_ring.training.loss_kinds.LossKind`, per token
    unless set). Subclassing works too (``class T(SequenceParallelTrainerMixin,
    SFTTrainer)``) with the model loaded with ``attn_implementation="ring_dilated"``
    and :func:`hf_ring.setup_sequence_parallel` called before training. With no
    active sequence-parallel setup every method is the base class's.
    """

    loss_kind: LossKind = TOKENS

    def get_cp_size(self) -> int:
        # The ranks of an sp group see one batch: the trainer divides its token count by this and sizes the
        # global batch with it, exactly as for accelerate's context parallelism.
        sp = current()
        return super().get_cp_size() * (sp.sp_size if sp is not None else 1)

    def _loader(self, build):
        sp = current()
        if sp is None:
            return build()
        with _mesh_for_data(self.accelerator, data_mesh(sp, self.is_deepspeed_enabled)):
            loader = build()
        _refuse_dispatch(loader)
        return loader

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        count = super()._get_num_items_in_batch(batch_samples, device)
        sp = current()
        if sp is None or count is None or TRAINER_DIVIDES_TOKEN_COUNT:
            return count
        # The ranks of an sp group count one batch: the count is the group's share, as later releases make it.
        return count / sp.sp_size

    def get_train_dataloader(self):
        return self._loader(super().get_train_dataloader)

    def get_eval_dataloader(self, eval_dataset=None):
        build = super().get_eval_dataloader
        return self._loader(lambda: build(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        build = super().get_test_dataloader
        return self._loader(lambda: build(test_dataset))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        sp = current()
        if sp is None or not self.loss_kind.shards_calls:
            # (a trainer that runs its backbones itself has them sharded by the kind's own preparation)
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        attach_shard_hook(self.model, self.loss_kind)
        tokens = getattr(self, "_total_train_tokens", None)
        if not self.loss_kind.whole_loss and num_items_in_batch is None and inputs.get("labels") is not None:
            # A shard's loss is a share of the sequence loss: normalise every shard by the global token count,
            # counted the trainer's way (a collective: every rank evaluates the same number of batches).
            num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if self.model.training and (self.loss_kind.whole_loss or num_items_in_batch is None):
            # DDP and DeepSpeed average over dp x sp, where the sp group's gradients add up (a whole loss on every
            # rank, or a share the model normalised by the batch's global count through shard_batch)
            out = (out[0] * sp.sp_size, out[1]) if return_outputs else out * sp.sp_size
        if tokens is not None and self.model.training and self._total_train_tokens != tokens:
            # TRL's trainers add up the tokens of every rank's batch; the ranks of an sp group share one.
            self._total_train_tokens = _once_per_group(tokens, self._total_train_tokens, sp)
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return out

    def training_step(self, model, inputs, num_items_in_batch=None):
        sp = current()
        if sp is not None and self.is_deepspeed_enabled:
            # compute_loss scales the loss for an average over every rank
            zero.check_engine(model, sp.sp_size, sp.dp_size, sp.tp_size)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if sp is None:
            return loss
        # The trainer logs the mean over all ranks (unchanged by this) but reports its last unlogged steps from
        # rank-local values: make those the sp group's, as a run without the split would have (a whole loss on
        # every rank was scaled for backward).
        loss = _sp_mean(loss, sp)
        return loss / sp.sp_size if self.loss_kind.whole_loss else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        sp = current()
        if sp is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        shards = self.loss_kind.shards_calls
        if shards:
            attach_shard_hook(self.model, self.loss_kind)
            if not prediction_loss_only:
                inputs = dict(inputs, return_logits=True)  # the sequence-tiled loss would not make them
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if loss is not None:  # one value per sp group, for a gather over the dp replicas
            loss = _sp_sum(loss, sp) if self.loss_kind.eval_parts_add_up else _sp_mean(loss, sp)
        if logits is not None and shards:
            n = batch_shape(inputs)[1]
            layout = layout_of(inputs, sp)
            logits = _global_order(logits, n, model_rows(n, sp, layout), layout)
        return loss, logits, labels

    def evaluation_loop(self, *args, **kwargs):
        if current() is None:
            return super().evaluation_loop(*args, **kwargs)
        saved, self.gather_function = self.gather_function, self._gather_over_dp
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = saved

    def _gather_over_dp(self, data):
        """``accelerator.gather_for_metrics`` with one copy per sp group (all its ranks hold the same values)."""
        gathered = sampling.one_copy_per_replica(self.accelerator.gather(data), current())
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the samples accelerate repeated to even out the last batch
            return recursively_apply(lambda t: t[: state.remainder], gathered)
        return gathered

    def _track_num_input_tokens(self, inputs):
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        sp = current()
        if sp is not None:  # every rank of an sp group counted the same batch
            self.state.num_input_tokens_seen = _once_per_group(before, self.state.num_input_tokens_seen, sp)


_CLASSES: Dict[Tuple[type, LossKind], type] = {}


_TRAINER_WHY = ("its class gains SequenceParallelTrainerMixin (sharded batches, one sequence's loss over the group, "
                "sp-aware data loaders and checkpoints); undone by clear_sequence_parallel")


def _sequence_parallel_class(cls: type, kind: LossKind = TOKENS) -> type:
    if issubclass(cls, SequenceParallelTrainerMixin):
        return cls
    if (cls, kind) not in _CLASSES:
        _CLASSES[cls, kind] = type(f"SequenceParallel{cls.__name__}", (SequenceParallelTrainerMixin, cls),
                                   {"loss_kind": kind})
    return _CLASSES[cls, kind]


def _use_ring_attention(model: torch.nn.Module) -> None:
    base = peft_base(model)
    if not ring_config.runs_ring(base.config):
        base.set_attn_implementation(ring_config.ATTN_IMPLEMENTATION)


COMPANIONS = ("ref_model", "teacher_model")
"""Trainer attributes holding models that read the same sequences as the trained one (DPO's reference, a
distillation teacher)."""


def _companions(trainer: Any) -> list:
    """The models of :data:`COMPANIONS` the trainer holds, unwrapped."""
    held = (getattr(trainer, name, None) for name in COMPANIONS)
    return [trainer.accelerator.unwrap_model(model) for model in held if model is not None]


def _training_started(trainer: Any) -> bool:
    """Whether ``trainer.train()`` has run or is running (a callback calls in from inside it)."""
    state = getattr(trainer, "state", None)
    # train() sets is_in_train on entry; the state's max_steps (0 until then) and global_step stay set after it.
    return bool(getattr(trainer, "is_in_train", False) or getattr(state, "max_steps", 0)
                or getattr(state, "global_step", 0))


def _refuse_misuse(trainer: Any, sp_size: Optional[int], layout: str, ulysses_size: Optional[int]) -> None:
    """Refuse a second call and a call once training has started: the same, local outcome on every rank."""
    done = getattr(trainer, _PREPARED_ATTR, None)
    if done is not None:
        raise ValueError(
            f"prepare_trainer was already called on this trainer ({done}); the second call "
            f"({_describe(sp_size, layout, ulysses_size)}) is refused and the first call's setup stays in force. "
            "Call hf_ring.prepare_trainer once per trainer, after building it and before train(); for another "
            "split, build a new trainer and prepare that one"
        )
    if _training_started(trainer):
        raise ValueError(
            "prepare_trainer was called after trainer.train() started (e.g. from a callback): the model, optimizer "
            "and data loaders are already built for an unsplit run. Call hf_ring.prepare_trainer(trainer, sp_size=...) "
            "once, after building the trainer and before trainer.train()"
        )


def _describe(sp_size: Optional[int], layout: str, ulysses_size: Optional[int]) -> str:
    return f"sp_size={sp_size}, layout={layout!r}, ulysses_size={ulysses_size}"


def _deepspeed_config(trainer: Any) -> Optional[dict]:
    """The trainer's DeepSpeed config (the dict its engine will be built from), None without DeepSpeed."""
    return trainer.accelerator.state.deepspeed_plugin.deepspeed_config if trainer.is_deepspeed_enabled else None


def prepare_trainer(trainer: Any, sp_size: Optional[int] = None, layout: Optional[str] = None,
                    ulysses_size: Optional[int] = None, tp_size: Optional[int] = None) -> Any:
    """Make a built ``transformers.Trainer`` (or subclass, e.g. TRL's ``SFTTrainer``) split every sequence over ``sp_size`` ranks.

    Call it once, after the trainer is built and before ``train``/``evaluate``/``predict``;
    a second call, or one after ``train()`` has started (e.g. from a callback), raises ``ValueError``.
    The remaining factor of the world is data parallel. Sets up the groups
    (:func:`hf_ring.setup_sequence_parallel` with the trainer's accelerator),
    switches the model's attention to ``ring_dilated`` and returns the trainer.
    ``ulysses_size`` picks the ring (1), head parallelism (``sp_size``) or both
    (see :func:`hf_ring.setup_sequence_parallel`); ``layout`` and
    ``ulysses_size`` default to the model config's ``ring_dilated`` values
    (:func:`hf_ring.configure`), else ``"zigzag"`` and 1, and one given here
    that differs from the config's is refused before the setup, naming both.
    ``tp_size``: the tensor-parallel size of a model sharded at load time
    (``DistributedConfig(tp_size=..., fsdp_size=...)``), by default the model's own.
    Under DeepSpeed (ZeRO 1-3) it refuses DeepSpeed's own sequence or tensor
    parallelism and sizes its ``train_batch_size`` over the data-parallel
    replicas (:mod:`hf_ring.training.zero`). In one process it only switches the attention.
    """
    from transformers import Trainer  # here, not at the top: importing it costs seconds that `import hf_ring` need not pay

    if not isinstance(trainer, Trainer):
        raise TypeError(f"trainer must be a transformers.Trainer (or subclass), got {type(trainer).__name__}")
    refuse_trainer(trainer)
    sampled = sampled_methods(trainer)
    if sampled:
        sampling.check(trainer)
    _refuse_misuse(trainer, sp_size, layout, ulysses_size)
    if getattr(trainer, "model_init", None) is not None:
        raise ValueError("prepare_trainer needs a trainer built with model=..., not model_init")
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if tp_size is None:
        tp_size = loaded_tp_size(trainer.model)
    # The Trainer itself sets accelerate's tp_size from a model sharded at load time: that one is the model's.
    if pc is not None and (pc.cp_enabled or pc.sp_enabled or (pc.tp_enabled and pc.tp_size != tp_size)):
        raise ValueError("prepare_trainer splits sequences itself; remove cp_size/sp_size/tp_size from parallelism_config")
    base = peft_base(trainer.model)
    kind = loss_kind(trainer, base)
    kind.check(trainer, tp_size)
    unsplit_head = head_error(base)
    if unsplit_head is not None:  # the model's own call is seen unsharded by the guard: refused here instead
        raise unsplit_head
    problem = multimodal_problem(base, given_media=False)
    if problem is not None:
        raise ValueError(problem)
    saved = ring_config.parse(getattr(ring_config.decoder_config(base.config), ring_config.CONFIG_KEY, None))
    layout = saved.layout if layout is None else layout
    ulysses_size = saved.ulysses_size or 1 if ulysses_size is None else ulysses_size
    conflict = ring_config.shape_conflict(saved, layout, ulysses_size)
    if conflict is not None:
        raise ValueError(conflict)
    for model in [base] + _companions(trainer):  # now, not at the first step
        heads = ring_config.model_heads(model.config)
        if heads is not None:
            check_heads(heads, check_tp_size(tp_size), check_ulysses_size(ulysses_size))
    check_trainer_model(trainer.model, tp_size, trainer.is_deepspeed_enabled)
    ds_config = _deepspeed_config(trainer)
    if ds_config is not None:  # refused before the setup, which is a collective
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        zero.check_config(ds_config, world if sp_size is None else sp_size)
    sp = setup_sequence_parallel(trainer.accelerator, sp_size, layout=layout, ulysses_size=ulysses_size,
                                 tp_size=tp_size, balance_for=base)
    if ds_config is not None:
        zero.count_sequences_once(ds_config, sp.sp_size, sp.dp_size)
    registry.replace(trainer, "__class__", lambda cls: _sequence_parallel_class(cls, kind), _TRAINER_WHY)
    for model in [trainer.model] + _companions(trainer):
        _use_ring_attention(model)
        if kind.shards_calls:  # (distillation calls its models positionally, through TRL: its backbones are split)
            attach_shard_hook(model, kind)
        if kind.whole_loss:
            attach_sequence_outputs(model)
    kind.prepare(trainer)
    if sampled:
        sampling.prepare(trainer, sp, sampled)
    setattr(trainer, _PREPARED_ATTR, _describe(sp.sp_size, sp.layout, sp.ulysses_size))
    return trainer
