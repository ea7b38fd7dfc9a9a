"""Rank functions of the Trainer and TRL tests (module-level so they pickle)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

import hf_ring
from hf_ring.integration.seams import CHECKPOINTING_ARGUMENT, checkpointing_on


class RowDataset(torch.utils.data.Dataset):
    """Rows of a dict of (rows, n) tensors, as a Trainer dataset."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data["input_ids"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.data.items()}


class GradRecorder:
    """A Trainer callback keeping each optimizer step's gradients of the trainable parameters (full tensors)."""

    def __init__(self):
        from transformers import TrainerCallback

        self.steps = []
        self.callback = type("Recorder", (TrainerCallback,), {"on_pre_optimizer_step": self._record})()

    def _record(self, args, state, control, model=None, **kwargs):
        from torch.distributed.tensor import DTensor

        grads = {}
        for name, p in model.named_parameters():
            if p.requires_grad and p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name.replace("module.", "")] = g.detach().clone()
        self.steps.append(grads)


def trainer_env():
    """Point accelerate at the running gloo world (the pool starts it from a file, not from the environment)."""
    import os

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", ACCELERATE_USE_CPU="true")

def example(name):
    """The module of ``examples/<name>.py`` (the examples folder put on the import path once)."""
    import importlib
    import os
    import sys

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def example_case(name, argv):
    """``examples/<name>.py``'s main on every rank (as under torchrun)."""
    from accelerate.state import AcceleratorState

    trainer_env()
    AcceleratorState._reset_state()
    return example(name).main(argv)


def trainer_data(seed, rows, n, pad="right"):
    """Rows of random tokens (by default the first right-padded, labels -100 on padding)."""
    from models import batch

    return batch(seed, rows, n, pad=pad)


@dataclass
class TrainerRun:
    """How :func:`trainer_case` trains: its batch, steps, model options and what it returns."""

    per_device: int = 1
    accum: int = 2
    steps: int = 2
    n: int = 23
    lora: bool = False
    checkpointing: bool = False
    fsdp: bool = False
    eval_rows: int = 3
    eval_pad: str = "right"
    predict_rows: int = 3
    resume_at: Optional[int] = None
    layout: str = "zigzag"
    out_dir: Optional[str] = None
    ulysses_size: Optional[int] = None


def trainer_case(path, sp_size=None, **options):
    """Train a tiny model with transformers.Trainer (sequence parallel when sp_size is given), then evaluate and predict
    (``options``: the fields of :class:`TrainerRun`).

    Returns logged losses, every optimizer step's gradients, eval_loss, predicted logits and final parameters.
    """
    import tempfile

    from accelerate.state import AcceleratorState
    from models import load
    from transformers import Trainer, TrainingArguments

    run = TrainerRun(**options)
    trainer_env()
    AcceleratorState._reset_state()
    world = dist.get_world_size() if dist.is_initialized() else 1
    kw = {}
    if run.fsdp:  # transformers shards the model with FSDP2 at load time (accelerate's FSDP plugin needs GPUs)
        from transformers.distributed import DistributedConfig

        kw["distributed_config"] = DistributedConfig(fsdp_size=world)
    model = load(path, "sdpa" if sp_size is None else "ring_dilated", **kw).train()
    if run.lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # the adapters' random initial values, the same in every process
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False, lora_dropout=0.0))
    rows = run.per_device * run.accum * run.steps * (world // (sp_size or 1))
    run.out_dir = run.out_dir or tempfile.mkdtemp(prefix="hf_ring_trainer_")  # ranks that resume share one directory
    args = TrainingArguments(
        output_dir=run.out_dir, per_device_train_batch_size=run.per_device, per_device_eval_batch_size=2,
        gradient_accumulation_steps=run.accum, max_steps=run.steps, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, use_cpu=True,
        train_sampling_strategy="sequential", disable_tqdm=True, **{CHECKPOINTING_ARGUMENT: run.checkpointing},
        save_strategy="steps" if run.resume_at else "no", save_steps=run.resume_at or 500,
    )
    recorder = GradRecorder()
    trainer = Trainer(model=model, args=args, train_dataset=RowDataset(trainer_data(1, rows, run.n)),
                      eval_dataset=RowDataset(trainer_data(2, run.eval_rows, run.n, run.eval_pad)),
                      callbacks=[recorder.callback])
    if sp_size is not None:
        hf_ring.prepare_trainer(trainer, sp_size, layout=run.layout, ulysses_size=run.ulysses_size)
    try:
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result = {"losses": losses, "grads": recorder.steps, "eval_loss": trainer.evaluate()["eval_loss"]}
        if run.predict_rows:
            pred = trainer.predict(RowDataset(trainer_data(3, run.predict_rows, run.n)))
            result["logits"], result["label_ids"] = torch.as_tensor(pred.predictions), torch.as_tensor(pred.label_ids)
            unlabelled = {k: v for k, v in trainer_data(3, run.predict_rows, run.n).items() if k != "labels"}
            result["logits_unlabelled"] = torch.as_tensor(trainer.predict(RowDataset(unlabelled)).predictions)
        from torch.distributed.tensor import DTensor

        params = dict(trainer.model.named_parameters())
        result["params"] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                            for k, v in params.items()}
        result["wrapped"] = type(trainer.model_wrapped).__name__
        result["dtensor"] = any(isinstance(v, DTensor) for v in params.values())
        result["checkpointing"] = checkpointing_on(trainer.model)
        sp = hf_ring.integration.groups.current()
        result["ulysses_size"] = None if sp is None else sp.ulysses_size
        if run.resume_at:
            result["resumed"] = _resume_case(trainer, f"{run.out_dir}/checkpoint-{run.resume_at}", sp_size, run.layout)
        return result if not dist.is_initialized() or dist.get_rank() == 0 else {"losses": losses}
    finally:
        hf_ring.clear_sequence_parallel()


def _resume_case(trainer, checkpoint, sp_size, layout):
    """Train again from a saved checkpoint: the final parameters must equal the uninterrupted run's."""
    from transformers import Trainer

    from models import load

    model = load(checkpoint, "sdpa" if sp_size is None else "ring_dilated").train()
    again = Trainer(model=model, args=trainer.args, train_dataset=trainer.train_dataset)
    if sp_size is not None:
        hf_ring.prepare_trainer(again, sp_size, layout=layout)
    again.train(resume_from_checkpoint=checkpoint)
    return {k: v.detach().clone() for k, v in again.model.named_parameters()}


def sft_case(path, sp_size=None, *, padding_free=False, steps=2, per_device=2, accum=2, dtype=torch.float32,
             attn=None, layout=None, **load):
    """Train with TRL's SFTTrainer (examples/sft.py's tokenizer and data), the model loaded in ``dtype`` (with
    ``attn``, else its saved attention, and the keywords ``load`` of ``from_pretrained``)."""
    import tempfile

    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    sft = example("sft")

    trainer_env()
    AcceleratorState._reset_state()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = per_device * accum * steps * (world // (sp_size or 1))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **load, **({} if attn is None else
                                                                                {"attn_implementation": attn}))
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="hf_ring_sft_"), per_device_train_batch_size=per_device,
        per_device_eval_batch_size=2, gradient_accumulation_steps=accum, max_steps=steps, learning_rate=0.5,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0,
        use_cpu=True, train_sampling_strategy="sequential", disable_tqdm=True, save_strategy="no",
        padding_free=padding_free, max_length=None if padding_free else 128, bf16=False,
        **{CHECKPOINTING_ARGUMENT: True},  # TRL's default, by the name this release takes without a warning
    )
    recorder = GradRecorder()
    trainer = SFTTrainer(model=model, args=args, processing_class=sft.char_tokenizer(),
                         train_dataset=Dataset.from_list(sft.shift_pairs(rows, 0)),
                         eval_dataset=Dataset.from_list(sft.shift_pairs(3, 1)), callbacks=[recorder.callback])
    if layout is not None:
        hf_ring.configure(model, layout=layout)
    if sp_size is not None:
        hf_ring.prepare_trainer(trainer, sp_size)
    try:
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        metrics = trainer.evaluate()
        result = {"losses": losses, "grads": recorder.steps, "eval_loss": metrics["eval_loss"],
                  "num_tokens": metrics.get("eval_num_tokens"), "accuracy": metrics.get("eval_mean_token_accuracy")}
        return result if not dist.is_initialized() or dist.get_rank() == 0 else {"losses": losses}
    finally:
        hf_ring.clear_sequence_parallel()



def recall_pairs(count, seed, length):
    """Preference rows for the trainer tests: a key of three letters, ``length`` characters of filler, a question; the
    key chosen over three other letters. (examples/dpo.py's two-colour pairs differ in one token, so their loss
    rests on a difference of two nearly equal sums, where the float64 references' own disagreement, transformers'
    ``eager`` against its ``sdpa`` 1e-7 apart, grows past 1e-5 in some gradients.)"""
    import random
    import string

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        key, wrong = rng.sample([("".join(rng.choices(string.ascii_lowercase, k=3))) for _ in range(4)], 2)
        words = []
        while sum(len(w) + 1 for w in words) < length:
            words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))))
        rows.append({"prompt": f"key: {key} {' '.join(words)[:length]} key ->", "chosen": f" {key}",
                     "rejected": f" {wrong}"})
    return rows


def _unpaired(count, seed, length):
    """``count`` KTO rows from :func:`recall_pairs`: a pair's chosen answer labelled desirable, then its rejected one
    undesirable."""
    rows = []
    for pair in recall_pairs((count + 1) // 2, seed, length):
        rows += [{"prompt": pair["prompt"], "completion": pair["chosen"], "label": True},
                 {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False}]
    return rows[:count]


def _trainer_args(config_cls, per_device, accum, steps, **kw):
    import tempfile

    return config_cls(**dict(dict(
        output_dir=tempfile.mkdtemp(prefix="hf_ring_post_"), per_device_train_batch_size=per_device,
        per_device_eval_batch_size=2, gradient_accumulation_steps=accum, max_steps=steps, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, use_cpu=True,
        train_sampling_strategy="sequential", disable_tqdm=True, save_strategy="no", bf16=False,
        **{CHECKPOINTING_ARGUMENT: False}), **kw))


def _post_result(trainer, recorder, metrics):
    """Logged losses, every step's gradients, the final parameters and the trainer's own metrics (rank 0)."""
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    logged = {f"{k}@{i}": v for i, h in enumerate(history) if "loss" in h for k, v in h.items()
              if k.startswith(("rewards/", "logps/", "reward", "kl", "completions/mean_length", "num_tokens", "entropy"))}
    result = {"losses": losses, "grads": recorder.steps, "logged": logged, "metrics": metrics,
              "params": {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}}
    return result if not dist.is_initialized() or dist.get_rank() == 0 else {"losses": losses}


def _preference_run(trainer_cls, config_cls, model, sp_size, *, steps, per_device, accum, length, config,
                    ulysses_size=None, unpaired=False, **trainer_kw):
    """Train ``model`` with a TRL trainer on :func:`recall_pairs` (sequence parallel when ``sp_size`` is given;
    ``unpaired``: each pair's answers as two labelled rows, as KTO takes them), then evaluate; returns
    :func:`_post_result`."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset

    sft = example("sft")

    trainer_env()
    AcceleratorState._reset_state()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = per_device * accum * steps * (world // (sp_size or 1))
    data = _unpaired if unpaired else recall_pairs
    recorder = GradRecorder()
    trainer = trainer_cls(model=model, args=_trainer_args(config_cls, per_device, accum, steps, **config),
                          processing_class=sft.char_tokenizer(), callbacks=[recorder.callback],
                          train_dataset=Dataset.from_list(data(rows, 0, length)),
                          eval_dataset=Dataset.from_list(data(4, 1, length)), **trainer_kw)
    if sp_size is not None:
        hf_ring.prepare_trainer(trainer, sp_size, ulysses_size=ulysses_size)
    try:
        trainer.train()
        return _post_result(trainer, recorder, trainer.evaluate())
    finally:
        hf_ring.clear_sequence_parallel()


def dpo_case(path, sp_size=None, *, reference="model", steps=2, per_device=2, accum=1, length=40, lr=0.5, **load):
    """Train with TRL's DPOTrainer on long-prompt pairs, then evaluate.

    ``reference``: "model" (a reference model DPOTrainer loads) or "lora" (LoRA adapters; the reference is the model
    with them off); ``load``: keywords of ``from_pretrained``.
    """
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **load)  # rounding would hide an error
    peft_config = None
    if reference == "lora":
        from peft import LoraConfig

        torch.manual_seed(0)
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                                 lora_dropout=0.0)
    return _preference_run(DPOTrainer, DPOConfig, model, sp_size, steps=steps, per_device=per_device, accum=accum,
                           length=length, config=dict(learning_rate=lr, beta=0.5, max_length=None,
                                                      model_init_kwargs=load or None),  # (its reference model's)
                           peft_config=peft_config)


def reward_case(path, sp_size=None, *, steps=2, per_device=2, accum=1, length=40, lr=0.05, ulysses_size=None):
    """Train a reward model (a sequence classifier's score) with TRL's RewardTrainer on long-prompt pairs."""
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    torch.manual_seed(0)  # the score head is new: the same initial values in every process
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float64)
    return _preference_run(RewardTrainer, RewardConfig, model, sp_size, steps=steps, per_device=per_device,
                           accum=accum, length=length, ulysses_size=ulysses_size,
                           config=dict(learning_rate=lr, max_length=None, center_rewards_coefficient=0.01))


def kto_case(path, sp_size=None, *, steps=2, per_device=4, accum=1, length=40, lr=0.05, **load):
    """Train with TRL's KTOTrainer on unpaired rows (each pair's chosen answer desirable, its rejected one not), then
    evaluate (``load``: keywords of ``from_pretrained``)."""
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **load)
    return _preference_run(KTOTrainer, KTOConfig, model, sp_size, steps=steps, per_device=per_device, accum=accum,
                           length=length, unpaired=True,
                           config=dict(learning_rate=lr, beta=0.5, max_length=None, model_init_kwargs=load or None))


def vowel_reward(completions, **kwargs):
    """A GRPO reward: the share of a completion's characters that are vowels."""
    return [sum(c in "aeiou" for c in text) / max(1, len(text)) for text in completions]


def sampling_case(path, sp_size=None, *, trainer="GRPO", steps=2, per_device=4, accum=1, length=40, lr=0.05,
                  beta=0.1, **load):
    """Train with TRL's GRPOTrainer or RLOOTrainer (``trainer``; completions sampled with the model's generate,
    rewarded for vowels) on long prompts (``load``: keywords of ``from_pretrained``)."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    import trl

    config_cls, trainer_cls = getattr(trl, f"{trainer}Config"), getattr(trl, f"{trainer}Trainer")
    sft = example("sft")

    trainer_env()
    AcceleratorState._reset_state()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = per_device * accum * steps * (world // (sp_size or 1))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **load)
    args = _trainer_args(config_cls, per_device, accum, steps, learning_rate=lr, beta=beta, num_generations=2,
                         max_completion_length=6, model_init_kwargs=load or None)
    recorder = GradRecorder()
    prompts = [{"prompt": row["prompt"]} for row in recall_pairs(rows, 0, length)]
    run = trainer_cls(model=model, args=args, reward_funcs=vowel_reward, processing_class=sft.char_tokenizer(),
                      train_dataset=Dataset.from_list(prompts), callbacks=[recorder.callback])
    if sp_size is not None:
        hf_ring.prepare_trainer(run, sp_size)
    try:
        run.train()
        return _post_result(run, recorder, {})
    finally:
        hf_ring.clear_sequence_parallel()



def teacher_model(out_dir, vocab_size):
    """A teacher for the distillation tests: a Llama narrower than the student (hidden 64, not 128) over the same
    vocabulary, saved once under ``out_dir``."""
    import os

    from transformers import AutoModelForCausalLM, LlamaConfig

    path = os.path.join(out_dir, "teacher")
    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(1)
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
        AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    return path


def distillation_case(path, teacher, sp_size=None, *, steps=2, per_device=2, accum=1, length=4, lr=0.5, beta=0.5,
                      lora=False, ulysses_size=None, engine=None, dtype=torch.float64):
    """Distil ``teacher`` into the model at ``path`` with TRL's DistillationTrainer (on-policy: the student samples
    completions of up to 24 tokens, stopping at a "z", so they are right-padded and span ranks) on prompts of
    three lengths (left-padded), then evaluate.

    ``engine``: ``(DeepSpeed config, gradient recorder class, full-parameters function)`` to train under DeepSpeed
    (the caller sets up its state)."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    sft = example("sft")

    if engine is None:
        trainer_env()
        AcceleratorState._reset_state()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = per_device * accum * steps * (world // (sp_size or 1))
    tokenizer = sft.char_tokenizer()
    tokenizer.padding_side = "left"  # as TRL requires of its prompts
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("z")]
    peft_config = None
    if lora:
        from peft import LoraConfig

        torch.manual_seed(0)
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                                 lora_dropout=0.0)

    def prompts(count, seed):
        return Dataset.from_list([{"prompt": recall_pairs(1, seed + i, length + 6 * (i % 3))[0]["prompt"]}
                                  for i in range(count)])

    under = {} if engine is None else dict(use_cpu=False, deepspeed=engine[0],
                                           accelerator_config={"use_configured_state": True})
    args = _trainer_args(DistillationConfig, per_device, accum, steps, learning_rate=lr, beta=beta,
                         max_completion_length=24, **under)
    recorder = GradRecorder() if engine is None else engine[1](model)
    run = DistillationTrainer(
        model=model, teacher_model=AutoModelForCausalLM.from_pretrained(teacher, dtype=dtype), args=args,
        processing_class=tokenizer, train_dataset=prompts(rows, 0), eval_dataset=prompts(4, 100),
        peft_config=peft_config)
    run.add_callback(recorder.callback if engine is None else recorder.callback(run))
    if sp_size is not None:
        hf_ring.prepare_trainer(run, sp_size, ulysses_size=ulysses_size)
    try:
        run.train()
        params = None if engine is None else engine[2](run.model)  # a collective under ZeRO-3: every rank
        result = _post_result(run, recorder, run.evaluate())
        return result if params is None or "params" not in result else dict(result, params=params)
    finally:
        hf_ring.clear_sequence_parallel()
