"""Long-context fine-tuning with the sequence split across ranks.

    accelerate launch --num_processes 2 examples/finetune.py --sp-size 2
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/finetune.py --sp-size 2
    torchrun --nproc_per_node 2 examples/finetune.py --sp-size 2

Default model: a small Llama built from a config here (no download). Default
data: passkey retrieval. Each sequence is filler tokens with one passkey token
hidden at a random place, thousands of positions before a final query token;
the target after the query is the passkey, so the task is learned only if
attention reaches far back. ``--data FILE`` trains on a local text/JSONL file
instead, packed into sequences of ``--seq-len`` bytes.

Ranks of one sequence-parallel group share a batch (each holds a shard of the
sequence); groups are data-parallel replicas. The checkpoint is a safetensors
model whose config.json carries the attention pattern, written every
``--save-every`` steps and at the end with the step it was taken at;
``--resume`` continues from it.

``--dilated`` trains the dilated pattern instead (segments ``--seq-len``/4,
/2, /1 with rates 1, 2, 4, 240 steps): the first quarter of the steps runs
dense attention, then the pattern, its segments scaled to each curriculum
stage's length so the short stages already need the dilated branches.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

import hf_ring
from hf_ring.integration.seams import enable_checkpointing

# Token ids of the passkey task (and the byte-level vocabulary of --data).
N_FILLER = 256  # filler tokens; also the 256 byte values for --data
N_KEYS = 32  # passkey tokens; chance accuracy is 1/N_KEYS
KEY0 = N_FILLER
QUERY = KEY0 + N_KEYS
BOS = QUERY + 1
VOCAB = BOS + 1


# ----------------------------------------------------------------------------- data


def passkey_batch(gen: torch.Generator, batch: int, seq_len: int, min_distance: Optional[int] = None,
                  depth: Optional[float] = None) -> Dict[str, torch.Tensor]:
    """``batch`` passkey sequences of ``seq_len`` tokens; only the answer is labelled.

    The passkey sits at least ``min_distance`` (default seq_len // 2) positions
    before the query, so the answer depends on a token thousands of positions back;
    ``depth`` (a fraction of the sequence, 0 = right after the first token) puts it
    at that place in every sequence instead of at random.
    """
    if seq_len < 4:
        raise ValueError(f"--seq-len must be at least 4 for the passkey task, got {seq_len}")
    min_distance = seq_len // 2 if min_distance is None else min_distance
    ids = torch.randint(0, N_FILLER, (batch, seq_len), generator=gen)
    ids[:, 0] = BOS
    keys = torch.randint(0, N_KEYS, (batch,), generator=gen) + KEY0
    last = seq_len - 2  # ids[:, -2] = QUERY, ids[:, -1] = answer
    hi = max(1, last - min_distance)
    where = torch.randint(1, hi + 1, (batch,), generator=gen).clamp(max=last - 1)
    if depth is not None:
        where = torch.full((batch,), min(hi, max(1, round(depth * seq_len))))
    ids[torch.arange(batch), where] = keys
    ids[:, -2] = QUERY
    ids[:, -1] = keys
    labels = torch.full_like(ids, -100)
    labels[:, -1] = keys
    return {"input_ids": ids, "labels": labels}


def read_text(path: str) -> bytes:
    """The text of a .txt file, or the "text" fields of a .jsonl file, as UTF-8 bytes."""
    if not os.path.isfile(path):
        raise ValueError(f"--data {path!r} is not a file")
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".jsonl"):
        parts = []
        for i, line in enumerate(raw.decode("utf-8").splitlines()):
            if line.strip():
                record = json.loads(line)
                if not isinstance(record, dict) or "text" not in record:
                    raise ValueError(f"--data {path!r} line {i + 1}: each JSONL record needs a 'text' field")
                parts.append(str(record["text"]))
        raw = "\n".join(parts).encode("utf-8")
    return raw


def pack_bytes(data: bytes, seq_len: int) -> torch.Tensor:
    """Byte tokens packed into ``(num_sequences, seq_len)`` (a BOS token first); the tail is dropped."""
    body = seq_len - 1
    if len(data) < body:
        raise ValueError(
            f"the data has {len(data)} bytes, too little for one sequence of --seq-len {seq_len}; "
            "give more text or a shorter --seq-len"
        )
    n = len(data) // body
    tokens = torch.frombuffer(bytearray(data[: n * body]), dtype=torch.uint8).long().view(n, body)
    return torch.cat([torch.full((n, 1), BOS), tokens], dim=1)


# ----------------------------------------------------------------------------- model


def default_config(seq_len: int, heads: int = 4, head_dim: int = 32, layers: int = 2):
    from transformers import LlamaConfig

    hidden = heads * head_dim
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=max(seq_len, 4096),
        rope_parameters={"rope_type": "default", "rope_theta": 1e8},
        attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=None, pad_token_id=None,
    )


def load_model(path: Optional[str], seq_len: int, dtype: torch.dtype, heads: int = 4, head_dim: int = 32,
               layers: int = 2):
    from transformers import AutoConfig, AutoModelForCausalLM

    if path is None:
        return AutoModelForCausalLM.from_config(default_config(seq_len, heads, head_dim, layers),
                                                attn_implementation="ring_dilated", dtype=dtype)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--model {path!r} is not a model directory (no config.json)")
    model_type = AutoConfig.from_pretrained(path).model_type
    if model_type not in hf_ring.patches.supported():
        raise ValueError(f"--model {path!r} is a {model_type!r} checkpoint; supported: {', '.join(hf_ring.patches.supported())}")
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="ring_dilated", dtype=dtype)


# ----------------------------------------------------------------------------- training


def train_step(model, batch: Dict[str, torch.Tensor], sp: hf_ring.SequenceParallel) -> float:
    """Forward and backward of one batch on this rank's shard; returns the sequence loss."""
    out = model(**hf_ring.shard_batch(batch, sp))
    out.loss.backward()
    loss = out.loss.detach().clone()
    if sp.sp_size > 1:
        hf_ring.engine.comm.all_reduce(loss, sp.sp_group, "the loss sum over the sequence-parallel group")
    return float(loss)


@torch.no_grad()
def retrieval_accuracy(model, batches: List[Dict[str, torch.Tensor]], sp: hf_ring.SequenceParallel) -> float:
    """Share of sequences whose prediction after the query token is the passkey."""
    model.eval()
    device = next(model.parameters()).device  # also the counts': NCCL reduces GPU tensors only
    correct = total = 0
    for batch in batches:
        n = batch["input_ids"].shape[1]
        sharded = hf_ring.shard_batch({"input_ids": batch["input_ids"].to(device)}, sp)
        logits = model(**sharded).logits
        pos = hf_ring.local_positions(n, sp.sp_rank, sp.sp_size, sp.layout, sp.ulysses_size) if sp.sp_size > 1 else torch.arange(n)
        hit = torch.zeros(2, device=device)
        rows = (pos == n - 2).nonzero()
        if len(rows):  # this rank holds the query token
            pred = logits[:, int(rows[0])].argmax(-1)
            hit = torch.tensor([float((pred == batch["input_ids"][:, -1].to(device)).sum()), float(len(pred))],
                               device=device)
        if sp.sp_size > 1:
            hf_ring.engine.comm.all_reduce(hit, sp.sp_group, "the retrieval count over the sequence-parallel group")
        correct, total = correct + hit[0].item(), total + hit[1].item()
    model.train()
    return correct / max(total, 1)


DEPTHS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
"""Where the final evaluation puts the passkey: fractions of the sequence, from its start to its middle."""

DEPTHS_ANYWHERE = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
"""The same over the whole sequence, where the passkey may sit anywhere (``--min-distance`` below half)."""


def accuracy_by_depth(model, sp: hf_ring.SequenceParallel, seq_len: int, per_depth: int, seed: int,
                      depths: Sequence[float] = DEPTHS, min_distance: Optional[int] = None) -> Dict[str, float]:
    """Retrieval accuracy with the passkey at each of ``depths`` of the sequence (held-out sequences)."""
    out = {}
    for i, depth in enumerate(depths):
        gen = torch.Generator().manual_seed(20_000 + 100 * seed + i)
        batches = [passkey_batch(gen, per_depth, seq_len, min_distance, depth=depth)]
        out[f"{depth:.1f}"] = retrieval_accuracy(model, batches, sp)
    return out


def save_checkpoint(model, optimizer, step: int, history: List[dict], out_dir: str) -> None:
    """The model (safetensors) and the optimizer state, step reached and history (plain tensors and numbers)."""
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    torch.save({"optimizer": optimizer.state_dict(), "step": step, "history": history},
               os.path.join(out_dir, "trainer_state.pt"))


def plot(history: List[dict], by_depth: Dict[str, float], seq_len: int, path: str) -> None:
    """The accuracy curve over training and, beside it, the final accuracy by the passkey's depth."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no curve written")
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [h["step"] for h in history if "accuracy" in h]
    ax.plot(steps, [h["accuracy"] for h in history if "accuracy" in h], marker="o", label="retrieval accuracy")
    ax.axhline(1 / N_KEYS, color="gray", ls="--", label="chance")
    ax.set_xlabel("step")
    ax.set_ylabel(f"accuracy at {seq_len} tokens")
    ax.set_ylim(0, 1.05)
    ax.legend()
    if by_depth:
        depths = list(by_depth)
        bx.bar([f"{float(d):.0%}" for d in depths], [by_depth[d] for d in depths], color="tab:blue")
        bx.axhline(1 / N_KEYS, color="gray", ls="--", label="chance")
        bx.set_xlabel(f"where the passkey sits (share of the {seq_len} tokens from the start)")
        bx.set_ylabel("accuracy after training")
        bx.set_ylim(0, 1.05)
        bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def linear_base_segment(seq_len: int, heads: int) -> int:
    """The linear preset's first segment: 1024 tokens up to 16K, 2048 above, and at least ``seq_len / heads``.

    At 32K and a peak learning rate of 5e-3 no run with 1024 learned the task (nine, curricula from 32 to 512
    tokens, three layers, 360 steps), and two of four with 2048 did. The cost is linear in n while n is at most
    the base times the query heads: past that the rates stop at the heads and the last branches read more keys per
    query, so the base grows with n there (4096 at 64K on 16 heads, which retrieved there at 2e-3). Each length then
    sits at that bound, and the attention costs the same 0.12 of dense causal attention's FLOPs at 16K, 32K and 64K:
    a constant fraction of n², not a cost that stays linear from one length to the next.
    """
    return max(1024 if seq_len <= 16384 else 2048, -(-seq_len // heads))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sp-size", type=int, default=None, help="ranks per sequence (default: all)")
    ap.add_argument("--seq-len", type=int, default=4096,
                    help="tokens per sequence at full length (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=4,
                    help="sequences per step and data-parallel replica (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 120; 240 with --dilated)")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=None,
                    help="peak AdamW learning rate (default: 5e-3; 2e-3 with --dilated linear)")
    ap.add_argument("--eval-every", type=int, default=50,
                    help="measure retrieval accuracy every N steps and at the end (default: %(default)s)")
    ap.add_argument("--eval-batches", type=int, default=8,
                    help="held-out batches of the accuracy measurement (default: %(default)s)")
    ap.add_argument("--depth-prompts", type=int, default=8,
                    help="held-out sequences per passkey depth in the final evaluation, 0 = none "
                         "(default: %(default)s)")
    ap.add_argument("--model", default=None, help="local Llama/Mistral checkpoint (default: a small Llama)")
    ap.add_argument("--data", default=None, help="local .txt or .jsonl file (default: passkey retrieval)")
    ap.add_argument("--segment-lengths", type=int, nargs="*",
                    help="dilated attention: segment lengths (default: none, dense attention)")
    ap.add_argument("--dilation-rates", type=int, nargs="*",
                    help="dilated attention: dilation rates, one per segment length (default: none)")
    ap.add_argument("--dilated", nargs="?", const="scaled", default=None, choices=["scaled", "linear"],
                    help="a tested dilated recipe, 240 steps, the first --dense-frac of them dense. 'scaled' (the "
                         "flag alone): segments --seq-len/4, /2, /1 with rates 1 2 4, cost still quadratic in n. "
                         "'linear': segments --base-segment·2^i up to --seq-len with rates 2^i up to the query heads, "
                         "cost linear in n; with no --model a 16-head model (16 dims a head), the passkey anywhere "
                         "(default: off)")
    ap.add_argument("--base-segment", type=int, default=None,
                    help="--dilated linear: the first, dense segment (default: 1024 up to 16K tokens, 2048 above)")
    ap.add_argument("--heads", type=int, default=None,
                    help="query heads of the default model (default: 4; 16 with --dilated linear)")
    ap.add_argument("--head-dim", type=int, default=None,
                    help="dimensions a head of the default model (default: 32; 16 with --dilated linear)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the default model (default: 2)")
    ap.add_argument("--min-distance", type=int, default=None,
                    help="the passkey sits at least this many tokens before the query (default: half of the "
                         "sequence; 1, anywhere, with --dilated linear)")
    ap.add_argument("--dense-frac", type=float, default=0.25,
                    help="with a dilated pattern: share of the steps trained with dense attention before the "
                         "pattern takes over (default: %(default)s)")
    ap.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"],
                    help="how the sequence is split over the ranks (default: %(default)s)")
    ap.add_argument("--ulysses-size", type=int, default=1,
                    help="ranks per head-parallel group: 1 the ring, --sp-size head parallelism, between both "
                         "(default: %(default)s)")
    ap.add_argument("--mixed-precision", default="auto", choices=["auto", "no", "bf16"],
                    help="'auto': bf16 autocast on GPUs, fp32 on CPUs; 'no': fp32 everywhere (default: %(default)s)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="recompute each layer in the backward (default: off)")
    ap.add_argument("--output", default="checkpoints/passkey",
                    help="where the checkpoint, accuracy.png and summary.json go (default: %(default)s)")
    ap.add_argument("--save-every", type=int, default=100,
                    help="write the checkpoint every N steps (0 = only at the end) (default: %(default)s)")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint in --output (default: off)")
    ap.add_argument("--warmup-len", type=int, default=32,
                    help="passkey curriculum: start at this length and double up to --seq-len over the first "
                         "--warmup-frac of the steps, with the same tokens per step, 0 = always --seq-len "
                         "(default: %(default)s)")
    ap.add_argument("--warmup-frac", type=float, default=0.9,
                    help="share of the steps in the curriculum (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the weights, the data and the held-out sets (default: %(default)s)")
    args = ap.parse_args(argv)
    if bool(args.segment_lengths) != bool(args.dilation_rates):
        ap.error("--segment-lengths and --dilation-rates go together")
    if args.dilated:
        if args.segment_lengths:
            ap.error("--dilated sets the pattern itself; give it or --segment-lengths/--dilation-rates, not both")
        if args.seq_len < 16:
            ap.error("--dilated needs --seq-len of at least 16")
        if args.dilated == "scaled":
            args.segment_lengths = [args.seq_len // 4, args.seq_len // 2, args.seq_len]
            args.dilation_rates = [1, 2, 4]
    linear = args.dilated == "linear"
    if args.base_segment is not None and not linear:
        ap.error("--base-segment sets the first segment of --dilated linear; give both or neither")
    for name in ("heads", "head_dim", "layers"):
        if getattr(args, name) is not None and (args.model or args.resume):
            ap.error(f"--{name.replace('_', '-')} shapes the default model; a --model or --resume checkpoint "
                     "keeps its own shape")
    if args.heads is None:
        args.heads = 16 if linear else 4
    if args.head_dim is None:
        args.head_dim = 16 if linear else 32
    if args.layers is None:
        args.layers = 2
    if args.min_distance is None and linear:
        args.min_distance = 1
    for name in ("base_segment", "heads", "head_dim", "layers", "min_distance"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if linear and args.base_segment is None and not (args.model or args.resume):
        args.base_segment = linear_base_segment(args.seq_len, args.heads)  # a checkpoint's heads: once loaded
    if args.lr is None:
        args.lr = 2e-3 if linear else 5e-3
    if args.lr <= 0:
        ap.error("--lr must be positive")
    if args.steps is None:
        args.steps = 240 if args.dilated else 120
    if not 0.0 <= args.dense_frac < 1.0:
        ap.error("--dense-frac must be in [0, 1)")
    if args.seq_len < 1:
        ap.error("--seq-len must be positive")
    if args.save_every < 0:
        ap.error("--save-every must be 0 or positive")
    return args


class Schedule:
    """What step ``step`` trains on: its sequence length (the passkey curriculum), its attention pattern, its batch
    and its learning rate. The same on every rank of a sequence-parallel group."""

    def __init__(self, args: argparse.Namespace, sp: hf_ring.SequenceParallel, model,
                 pattern: Optional[hf_ring.DilatedPattern], text: Optional[torch.Tensor]):
        self.args, self.sp, self.model, self.pattern, self.text = args, sp, model, pattern, text

    def length_at(self, step: int) -> int:
        """Passkey curriculum: short sequences teach the retrieval cheaply, then full length.

        The first --warmup-frac of the steps doubles the length from --warmup-len,
        the shortest stage taking half of that time; the rest is all --seq-len.
        """
        args = self.args
        if self.text is not None or not args.warmup_len or args.warmup_len >= args.seq_len:
            return args.seq_len
        stages = max(1, math.ceil(math.log2(args.seq_len / args.warmup_len)))
        frac = step / max(1, int(args.steps * args.warmup_frac))
        if frac >= 1:
            return args.seq_len
        # stage 0 takes [0, 1/2), stage i > 0 an equal share of [1/2, 1)
        stage = 0 if frac < 0.5 else 1 + int((frac - 0.5) * 2 * (stages - 1))
        return min(args.seq_len, max(self.sp.sp_size, args.warmup_len << stage))

    def pattern_at(self, step: int) -> Optional[hf_ring.DilatedPattern]:
        """The pattern a training step runs: dense for the first --dense-frac of the steps (the model first learns
        to retrieve at all), then the pattern with its segments scaled to the curriculum's length, so that the short
        stages already need the long branches as the full length does (a 32-token stage would otherwise run dense;
        a linear pattern that instead kept its base segment and grew a branch per doubling learned far less)."""
        if self.pattern is None or step < self.args.dense_frac * self.args.steps:
            return None
        length = self.length_at(step)
        return hf_ring.DilatedPattern([max(r, w * length // self.args.seq_len) for w, r in self.pattern.branches],
                                      self.pattern.dilation_rates)

    def use(self, chosen: Optional[hf_ring.DilatedPattern]) -> None:
        """Run the model with pattern ``chosen`` from now on (None: dense)."""
        if self.pattern is not None:
            hf_ring.configure(self.model, pattern=chosen, layout=self.args.layout,
                              ulysses_size=self.args.ulysses_size)

    def batch_for(self, step: int, micro: int) -> Dict[str, torch.Tensor]:
        """Same batch on every rank of an sp group, different across dp replicas and steps."""
        args = self.args
        g = torch.Generator().manual_seed(hash((args.seed, step, micro, self.sp.dp_rank)) % 2**31)
        if self.text is None:
            length = self.length_at(step)
            # about the same number of tokens per step at every length
            return passkey_batch(g, max(1, args.batch_size * args.seq_len // length), length,
                                 None if args.min_distance is None else min(args.min_distance, length // 2))
        rows = torch.randint(0, self.text.shape[0], (args.batch_size,), generator=g)
        return {"input_ids": self.text[rows], "labels": self.text[rows]}

    def lr_at(self, step: int) -> float:
        args = self.args
        warm = max(1, args.steps // 20)
        return args.lr * min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))


def launch(args: argparse.Namespace):
    """The accelerator, its mixed precision and the sequence-parallel groups of this launch."""
    from accelerate import Accelerator

    cuda = torch.cuda.is_available()
    # cpu=True lets accelerate build a gloo group from torchrun's environment when there is no GPU.
    mixed = args.mixed_precision if args.mixed_precision != "auto" else ("bf16" if cuda else "no")
    if mixed == "bf16" and not cuda:
        raise SystemExit("--mixed-precision bf16 needs a GPU; on CPUs the example trains in fp32")
    accelerator = Accelerator(cpu=not cuda, mixed_precision=mixed)
    world = accelerator.num_processes
    sp_size = args.sp_size or world
    if world % sp_size:
        raise SystemExit(f"--sp-size {sp_size} does not divide the {world} processes")
    if args.seq_len < sp_size:
        raise SystemExit(f"--seq-len {args.seq_len} is shorter than --sp-size {sp_size}: every rank needs a token")
    sp = hf_ring.setup_sequence_parallel(accelerator, sp_size, layout=args.layout, ulysses_size=args.ulysses_size)
    return accelerator, mixed, sp


def build(args: argparse.Namespace, device):
    """The model (new, given, or resumed from --output) with its attention pattern, its optimizer, and the step
    and history a resumed run continues from."""
    resume_dir = args.output if args.resume else None
    if args.resume and not os.path.isfile(os.path.join(args.output, "trainer_state.pt")):
        raise SystemExit(f"--resume: no checkpoint in {args.output}")
    model = load_model(resume_dir or args.model, args.seq_len, torch.float32, args.heads,
                       args.head_dim, args.layers).to(device)
    pattern = None
    if args.segment_lengths:
        pattern = hf_ring.DilatedPattern(args.segment_lengths, args.dilation_rates)
    elif args.dilated == "linear":  # rates up to the query heads, so that every residue is some head's
        heads = model.config.num_attention_heads
        pattern = hf_ring.DilatedPattern.geometric(args.seq_len, args.base_segment
                                                   or linear_base_segment(args.seq_len, heads), heads)
    if pattern is not None or not resume_dir:
        hf_ring.configure(model, pattern=pattern, layout=args.layout, ulysses_size=args.ulysses_size)
    if args.gradient_checkpointing:
        enable_checkpointing(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start, history = 0, []
    if resume_dir:
        state = torch.load(os.path.join(resume_dir, "trainer_state.pt"), weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
    return model, pattern, optimizer, start, history


def train(args, accelerator, sp, schedule: Schedule, optimizer, start: int, history: List[dict],
          eval_batches: List[Dict[str, torch.Tensor]]) -> int:
    """The training loop from step ``start``, appending a record per step to ``history``; the step it reached."""
    model = schedule.model
    bar = None
    if accelerator.is_main_process:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, desc="train", file=sys.stdout, mininterval=10)
    t0, tokens, reached = time.perf_counter(), 0, start
    for step in range(start, args.steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        loss, began = 0.0, time.perf_counter()
        schedule.use(schedule.pattern_at(step))
        for micro in range(args.grad_accum):
            batch = {k: v.to(accelerator.device) for k, v in schedule.batch_for(step, micro).items()}
            loss += train_step(model, batch, sp) / args.grad_accum
            tokens += batch["input_ids"].numel() * sp.dp_size
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= args.grad_accum
        hf_ring.sync_gradients(model, sp)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record = {"step": step + 1, "loss": loss, "seq_len": batch["input_ids"].shape[1],
                  "step_s": round(time.perf_counter() - began, 4)}
        if eval_batches and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            schedule.use(schedule.pattern)  # evaluated, and saved, with the full pattern
            record["accuracy"] = retrieval_accuracy(model, eval_batches, sp)
        history.append(record)
        reached = step + 1
        if accelerator.is_main_process and args.save_every and reached % args.save_every == 0 and reached < args.steps:
            schedule.use(schedule.pattern)
            save_checkpoint(model, optimizer, reached, history, args.output)
        if bar is not None:
            shown = {"loss": f"{loss:.3f}", "tok/s": f"{tokens / (time.perf_counter() - t0):.0f}"}
            if "accuracy" in record:
                shown["acc"] = f"{record['accuracy']:.2f}"
                bar.write(f"step {step + 1}: retrieval accuracy {record['accuracy']:.3f} at {args.seq_len} tokens")
            bar.set_postfix(shown, refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    return reached


def report(args, accelerator, sp, schedule: Schedule, optimizer, start: int, reached: int, history: List[dict],
           wall: float, mixed: str, evaluated: bool) -> None:
    """Accuracy by passkey depth, each rank's memory peak, the final checkpoint, the plot and summary.json."""
    model, pattern, world = schedule.model, schedule.pattern, accelerator.num_processes
    schedule.use(pattern)
    by_depth = {}
    if evaluated and args.depth_prompts:
        anywhere = args.min_distance is not None and args.min_distance < args.seq_len // 2
        by_depth = accuracy_by_depth(model, sp, args.seq_len, args.depth_prompts, args.seed,
                                     DEPTHS_ANYWHERE if anywhere else DEPTHS, args.min_distance)
        if accelerator.is_main_process:
            print("accuracy by passkey depth: " + ", ".join(f"{float(d):.0%} {a:.2f}" for d, a in by_depth.items()))
    # ru_maxrss is in KiB on Linux: the process's resident peak over the whole run, evaluation included
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64,
                        device=accelerator.device)
    peaks = hf_ring.engine.comm.all_gather(peak, None, "the peak memory report").flatten().tolist() if world > 1 else [
        float(peak)]
    if not accelerator.is_main_process:
        return
    save_checkpoint(model, optimizer, reached, history, args.output)
    plot(history, by_depth, args.seq_len, os.path.join(args.output, "accuracy.png"))
    accs = [h["accuracy"] for h in history if "accuracy" in h]
    full = [h["step_s"] for h in history if h.get("seq_len") == args.seq_len and "step_s" in h]
    summary = {"wall_s": round(wall, 1), "steps": reached - start, "world": world, "sp_size": sp.sp_size,
               "seed": args.seed, "seq_len": args.seq_len,
               "pattern": None if pattern is None else pattern.to_dict(),
               "heads": model.config.num_attention_heads, "layers": model.config.num_hidden_layers,
               "mixed_precision": mixed, "min_distance": args.min_distance, "dilated": args.dilated,
               "lr": args.lr, "batch_size": args.batch_size, "warmup_len": args.warmup_len,
               "accuracy_before": accs[0] if accs else None, "accuracy_after": accs[-1] if accs else None,
               "accuracy_by_depth": by_depth, "chance": 1 / N_KEYS,
               "final_loss": history[-1].get("loss") if history else None,
               # the median training step at full length (after the curriculum), and each rank's resident peak
               "step_s_at_full_length": round(statistics.median(full), 3) if full else None,
               "peak_rss_mb_per_rank": [round(x, 1) for x in peaks]}
    with open(os.path.join(args.output, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary))


def main(argv=None) -> dict:
    """The recipe: launch, build the model, train on the schedule, report."""
    args = parse_args(argv)
    accelerator, mixed, sp = launch(args)
    torch.manual_seed(args.seed)
    model, pattern, optimizer, start, history = build(args, accelerator.device)
    text = pack_bytes(read_text(args.data), args.seq_len) if args.data else None
    eval_gen = torch.Generator().manual_seed(10_000 + args.seed)
    eval_batches = [] if text is not None else [
        passkey_batch(eval_gen, args.batch_size, args.seq_len, args.min_distance) for _ in range(args.eval_batches)]
    schedule = Schedule(args, sp, model, pattern, text)
    if not history and eval_batches:
        history.append({"step": 0, "accuracy": retrieval_accuracy(model, eval_batches, sp)})
    t0 = time.perf_counter()
    reached = train(args, accelerator, sp, schedule, optimizer, start, history, eval_batches)
    report(args, accelerator, sp, schedule, optimizer, start, reached, history, time.perf_counter() - t0, mixed,
           bool(eval_batches))
    accelerator.wait_for_everyone()
    hf_ring.clear_sequence_parallel()
    return {"history": history}


if __name__ == "__main__":
    main()  # hf_ring ends the process group at exit (hf_ring.shutdown), so the launch exits 0
