"""``python -m bench model --peers``: a whole training step on 2 ranks against DeepSpeed's Ulysses (ALST).

The peer Hugging Face users get by default for sequence parallelism is
DeepSpeed's Ulysses (Arctic Long Sequence Training,
``deepspeed.runtime.sequence_parallel.ulysses_sp``, behind accelerate's
``sp_backend="deepspeed"``). It runs here as its authors document it:
``UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, ...)``
wraps the model's ``sdpa`` attention, the DeepSpeed engine (ZeRO stage 0,
given the returned ``mpu``) steps the optimizer, each rank holds a
contiguous ``1/sp`` of the sequence with its ``position_ids`` and
``shift_labels``, and the ranks' losses are averaged weighted by their label
tokens. hf_ring runs the same model through :func:`hf_ring.shard_batch`, in
the ring (``ulysses_size=1``) and in head parallelism (``ulysses_size=sp``),
with :func:`hf_ring.sync_gradients` and the same optimizer.

The race: one sequence, a small Llama (4 layers, hidden 256, 8 heads, 4
K/V heads, vocabulary 1024, fp32), torch SGD, no tiling, one thread per
rank, each side in its own fresh processes. Reported per side: the median
step (forward, backward, optimizer step), the extra resident memory of the
step over what the process held before it, and the first step's loss
against one process running transformers' ``sdpa`` on the whole batch, for
these batches: dense; left-padded (an eighth of the row is padding),
right-padded (an eighth) and half-padded (the left half); packed documents
(``position_ids`` restarting at four document starts); and a sliding-window
model (Mistral, window ``n/4``).
"""
from __future__ import annotations

import os
import statistics
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .common import format_table, peak_rss_mb, ratio_range, rss_mb, run_ranks
from .rowfile import RECORDED

RACE_MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1 << 20,
                  attention_dropout=0.0, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
                  pad_token_id=0)
BATCHES = ("dense", "padded", "right_padded", "half_padded", "packed", "window")
PADDING = {"padded": ("left", 8), "right_padded": ("right", 8), "half_padded": ("left", 2)}
"""Padded batches: which end of the row is padding, and one over what share of it."""
SIDES = ("alst", "ring", "head")
LR = 1e-3

_RACE_SIDES = (("alst", "ALST"), ("ring", "ring"), ("head", "head-parallel"))

TABLES = {
    "race": (("n", "n"), ("batch", "batch"), ("rounds", "rounds"), ("repeats", "steps per round"))
    + tuple((f"{s}_step_s", f"{name} step s") for s, name in _RACE_SIDES)
    + tuple((f"{s}_over_alst", f"{name} / ALST") for s, name in _RACE_SIDES[1:])
    + tuple((f"{s}_over_alst_range", f"{name} / ALST, lowest–highest round") for s, name in _RACE_SIDES[1:])
    + (("alst_extra_mb", "ALST extra MB"),)
    + tuple((f"{s}_mb_over_alst", f"{name} extra MB / ALST") for s, name in _RACE_SIDES[1:])
    + tuple((f"{s}_loss_rel_err", f"{name} loss error") for s, name in _RACE_SIDES),
    "race_profile": (("n", "n"), ("side", "side"), ("steps", "steps profiled"), ("attention kernels", "attention kernels"), ("matmuls", "matmuls"),
                     ("element-wise", "element-wise"), ("copies and fills", "copies and fills"),
                     ("communication and waits", "communication and waits"), ("rest", "rest"),
                     ("total", "total ms per layer")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def make_model(kind: str, attn: str):
    """The race's model with seeded weights (Mistral with a window of ``n/4`` for the sliding-window batch)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    torch.manual_seed(0)
    if kind.startswith("window"):
        config = MistralConfig(**RACE_MODEL, sliding_window=int(kind.split(":")[1]))
    else:
        config = LlamaConfig(**RACE_MODEL)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).train()


def make_batch(batch: str, n: int) -> Dict[str, torch.Tensor]:
    """One sequence of ``n`` tokens in the form ``batch`` names (the same on every rank and side)."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(1, RACE_MODEL["vocab_size"], (1, n), generator=g)
    out = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(n)[None]}
    if batch in PADDING:
        side, share = PADDING[batch]
        pad = slice(0, n // share) if side == "left" else slice(n - n // share, n)
        out["input_ids"][:, pad] = 0
        out["labels"][:, pad] = -100
        out["attention_mask"] = torch.ones(1, n, dtype=torch.long)
        out["attention_mask"][:, pad] = 0
    elif batch == "packed":
        starts = [0, n // 5, n // 2, (4 * n) // 5]
        pos = torch.cat([torch.arange(b - a) for a, b in zip(starts, starts[1:] + [n])])
        out["position_ids"] = pos[None]
        out["labels"][:, starts] = -100  # no document predicts the next one's first token (as collators pack rows)
    return out


def model_kind(batch: str, n: int) -> str:
    return f"window:{n // 4}" if batch == "window" else "llama"


def reference_loss(batch: str, n: int) -> float:
    """One process, transformers' ``sdpa`` on the whole batch (packed documents kept apart by their position ids)."""
    model = make_model(model_kind(batch, n), "sdpa")
    inputs = make_batch(batch, n)
    if batch == "packed":
        inputs = dict(inputs, attention_mask=_packed_mask(inputs["position_ids"]))
    with torch.no_grad():
        return float(model(**inputs).loss)


def _packed_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """A 4-D boolean mask keeping each packed document causal and to itself (the reference's, not a peer's)."""
    doc = torch.cumsum((position_ids[0] == 0).long(), 0)
    n = doc.numel()
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    return allowed[None, None]


def _alst(batch: str, n: int) -> Callable[[], float]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # what a launcher would set; the ranks share one machine
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed("gloo")
    rank, sp = dist.get_rank(), dist.get_world_size()
    model = make_model(model_kind(batch, n), "sdpa")
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, seq_length=n,
                                                          seq_length_is_variable=False)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 0}, "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=config, mpu=mpu)
    whole = make_batch(batch, n)
    shift = torch.nn.functional.pad(whole.pop("labels"), (0, 1), value=-100)[:, 1:]
    chunk = n // sp
    mine = {k: v[:, chunk * rank:chunk * (rank + 1)] for k, v in dict(whole, shift_labels=shift).items()}
    mine.pop("attention_mask", None)  # ALST discards masks and masks causally by position

    def step() -> float:
        labels = mine["shift_labels"]
        logits = engine(input_ids=mine["input_ids"], position_ids=mine["position_ids"]).logits
        local = model.loss_function(logits=logits, labels=None, shift_labels=labels,
                                    vocab_size=model.config.vocab_size)
        tokens = (labels != -100).sum()
        with warnings.catch_warnings():  # ALST's loss as its authors write it, with torch's now-deprecated gather
            warnings.simplefilter("ignore", FutureWarning)
            losses = torch.distributed.nn.functional.all_gather(local * tokens)
            counts = torch.distributed.nn.functional.all_gather(tokens)
        loss = sum(losses) / sum(counts)
        engine.backward(loss)
        engine.step()
        return float(loss)

    return step


def _hf_ring(batch: str, n: int, ulysses: int) -> Callable[[], float]:
    import hf_ring

    sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses)
    model = make_model(model_kind(batch, n), "ring_dilated")
    hf_ring.configure_tiling(model, loss=False, mlp=False, norm=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    whole = make_batch(batch, n)
    if batch != "packed":
        whole.pop("position_ids")  # positions follow from the sharding; packed rows need theirs
    mine = hf_ring.shard_batch(whole)

    def step() -> float:
        out = model(**mine)
        out.loss.backward()
        hf_ring.sync_gradients(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)  # each rank's loss is its share of the sequence's
        return float(loss)

    return step


def _timed(step, repeats: int) -> Dict:
    base = rss_mb()
    first = step()  # warm-up; its loss is the first step's
    times: List[float] = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"first_loss": first, "step_s": statistics.median(times), "times": times,
            "extra_mb": peak_rss_mb() - base}


def _step(name: str, batch: str, n: int) -> Callable[[], float]:
    """One side's training step in this rank's process (``alst``, ``ring`` or ``head``), set up and ready."""
    if name == "alst":
        return _alst(batch, n)
    return _hf_ring(batch, n, ulysses=1 if name == "ring" else dist.get_world_size())


def side(name: str, batch: str, n: int, repeats: int) -> Dict:
    """One side of the race in this rank's process: its first loss, step times and extra memory."""
    return _timed(_step(name, batch, n), repeats)


PROFILE_PARTS = ("attention kernels", "matmuls", "element-wise", "copies and fills", "communication and waits",
                 "rest")
"""The parts of a step's time in :func:`breakdown`, in the order the table shows them."""


WRITES = {
    "race": {"rows": ("n", "batch", "ranks", "repeats", "rounds")
             + tuple(f"{side}_{field}" for side in SIDES for field in ("loss_rel_err", "step_s", "extra_mb"))
             + tuple(f"{side}_{field}" for side in SIDES[1:] for field in ("over_alst", "over_alst_range",
                                                                           "mb_over_alst"))
             + RECORDED},
    "race_profile": {"rows": ("n", "side", "steps") + PROFILE_PARTS + ("total",) + RECORDED},
}
"""Every field a row of the race's files can hold (``bench tables --check`` holds the files to them)."""
BESIDE = {"race": ("model",), "race_profile": ("model",)}
"""What each file holds beside its rows: the raced model."""
OPTIONS = {"race": ("sides",), "race_profile": ()}
"""The options a row depends on; with :data:`OWN` they make its settings (rounds and repeats are how well a ratio
is measured, not what it measures: a row records its own)."""
OWN = {"race": ("n", "batch", "ranks"), "race_profile": ("n", "side")}
"""What tells a file's rows of one run apart."""


def profile_part(op: str) -> str:
    """Which part of the step a profiled operator's own time belongs to.

    An autograd function's own time (``RingAttentionFunction``, the
    head-parallel exchange) is mostly waiting on its transfers, and DeepSpeed's
    all-to-all blocks until its peer has sent: both count as communication.
    """
    if "scaled_dot_product" in op:
        return "attention kernels"
    if op in ("aten::mm", "aten::addmm", "aten::bmm"):
        return "matmuls"
    if op.startswith(("c10d::", "deepspeed::")) or any(w in op for w in ("all_to_all", "AllGather", "AlltoAll",
                                                                        "RingAttention", "HeadParallel")):
        return "communication and waits"
    if op in ("aten::copy_", "aten::fill_", "aten::zero_", "aten::cat", "aten::clone", "aten::contiguous",
              "aten::index_select", "aten::index"):
        return "copies and fills"
    if op.startswith("aten::") and not op.startswith(("aten::empty", "aten::view", "aten::as_strided",
                                                      "aten::transpose", "aten::t", "aten::slice", "aten::expand",
                                                      "aten::reshape", "aten::permute", "aten::select",
                                                      "aten::unsqueeze", "aten::squeeze", "aten::detach",
                                                      "aten::alias", "aten::_unsafe_view", "aten::resize_")):
        return "element-wise"
    return "rest"


def profile_side(name: str, batch: str, n: int, steps: int = 1) -> Dict:
    """This rank's own time per part of a step (the mean of ``steps`` profiled steps, after two warm-up steps), in
    ms per layer. One step's waits move with which rank happens to finish first; the mean over steps does not."""
    step = _step(name, batch, n)
    step()
    step()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    dist.barrier()
    parts = dict.fromkeys(PROFILE_PARTS, 0.0)
    for event in prof.key_averages():
        parts[profile_part(event.key)] += event.self_cpu_time_total / 1e3 / RACE_MODEL["num_hidden_layers"] / steps
    return parts


def breakdown(sizes: List[int], sides: List[str], ranks: int = 2, steps: int = 1,
              keep: Optional[Callable[[Dict], None]] = None) -> List[Dict]:
    """Where a dense step's time goes, per side and layer: the mean over ranks of each part's own time. Each row
    goes to ``keep`` as soon as it is measured.

    Times are the profiler's, which adds a little to every operator; the
    parts, not their sum, are what to compare with the timed race.
    """
    rows = []
    for n in sizes:
        for name in sides:
            got = run_ranks(ranks, profile_side, name, "dense", n, steps, exact_peak=False)
            row: Dict = {"n": n, "side": name, "steps": steps}
            row.update({part: round(sum(g[part] for g in got) / len(got), 1) for part in PROFILE_PARTS})
            row["total"] = round(sum(row[part] for part in PROFILE_PARTS), 1)
            rows.append(row)
            print(format_table(rows[-1:], list(rows[-1])), flush=True)
            if keep is not None:  # after the print: keeping stamps the row with its settings, command and commit
                keep(row)
    return rows


def run(sizes: List[int], batches: List[str], sides: List[str], repeats: int, ranks: int = 2,
        rounds: int = 1, keep: Optional[Callable[[Dict], None]] = None) -> List[Dict]:
    """The race's rows: per size and batch, each side's median step, extra memory and first-step loss error.
    Each row goes to ``keep`` as soon as it is measured, so a race cut short keeps the rows it finished.

    Timing runs under glibc's default allocator settings, as a launched job
    does, in ``rounds`` rounds that visit the sides in turn (alst, ring,
    head, alst, ...), each side in fresh processes, so drift of the machine
    falls on every side alike; a side's step is the median of all its
    rounds' steps. The extra memory comes from one more run of each side
    with an exact high-water mark (see :func:`run_ranks`), which slows large
    allocations and so is not timed.
    """
    rows = []
    for n in sizes:
        for batch in batches:
            ref = run_ranks(1, reference_loss, batch, n)[0]
            row: Dict = {"n": n, "batch": batch, "ranks": ranks, "repeats": repeats, "rounds": rounds}
            times: Dict[str, List[float]] = {name: [] for name in sides}
            by_round: Dict[str, List[float]] = {name: [] for name in sides}
            for _ in range(rounds):
                for name in sides:
                    got = run_ranks(ranks, side, name, batch, n, repeats, exact_peak=False)
                    steps = [max(step) for step in zip(*(g["times"] for g in got))]  # a step ends on its last rank
                    times[name] += steps
                    by_round[name].append(statistics.median(steps))
                    row.setdefault(f"{name}_loss_rel_err", float(f"{abs(got[0]['first_loss'] - ref) / abs(ref):.2e}"))
            for name in sides:
                row[f"{name}_step_s"] = round(statistics.median(times[name]), 3)
                mem = run_ranks(ranks, side, name, batch, n, 1)
                row[f"{name}_extra_mb"] = round(max(g["extra_mb"] for g in mem))
            for name in sides:
                if name != "alst" and "alst" in sides:
                    row[f"{name}_over_alst"] = round(row[f"{name}_step_s"] / row["alst_step_s"], 3)
                    row[f"{name}_over_alst_range"] = ratio_range(by_round[name], by_round["alst"])  # round by round
                    row[f"{name}_mb_over_alst"] = round(row[f"{name}_extra_mb"] / max(row["alst_extra_mb"], 1), 2)
            rows.append(row)
            print(format_table(rows[-1:], list(rows[-1])), flush=True)
            if keep is not None:  # after the print: keeping stamps the row with its settings, command and commit
                keep(row)
    return rows
