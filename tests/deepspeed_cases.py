"""DeepSpeed runs on gloo ranks (module-level functions, so they pickle) and the one-process runs they must equal.

On a machine without GPUs DeepSpeed runs with ``DS_ACCELERATOR=cpu`` over gloo.
accelerate's CPU mode turns DeepSpeed off, and without it accelerate's state has
no backend on CPUs (one process), so the ranks build that state themselves with
the gloo backend (``deepspeed_state``), as docs/training.md tells users to.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager

import torch
import torch.distributed as dist

import hf_ring
from hf_ring.integration.seams import enable_checkpointing
from trainer_cases import GradRecorder, RowDataset, distillation_case, trainer_data
from models import batch, load

LR = 0.5
ACCUM = 2
"""Micro-batches per optimizer step: the Trainer's and DeepSpeed's accumulation are both exercised."""
STEPS = 2
SEQ = 23
"""Tokens per row: an odd length, so the zigzag shards differ in size."""
PREDICT_ROWS = 3


def ds_env() -> None:
    """The environment DeepSpeed and accelerate read, for this rank of the running gloo world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.pop("ACCELERATE_USE_CPU", None)  # accelerate's CPU mode would turn DeepSpeed off
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", DS_ACCELERATOR="cpu")


def deepspeed_state(gloo: bool = True) -> None:
    """A fresh accelerate state for DeepSpeed over this world (``gloo=False``: left to accelerate, one process here)."""
    import deepspeed
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    ds_env()
    deepspeed.init_distributed("gloo")
    AcceleratorState._reset_state(reset_partial_state=True)
    if gloo:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        try:
            PartialState(backend="gloo")
        finally:
            del os.environ["ACCELERATE_USE_DEEPSPEED"]


def ds_config(stage: int, **extra) -> dict:
    """A ZeRO config whose batch sizes, accumulation and clipping the Trainer fills in."""
    return {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", **extra}


def training_args(out_dir, per_device, **kw):
    """The arguments both the DeepSpeed runs and the one-process references train with (fp32, SGD, constant lr)."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=per_device, per_device_eval_batch_size=2,
        gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0,
        train_sampling_strategy="sequential", disable_tqdm=True, save_strategy="no", **kw)


class EngineGradRecorder:
    """Every optimizer step's full gradients, read inside the engine's step (after the reduction, before the update).

    Under DeepSpeed, accelerate steps the engine inside ``backward``, so a Trainer callback sees cleared gradients;
    under ZeRO-3 each rank holds a partition, gathered here with ``safe_get_full_grad``.
    """

    def __init__(self, model):
        self.model, self.steps = model, []

    def attach(self, engine) -> None:
        step = engine.step

        def recorded(*args, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                self.record()
            return step(*args, **kwargs)

        engine.step = recorded

    def record(self) -> None:
        from deepspeed.utils import safe_get_full_grad

        grads = {}
        for name, p in self.model.named_parameters():
            g = safe_get_full_grad(p)  # a collective under ZeRO-3: every rank asks for every parameter
            if g is not None:
                grads[name] = g.detach().clone().view(getattr(p, "ds_shape", p.shape))
        self.steps.append(grads)

    def callback(self, trainer):
        from transformers import TrainerCallback

        recorder = self

        class Attach(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                recorder.attach(trainer.model_wrapped)

        return Attach()


def full_params(model) -> dict:
    """Every parameter, gathered whole under ZeRO-3."""
    import deepspeed

    out = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def eval_data(rows: int, pad: str):
    return RowDataset(trainer_data(2, rows, SEQ, pad)) if rows else None


def evaluated(trainer, result: dict) -> dict:
    """``result`` with the trainer's ``eval_loss`` and ``predict`` logits."""
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    result["logits"] = torch.as_tensor(trainer.predict(RowDataset(trainer_data(3, PREDICT_ROWS, SEQ))).predictions)
    return result


@contextmanager
def tiling_spy():
    """Counts of tiled-loss calls and of tiled-rows calls on more rows than a chunk (so chunked), while active."""
    import hf_ring.patches.tiling as tiling

    counts = {"loss": 0, "rows": 0}
    loss, rows = tiling.tiled_causal_lm_loss, tiling.tiled_rows

    def counted_loss(*args, **kwargs):
        counts["loss"] += 1
        return loss(*args, **kwargs)

    def counted_rows(fn, x, params, chunk_rows=None, others=()):
        counts["rows"] += chunk_rows is not None and x[..., 0].numel() > chunk_rows
        return rows(fn, x, params, chunk_rows, others)

    tiling.tiled_causal_lm_loss, tiling.tiled_rows = counted_loss, counted_rows
    try:
        yield counts
    finally:
        tiling.tiled_causal_lm_loss, tiling.tiled_rows = loss, rows


def _loss_kwargs_off(trainer) -> None:
    # The Trainer then normalises each micro-batch by its own tokens and divides by the accumulation steps,
    # and hf_ring scales the shard losses itself (the path of models whose forward takes no loss kwargs).
    trainer.model_accepts_loss_kwargs = False


def ds_trainer_case(path, sp_size, *, stage=3, ulysses_size=None, tiling=False, offload=False, loss_kwargs=True,
                    eval_rows=3, eval_pad="right"):
    """A Trainer run under DeepSpeed ZeRO ``stage`` with ``hf_ring.prepare_trainer``; the trained model's results.

    One row per replica and micro-batch. ``tiling`` tiles the loss, MLP and norms over chunks of a few rows (so
    the chunking really happens at this length); ``offload`` turns on gradient checkpointing with
    ``hf_ring.offload_checkpoints``; ``eval_rows=0``: neither evaluation nor predictions.
    """
    from transformers import Trainer
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    deepspeed_state()
    world = dist.get_world_size()
    model = load(path, "ring_dilated").train()
    if tiling:
        hf_ring.configure_tiling(model, loss=True, mlp=True, norm=True, loss_chunk_rows=5, row_chunk_rows=4)
    if offload:
        enable_checkpointing(model)
        hf_ring.offload_checkpoints(model)
    args = training_args(tempfile.mkdtemp(prefix="hf_ring_ds_"), 1, deepspeed=ds_config(stage),
                         accelerator_config={"use_configured_state": True})
    rows = ACCUM * STEPS * (world // sp_size)
    recorder = EngineGradRecorder(model)
    trainer = Trainer(model=model, args=args, train_dataset=RowDataset(trainer_data(1, rows, SEQ)),
                      eval_dataset=eval_data(eval_rows, eval_pad))
    trainer.add_callback(recorder.callback(trainer))
    if not loss_kwargs:
        _loss_kwargs_off(trainer)
    try:
        hf_ring.prepare_trainer(trainer, sp_size, ulysses_size=ulysses_size)
        with tiling_spy() as tiled:
            trainer.train()
        engine = trainer.model_wrapped
        result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "grads": recorder.steps,
                  "params": full_params(trainer.model), "engine": type(engine).__name__,
                  "train_batch_size": engine.train_batch_size(), "reduced_over": engine.seq_dp_world_size,
                  "tiled": tiled}
        result = evaluated(trainer, result) if eval_rows else result
        return result if dist.get_rank() == 0 else {"losses": result["losses"]}
    finally:
        hf_ring.clear_sequence_parallel()
        unset_hf_deepspeed_config()  # a later load in this process must not partition at load time


def trainer_reference(path, *, per_device=1, loss_kwargs=True, eval_rows=3, eval_pad="right"):
    """The same training with a plain Trainer in one process, no DeepSpeed and no hf_ring (sdpa, whole batches).

    ``per_device``: the rows of all data-parallel replicas of the run it is compared with, in one micro-batch.
    """
    from accelerate.state import AcceleratorState
    from transformers import Trainer

    AcceleratorState._reset_state(reset_partial_state=True)
    model = load(path, "sdpa").train()
    args = training_args(tempfile.mkdtemp(prefix="hf_ring_ref_"), per_device, use_cpu=True)
    recorder = GradRecorder()
    train = RowDataset(trainer_data(1, per_device * ACCUM * STEPS, SEQ))
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=eval_data(eval_rows, eval_pad),
                      callbacks=[recorder.callback])
    if not loss_kwargs:
        _loss_kwargs_off(trainer)
    trainer.train()
    result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "grads": recorder.steps,
              "params": {k: v.detach().clone() for k, v in trainer.model.named_parameters()}}
    return evaluated(trainer, result) if eval_rows else result


def loop_batch(step: int, micro: int, replica: int, dp: int):
    """The row replica ``replica`` of ``dp`` trains on at one micro-step (the same on every rank of its sp group)."""
    return batch(100 + (step * 1000 + micro) * dp + replica, 1, SEQ, pad="right")


def ds_loop_case(path, sp_size, *, stage=3):
    """An accelerate loop with a DeepSpeedPlugin: ``setup_sequence_parallel``, ``shard_batch``, ``sp.loss_scale``."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    deepspeed_state(gloo=False)
    dp = dist.get_world_size() // sp_size
    # train_batch_size and sequence_parallel_size as docs/training.md gives them: DeepSpeed counts each sequence once
    config = {"zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUM,
              "train_batch_size": ACCUM * dp, "sequence_parallel_size": sp_size, "gradient_clipping": 0.0}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    sp = hf_ring.setup_sequence_parallel(accelerator, sp_size=sp_size)
    try:
        model = load(path, "ring_dilated").train()
        engine, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        recorder = EngineGradRecorder(model)
        recorder.attach(engine)
        for step in range(STEPS):
            for micro in range(ACCUM):
                with accelerator.accumulate(engine):
                    data = loop_batch(step, micro, sp.dp_rank, sp.dp_size)
                    out = engine(**hf_ring.shard_batch(data))
                    accelerator.backward(out.loss * sp.loss_scale)  # the engine averages over dp x sp ranks
                    optimizer.step()
                    optimizer.zero_grad()
        result = {"grads": recorder.steps, "params": full_params(model), "train_batch_size": engine.train_batch_size(),
                  "reduced_over": engine.seq_dp_world_size}
        try:
            hf_ring.sync_gradients(model)
        except ValueError as err:
            result["sync_gradients"] = str(err)
        return result if dist.get_rank() == 0 else {}
    finally:
        hf_ring.clear_sequence_parallel()


def loop_reference(path, dp):
    """The same loop in one process: every replica's rows, each micro-batch's mean loss averaged, SGD."""
    model = load(path, "sdpa").train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            for replica in range(dp):
                (model(**loop_batch(step, micro, replica, dp)).loss / (ACCUM * dp)).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return {"grads": grads, "params": {k: p.detach().clone() for k, p in model.named_parameters()}}


def ds_refusal_case(path, sp_size, *, extra=None, gloo=True, stage=3):
    """The error ``prepare_trainer`` raises on this rank for a DeepSpeed config with ``extra`` keys (None: none)."""
    from transformers import Trainer
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    deepspeed_state(gloo=gloo)
    model = load(path, "ring_dilated").train()
    kw = {"accelerator_config": {"use_configured_state": True}} if gloo else {}
    args = training_args(tempfile.mkdtemp(prefix="hf_ring_ds_"), 1, deepspeed=ds_config(stage, **(extra or {})), **kw)
    trainer = Trainer(model=model, args=args, train_dataset=RowDataset(trainer_data(1, 4, SEQ)))
    try:
        hf_ring.prepare_trainer(trainer, sp_size)
    except ValueError as err:
        return str(err)
    finally:
        hf_ring.clear_sequence_parallel()
        unset_hf_deepspeed_config()
    return None


def ds_distillation_case(path, teacher, sp_size, *, stage=3):
    """TRL's DistillationTrainer under DeepSpeed ZeRO ``stage`` (the teacher prepared by TRL for it) with
    ``hf_ring.prepare_trainer``: :func:`trainer_cases.distillation_case`'s result."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    deepspeed_state()
    try:
        return distillation_case(path, teacher, sp_size, engine=(ds_config(stage), EngineGradRecorder, full_params),
                                 dtype=torch.float32)  # DeepSpeed takes no float64
    finally:
        unset_hf_deepspeed_config()
