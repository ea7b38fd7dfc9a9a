"""Preference training with TRL's DPOTrainer on long prompts, the sequence split across ranks.

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/dpo.py --sp-size 2
    torchrun --nproc_per_node 4 examples/dpo.py --sp-size 2          # 2 data-parallel replicas x 2 ranks per sequence
    python examples/dpo.py                                          # one process, no split

Runs offline, like examples/sft.py (its character tokenizer and small Llama,
built here). Each prompt opens with a colour, runs on for ``--length``
characters of random filler, and asks for the colour back (``colour: red
<filler> colour ->``); the chosen answer is that colour, the rejected one the
other (red or blue). The answer can only be found at the start of the prompt,
so the preference is a long-context one. The model evaluates held-out prompts (keys
and filler it never trained on) before and after training, and prints DPO's
reward margin (chosen minus rejected, in units of beta) and the share of pairs
it ranks right (chance 0.5): both rise. An existing DPOTrainer script needs one
more line, ``hf_ring.prepare_trainer(trainer, sp_size)``, after the trainer is
built; the DPO loss, its reference model's and every metric are the ones one
process computes.

Needs ``pip install -e ".[examples]"`` (datasets, TRL on Python 3.11 or newer, PEFT).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys
from typing import List, Optional

import torch

import hf_ring

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sft import char_tokenizer, lora_config, model_dir, replicas  # noqa: E402  (the same tokenizer, model and adapters)

from hf_ring.integration.seams import CHECKPOINTING_ARGUMENT  # noqa: E402


def _letters(rng: random.Random, k: int) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=k))


KEYS = ("red", "blue")


def key_pairs(count: int, seed: int, length: int) -> List[dict]:
    """Preference rows: a colour, ``length`` characters of filler words, a question; the colour named at the start
    chosen over the other one."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        key = rng.choice(KEYS)
        words = []
        while sum(len(w) + 1 for w in words) < length:
            words.append(_letters(rng, rng.randint(2, 7)))
        rows.append({"prompt": f"colour: {key} {' '.join(words)[:length]} colour ->", "chosen": f" {key}",
                     "rejected": f" {KEYS[1 - KEYS.index(key)]}"})
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sp-size", type=int, default=None, help="ranks per sequence (default: all)")
    ap.add_argument("--model", default=None, help="local causal LM directory (default: a small Llama built here)")
    ap.add_argument("--length", type=int, default=512, help="characters of filler in each prompt (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=8,
                    help="preference pairs per step and data-parallel replica (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=5e-3, help="learning rate (default: %(default)s)")
    ap.add_argument("--beta", type=float, default=0.1, help="DPO's beta (default: %(default)s)")
    ap.add_argument("--eval-rows", type=int, default=32, help="held-out pairs evaluated (default: %(default)s)")
    ap.add_argument("--lora", action="store_true",
                    help="train LoRA adapters; the reference is the model with them off (default: off)")
    ap.add_argument("--output", default="checkpoints/dpo",
                    help="where the model and summary.json go (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model, the data and training (default: %(default)s)")
    return ap.parse_args(argv)


def build_trainer(args: argparse.Namespace, tokenizer, model_path: str):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = DPOConfig(
        output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.lr, lr_scheduler_type="constant",
        beta=args.beta, max_length=None, logging_steps=5, save_strategy="no", report_to=[], seed=args.seed,
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(), disable_tqdm=True,
        **{CHECKPOINTING_ARGUMENT: False},  # activation_checkpointing from transformers 5.23, gradient_checkpointing before
    )
    train = key_pairs(args.steps * args.batch_size * replicas(args), args.seed, args.length)
    evals = key_pairs(args.eval_rows, args.seed + 1, args.length)
    return DPOTrainer(model=model, args=config, processing_class=tokenizer, peft_config=lora_config(args),
                      train_dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(evals))


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    from transformers import set_seed

    set_seed(args.seed)
    tokenizer = char_tokenizer()
    os.makedirs(args.output, exist_ok=True)
    trainer = build_trainer(args, tokenizer, model_dir(args, tokenizer))
    hf_ring.prepare_trainer(trainer, sp_size=args.sp_size)  # the one line sequence parallelism needs
    before = trainer.evaluate()
    result = trainer.train()
    after = trainer.evaluate()
    trainer.save_model(args.output)
    summary = {"train_loss": result.training_loss, "steps": trainer.state.global_step,
               "margin_before": before["eval_rewards/margins"], "margin_after": after["eval_rewards/margins"],
               "accuracy_before": before["eval_rewards/accuracies"], "accuracy_after": after["eval_rewards/accuracies"],
               "eval_loss_before": before["eval_loss"], "eval_loss_after": after["eval_loss"],
               "world": trainer.args.world_size, "sp_size": args.sp_size or trainer.args.world_size}
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps(summary))
        print(f"held-out pairs: reward margin {summary['margin_before']:.3f} -> {summary['margin_after']:.3f}, "
              f"chosen ranked first {summary['accuracy_before']:.2f} -> {summary['accuracy_after']:.2f} (chance 0.5)")
    hf_ring.clear_sequence_parallel()
    return summary


if __name__ == "__main__":
    main()
