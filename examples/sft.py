"""Supervised fine-tuning with TRL's SFTTrainer, the sequence split across ranks.

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/sft.py --sp-size 2
    torchrun --nproc_per_node 4 examples/sft.py --sp-size 2          # 2 data-parallel replicas x 2 ranks per sequence
    python examples/sft.py                                          # one process, no split

Runs offline: the default model is a small Llama built from a config (saved to
``--output``/base and loaded back), the tokenizer is character level, and the
data, prompt -> completion pairs that shift every letter of some words to the
next one (``next: abc yz -> bcd za``), are made here. It ends by printing the
model's token accuracy on the completions of held-out words (chance is 1 in 29):
above 0.9 in the default 300 steps (under a minute on 2 CPU processes). An existing
SFTTrainer script needs one more line, ``hf_ring.prepare_trainer(trainer, sp_size)``,
after the trainer is built (``--no-trl`` runs the same with transformers' Trainer).

Needs ``pip install -e ".[examples]"`` (datasets, TRL on Python 3.11 or newer, PEFT, Pillow).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import string
from typing import List, Optional, Tuple

import torch

import hf_ring
from hf_ring.integration.seams import CHECKPOINTING_ARGUMENT

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
ALPHABET = string.ascii_lowercase + " :>-"


def char_tokenizer():
    """A character-level tokenizer (no download): one token per character of ALPHABET."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *ALPHABET])}
    # BPE without merges splits text into single characters.
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def _next_letter(text: str) -> str:
    return "".join(chr((ord(c) - ord("a") + 1) % 26 + ord("a")) if c.isalpha() else c for c in text)


def shift_pairs(count: int, seed: int) -> List[dict]:
    """Prompt/completion pairs: ``"next: abc yz ->"`` followed by ``" bcd za"`` (every letter moved on by one)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(rng.randint(1, 2))]
        text = " ".join(words)
        rows.append({"prompt": f"next: {text} ->", "completion": " " + _next_letter(text)})
    return rows


def replicas(args: argparse.Namespace) -> int:
    """Data-parallel replicas of this launch: its processes over --sp-size (all of them when it is not given)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return max(1, world // (args.sp_size or world))


def data(args: argparse.Namespace) -> Tuple[List[dict], List[dict]]:
    """Training rows (one epoch of the steps over every data-parallel replica unless --train-rows says otherwise) and
    evaluation rows whose words are none of the training rows' (held out)."""
    train = shift_pairs(args.train_rows or args.steps * args.batch_size * args.grad_accum * replicas(args), args.seed)
    seen = {word for row in train for word in row["prompt"].split()}
    fresh = [row for row in shift_pairs(4 * args.eval_rows, args.seed + 1)
             if not seen & set(row["prompt"].split()[1:-1])]
    return train, fresh[:args.eval_rows]


def held_out_accuracy(trainer, metrics: dict, rows: List[dict], tokenizer) -> float:
    """The share of completion tokens of ``rows`` (the evaluation set: words not trained on) the model predicts
    right, teacher-forced: TRL's own evaluation metric, or the plain Trainer's predictions."""
    if "eval_mean_token_accuracy" in metrics:
        return float(metrics["eval_mean_token_accuracy"])
    from datasets import Dataset

    pred = trainer.predict(Dataset.from_list(tokenized(rows, tokenizer)))
    logits, labels = torch.as_tensor(pred.predictions), torch.as_tensor(pred.label_ids)
    guess, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    scored = target != -100
    return float(((guess == target) & scored).sum() / scored.sum())


def default_model(out_dir: str, vocab_size: int, seed: int) -> str:
    """Build a small Llama from a config once, save it with safetensors and return its directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = os.path.join(out_dir, "base")
    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                             tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
        AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    return path


def model_dir(args: argparse.Namespace, tokenizer) -> str:
    """``--model``, or the default model: rank 0 builds and saves it under ``--output``, the others load it."""
    if args.model is not None:
        return args.model
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    with state.main_process_first():
        return default_model(args.output, len(tokenizer), args.seed)


def lora_config(args: argparse.Namespace):
    """LoRA adapters on the attention projections with ``--lora`` (needs peft), else None."""
    if not args.lora:
        return None
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sp-size", type=int, default=None, help="ranks per sequence (default: all)")
    ap.add_argument("--model", default=None, help="local causal LM directory (default: a small Llama built here)")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=32,
                    help="sequences per step and data-parallel replica (default: %(default)s)")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    ap.add_argument("--train-rows", type=int, default=None,
                    help="training examples made (default: one epoch of the steps)")
    ap.add_argument("--eval-rows", type=int, default=64, help="evaluation examples made (default: %(default)s)")
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters (needs peft) (default: off)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute each layer in the backward (default: off)")
    ap.add_argument("--no-trl", action="store_true",
                    help="transformers.Trainer on pre-tokenized rows instead of TRL's SFTTrainer (default: off)")
    ap.add_argument("--output", default="checkpoints/sft",
                    help="where checkpoints, the model and summary.json go (default: %(default)s)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the last checkpoint in --output (default: off)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the model, the data and training (default: %(default)s)")
    return ap.parse_args(argv)


def tokenized(rows: List[dict], tokenizer) -> List[dict]:
    """Rows for transformers' Trainer: ids of prompt + completion + EOS, labels only on the completion."""
    out = []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        answer = tokenizer(row["completion"])["input_ids"] + [tokenizer.eos_token_id]
        out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return out


def build_trainer(args: argparse.Namespace, tokenizer, model_path: str):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    common = dict(
        output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 20),
        logging_steps=5, eval_strategy="steps", eval_steps=max(1, args.steps // 3), save_steps=max(1, args.steps // 3),
        report_to=[], seed=args.seed, use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(),
        disable_tqdm=True,
        # activation_checkpointing from transformers 5.23, gradient_checkpointing before
        **{CHECKPOINTING_ARGUMENT: args.gradient_checkpointing},
    )
    peft_config = lora_config(args)
    train, evals = data(args)
    if args.no_trl:
        from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        return Trainer(model=model, args=TrainingArguments(**common), processing_class=tokenizer,
                       train_dataset=Dataset.from_list(tokenized(train, tokenizer)),
                       eval_dataset=Dataset.from_list(tokenized(evals, tokenizer)),
                       data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True))
    from trl import SFTConfig, SFTTrainer

    # Padded rows keep this example small and exact against one process. Packed rows work under sequence
    # parallelism too (padding_free=True: each document attends only to itself, on every rank).
    config = SFTConfig(**common, max_length=256, packing=False, padding_free=False)
    return SFTTrainer(model=model, args=config, processing_class=tokenizer, peft_config=peft_config,
                      train_dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(evals))


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    from transformers import set_seed

    set_seed(args.seed)
    tokenizer = char_tokenizer()
    os.makedirs(args.output, exist_ok=True)
    trainer = build_trainer(args, tokenizer, model_dir(args, tokenizer))
    hf_ring.prepare_trainer(trainer, sp_size=args.sp_size)  # the one line sequence parallelism needs
    resume = args.resume and any(d.startswith("checkpoint-") for d in os.listdir(args.output))
    result = trainer.train(resume_from_checkpoint=True if resume else None)
    metrics = trainer.evaluate()
    accuracy = held_out_accuracy(trainer, metrics, data(args)[1], tokenizer)
    trainer.save_model(args.output)
    summary = {"train_loss": result.training_loss, "eval_loss": metrics["eval_loss"],
               "held_out_token_accuracy": accuracy, "steps": trainer.state.global_step,
               "world": trainer.args.world_size, "sp_size": args.sp_size or trainer.args.world_size}
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps(summary))
        print(f"held-out token accuracy: {accuracy:.3f} of the completions of words not trained on (chance 1/29)")
    hf_ring.clear_sequence_parallel()
    return summary


if __name__ == "__main__":
    main()
