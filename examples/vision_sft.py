"""Fine-tune a vision-language model on long rows of many frames, the sequence split across ranks.

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/vision_sft.py --sp-size 2
    python examples/vision_sft.py                                   # one process, no split

Runs offline: the model is a small Llava (a CLIP tower and a Llama language
model) built from a config, the processor is Llava's own over a character
tokenizer and CLIP's image processor at their defaults but the size, and the
data are made here. Each row holds ``--frames`` small frames (16 tokens each
once the processor expands them: 64 frames make a row of about 1K tokens,
almost all visual); every frame is gray but one, somewhere in the row, which
is red, green, blue or yellow, and the row ends asking for its colour. The
answer is only in that one frame, often far back. The towers encode whole
frames on every rank; the language model's sequence is split after the frames
are merged into it. It prints the held-out token accuracy of the answers
(chance: one colour in four), and ``--losses`` writes every step's loss, which
a one-process run reproduces step by step.

Needs ``pip install -e ".[examples]"`` (datasets, TRL on Python 3.11 or newer, PEFT, Pillow).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import string
from typing import List, Optional

import numpy as np
import torch

import hf_ring
from hf_ring.integration.seams import CHECKPOINTING_ARGUMENT

PAD, EOS, UNK, IMAGE = "<pad>", "</s>", "<unk>", "<image>"
ALPHABET = string.ascii_lowercase + " ?"
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}
GRAY = (128, 128, 128)
SIZE, PATCH = 16, 4
"""Frames of 16 x 16 pixels in patches of 4: 16 tokens each."""


def processor():
    """Llava's processor over a character tokenizer with ``<image>`` (no download)."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, IMAGE, *ALPHABET])}
    core = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK))  # BPE without merges: one token per character
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE]})
    images = CLIPImageProcessorPil(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH, image_token=IMAGE,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def frame(colour, rng: random.Random):
    from PIL import Image

    noise = np.array([[rng.randint(-12, 12) for _ in range(3)] for _ in range(SIZE * SIZE)]).reshape(SIZE, SIZE, 3)
    return Image.fromarray(np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8))


def rows(count: int, frames: int, seed: int) -> List[dict]:
    """Rows of ``frames`` frames, one coloured, and the question for its colour."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        name = rng.choice(sorted(COLOURS))
        odd = rng.randrange(frames)
        images = [frame(COLOURS[name] if i == odd else GRAY, rng) for i in range(frames)]
        out.append({"images": images, "prompt": IMAGE * frames + " colour?", "completion": " " + name})
    return out


def build_model(out_dir: str, tokenizer, seed: int) -> str:
    """A small Llava built from a config once, saved with safetensors; its directory."""
    from transformers import AutoModelForImageTextToText, LlavaConfig

    path = os.path.join(out_dir, "base")
    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(seed)
        text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                    tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
        vision = dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, image_size=SIZE, patch_size=PATCH, projection_dim=64)
        config = LlavaConfig(text_config=text, vision_config=vision, vision_feature_layer=-1,
                             image_token_id=tokenizer.convert_tokens_to_ids(IMAGE))
        AutoModelForImageTextToText.from_config(config).save_pretrained(path, safe_serialization=True)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sp-size", type=int, default=None, help="ranks per sequence (default: all)")
    ap.add_argument("--frames", type=int, default=64, help="frames per row, 16 tokens each (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=120, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=8,
                    help="rows per step and data-parallel replica (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: %(default)s)")
    ap.add_argument("--eval-rows", type=int, default=32, help="held-out rows (default: %(default)s)")
    ap.add_argument("--output", default="checkpoints/vision_sft",
                    help="where the model and summary.json go (default: %(default)s)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute each layer in the backward (default: off)")
    ap.add_argument("--losses", default=None, help="write every step's training loss to this JSON file (default: none)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model, the data and training (default: %(default)s)")
    return ap.parse_args(argv)


def build_trainer(args: argparse.Namespace, proc, model_path: str):
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig, SFTTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    replicas = max(1, world // (args.sp_size or world))
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    config = SFTConfig(
        output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.lr, lr_scheduler_type="cosine",
        warmup_steps=max(1, args.steps // 10), logging_steps=1, report_to=[], seed=args.seed,
        use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(), disable_tqdm=True,
        save_strategy="no", max_length=None, train_sampling_strategy="sequential",
        # activation_checkpointing from transformers 5.23, gradient_checkpointing before (TRL turns it on)
        **{CHECKPOINTING_ARGUMENT: args.gradient_checkpointing})
    train = rows(args.steps * args.batch_size * replicas, args.frames, args.seed)
    held_out = rows(args.eval_rows, args.frames, args.seed + 1)
    return SFTTrainer(model=model, args=config, processing_class=proc, train_dataset=Dataset.from_list(train),
                      eval_dataset=Dataset.from_list(held_out))


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse_args(argv)
    from accelerate import PartialState
    from transformers import set_seed

    set_seed(args.seed)
    proc = processor()
    os.makedirs(args.output, exist_ok=True)
    state = PartialState(cpu=not torch.cuda.is_available())
    with state.main_process_first():  # rank 0 builds and saves the model, the others load it
        model_path = build_model(args.output, proc.tokenizer, args.seed)
    trainer = build_trainer(args, proc, model_path)
    hf_ring.prepare_trainer(trainer, sp_size=args.sp_size)  # the one line sequence parallelism needs
    result = trainer.train()
    metrics = trainer.evaluate()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    summary = {"train_loss": result.training_loss, "eval_loss": metrics["eval_loss"],
               "held_out_token_accuracy": metrics["eval_mean_token_accuracy"], "steps": trainer.state.global_step,
               "frames": args.frames, "world": trainer.args.world_size,
               "sp_size": args.sp_size or trainer.args.world_size}
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if args.losses:
            with open(args.losses, "w") as f:
                json.dump(losses, f)
        print(json.dumps(summary))
        print(f"held-out token accuracy: {summary['held_out_token_accuracy']:.3f} of the answers' tokens (chance "
              "for the colour: 1/4)")
    hf_ring.clear_sequence_parallel()
    return dict(summary, losses=losses)


if __name__ == "__main__":
    main()
