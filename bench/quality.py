"""``python -m bench quality``: what dilated attention trades, as a model, against the dense ring.

Runs ``examples/finetune.py`` (passkey retrieval, 2 ranks, the sequence split)
for each length and attention, dense and ``--dilated``, the attentions
alternating seed by seed, and collects each run's summary: retrieval accuracy
overall and by the passkey's depth and each rank's resident peak (these runs
are long, so they are not timed). Step time is compared in short runs of their own at full
length, dense and dilated alternating (``--timing-steps``,
``--timing-repeats``; ``--timing-only`` runs just those, for a quiet
machine). With ``--convert-steps`` it also takes the
dense checkpoint of the first seed, evaluates it under the dilated pattern as
it is, and fine-tunes it with the pattern at full length, recording the
accuracy after each number of steps. Tokens per step are the same at every
length (``--tokens-per-step``).

Every row joins ``quality.json`` as soon as its run ends, in the place of the
row with the same settings or after the others (see :mod:`bench.rowfile`), so
lengths and seeds run at different times gather in one file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Callable, Dict, List, Optional

import torch

from .common import ROOT, command_line, commit, format_table, ratio_range
from .rowfile import RECORDED, RowFile, add_replace_unrecorded

EXAMPLE = os.path.join("examples", "finetune.py")
CONVERT_STEPS = (10, 20, 40)
"""The fine-tuning steps a converted dense checkpoint can be evaluated after: each is a column of its table."""

TABLES = {
    "quality": (("n", "n"), ("attention", "attention"), ("pattern", "pattern"), ("seed", "seed"), ("steps", "steps"),
                ("accuracy", "accuracy"), ("by_depth", "accuracy by passkey depth 0/10/20/30/40/50%"),
                ("peak_mb_per_rank", "peak MB per rank")),
    "quality_timing": (("n", "n"), ("ranks", "ranks"), ("batch", "sequences per step"),
                       ("dense_step_s", "dense step s"), ("dilated_step_s", "dilated step s"),
                       ("step_over_dense", "dilated / dense"), ("repeats", "repeats"),
                       ("step_over_dense_range", "dilated / dense, lowest–highest repeat"),
                       ("dense_peak_mb", "dense peak MB per rank"),
                       ("dilated_peak_mb", "dilated peak MB per rank"), ("peak_over_dense", "peak, dilated / dense")),
    "quality_convert": (("n", "n"), ("dense_accuracy_converted", "dense checkpoint under the pattern"))
    + tuple((f"after_{s}_steps", f"after {s} steps") for s in CONVERT_STEPS)
    + (("by_depth_at_end", "by depth after the last"),),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def launch(script: str, ranks: int, args: List[str]) -> Dict:
    """One launch of the example as a user makes it; its summary.json."""
    out = args[args.index("--output") + 1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(ranks)]
    env = dict(os.environ)
    if ranks > 1:
        cmd.append("--multi_gpu")
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"  # without it accelerate starts one process on a machine without GPUs
    done = subprocess.run(cmd + [script] + args, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd + [script] + args)} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def example_args(ranks: int, n: int, batch: int, out: str) -> List[str]:
    """What every launch of the example here shares: the ranks, the length, sequences per step, where it writes."""
    return ["--sp-size", str(ranks), "--seq-len", str(n), "--batch-size", str(batch), "--output", out]


def pattern_cell(summary: Dict) -> str:
    """A run's pattern as a table cell: its segment lengths / its dilation rates ("" for dense attention)."""
    p = summary["pattern"]
    return "" if p is None else f"{p['segment_lengths']} / {p['dilation_rates']}"


def depth_cells(summary: Dict) -> str:
    return " / ".join(f"{v:.2f}" for v in summary["accuracy_by_depth"].values())


def run(script: str, sizes: List[int], seeds: List[int], modes: List[str], tokens_per_step: int, ranks: int,
        convert_steps: List[int], work: str, keep: Callable[[str, Dict], None]) -> None:
    """The accuracy runs, each row handed to ``keep`` (with its list, ``rows`` or ``converted``) as it ends."""
    for n in sizes:
        batch = max(1, tokens_per_step // n)
        for seed in seeds:  # the attentions alternate, so a drift of the machine's speed touches both alike
            for mode in modes:
                out = os.path.join(work, f"{mode}_{n}_{seed}")
                args = example_args(ranks, n, batch, out) + ["--seed", str(seed)] + (["--dilated"] if mode == "dilated" else [])
                got = launch(script, ranks, args)
                row = {"n": n, "attention": mode, "pattern": pattern_cell(got), "seed": seed, "steps": got["steps"],
                       "accuracy": got["accuracy_after"],
                       "by_depth": depth_cells(got), "peak_mb_per_rank": max(got["peak_rss_mb_per_rank"])}
                print(format_table([row], list(row)), flush=True)
                keep("rows", row)
        if convert_steps and "dense" in modes:
            row = _convert(script, n, seeds[0], batch, ranks, convert_steps, work)
            print(format_table([row], list(row)), flush=True)
            keep("converted", row)


def timing(script: str, sizes: List[int], tokens_per_step: int, ranks: int, steps: int, repeats: int,
           work: str, keep: Callable[[str, Dict], None]) -> None:
    """Training steps at full length with no curriculum, dense and dilated alternating: the step-time comparison,
    in runs short enough to take on a quiet machine (the accuracy runs are long, and only their accuracy counts).
    Each length's row goes to ``keep`` as it ends."""
    for n in sizes:
        batch = max(1, tokens_per_step // n)
        times: Dict[str, List[float]] = {"dense": [], "dilated": []}
        peaks: Dict[str, List[float]] = {"dense": [], "dilated": []}
        for _ in range(repeats):
            for mode in ("dense", "dilated"):
                out = os.path.join(work, f"timing_{mode}_{n}")
                args = example_args(ranks, n, batch, out) + ["--warmup-len", "0", "--steps", str(steps), "--eval-every",
                                                      str(10 * steps), "--eval-batches", "1", "--depth-prompts", "0",
                                                      "--save-every", "0"]
                got = launch(script, ranks, args + (["--dilated", "--dense-frac", "0"] if mode == "dilated" else []))
                times[mode].append(got["step_s_at_full_length"])
                peaks[mode].append(max(got["peak_rss_mb_per_rank"]))
        row = {"n": n, "ranks": ranks, "batch": batch, "repeats": repeats,
               "dense_step_s": round(statistics.median(times["dense"]), 3),
               "dilated_step_s": round(statistics.median(times["dilated"]), 3)}
        row["step_over_dense"] = round(row["dilated_step_s"] / row["dense_step_s"], 2)
        row["step_over_dense_range"] = ratio_range(times["dilated"], times["dense"])  # each repeat's pair in turn
        row["dense_peak_mb"] = round(max(peaks["dense"]), 1)
        row["dilated_peak_mb"] = round(max(peaks["dilated"]), 1)
        row["peak_over_dense"] = round(row["dilated_peak_mb"] / row["dense_peak_mb"], 2)
        print(format_table([row], list(row)), flush=True)
        keep("timing", row)


def _convert(script: str, n: int, seed: int, batch: int, ranks: int, steps: List[int], work: str) -> Dict:
    """The dense checkpoint under the dilated pattern as it is, then fine-tuned with it at full length."""
    out = os.path.join(work, f"convert_{n}")
    every = steps[0]
    args = example_args(ranks, n, batch, out) + [
        "--seed", str(seed), "--model", os.path.join(work, f"dense_{n}_{seed}"), "--dilated", "--dense-frac", "0",
        "--warmup-len", "0", "--steps", str(max(steps)), "--eval-every", str(every), "--save-every", "0"]
    got = launch(script, ranks, args)
    history = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=True)["history"]
    curve = {h["step"]: h["accuracy"] for h in history if "accuracy" in h}
    row = {"n": n, "seed": seed, "dense_accuracy_converted": curve[0]}
    for s in steps:
        row[f"after_{s}_steps"] = curve.get(s)
    row["by_depth_at_end"] = depth_cells(got)
    return row


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", default=EXAMPLE, help="the fine-tuning example (default: %(default)s)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384], help="lengths (default: %(default)s)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds per length and attention "
                    "(default: %(default)s)")
    ap.add_argument("--modes", nargs="+", default=["dense", "dilated"], choices=["dense", "dilated"],
                    help="attentions to train (default: %(default)s)")
    ap.add_argument("--tokens-per-step", type=int, default=16384,
                    help="sequences per step are this over the length (default: %(default)s)")
    ap.add_argument("--ranks", type=int, default=2, help="processes, all on one sequence (default: %(default)s)")
    ap.add_argument("--convert-steps", type=int, nargs="*", default=list(CONVERT_STEPS), choices=CONVERT_STEPS,
                    help="evaluate the converted dense checkpoint after these fine-tuning steps; the first is also "
                         "the evaluation interval (default: %(default)s; none: no conversion)")
    ap.add_argument("--out", default="bench_results",
                    help="where quality.json goes; each row joins it in the place of the row run with the same "
                         "settings (default: %(default)s)")
    add_replace_unrecorded(ap)
    ap.add_argument("--timing-steps", type=int, default=10,
                    help="steps per timing run at full length (default: %(default)s)")
    ap.add_argument("--timing-repeats", type=int, default=2,
                    help="timing runs per attention and length, alternating (default: %(default)s)")
    ap.add_argument("--timing-only", action="store_true", help="only the step-time comparison (default: off)")
    args = ap.parse_args(argv)
    if args.convert_steps and any(s % args.convert_steps[0] for s in args.convert_steps):
        ap.error(f"--convert-steps: the first ({args.convert_steps[0]}) is the evaluation interval, so every other "
                 f"must be a multiple of it; got {args.convert_steps}")
    options = vars(args)
    sink = RowFile(args.out, "quality", WRITES["quality"], options, command_line("quality", argv), commit(ROOT),
                   keys={key: (OPTIONS[key], OWN[key]) for key in OPTIONS}, replace_unrecorded=args.replace_unrecorded)
    keep = sink.keep
    with tempfile.TemporaryDirectory() as work:
        if not args.timing_only:
            run(args.script, args.sizes, args.seeds, args.modes, args.tokens_per_step, args.ranks, args.convert_steps,
                work, keep)
        timing(args.script, args.sizes, args.tokens_per_step, args.ranks, args.timing_steps, args.timing_repeats,
               work, keep)


OPTIONS = {"rows": ("ranks", "tokens_per_step"), "converted": ("ranks", "tokens_per_step", "convert_steps"),
           "timing": ("ranks", "tokens_per_step", "timing_steps")}
"""The options each list's rows depend on; with :data:`OWN` they make a row's settings (the number of timing
repeats is how well a ratio is measured, not what it measures: a row records its own)."""

OWN = {"rows": ("n", "attention", "seed"), "converted": ("n", "seed"), "timing": ("n",)}
"""What tells a list's rows of one run apart."""

WRITES = {"quality": {
    "rows": ("n", "attention", "pattern", "seed", "steps", "accuracy", "by_depth", "peak_mb_per_rank") + RECORDED,
    "converted": ("n", "seed", "dense_accuracy_converted") + tuple(f"after_{s}_steps" for s in CONVERT_STEPS)
    + ("by_depth_at_end",) + RECORDED,
    "timing": ("n", "ranks", "batch", "repeats", "dense_step_s", "dilated_step_s", "step_over_dense",
               "step_over_dense_range", "dense_peak_mb", "dilated_peak_mb", "peak_over_dense") + RECORDED,
}}
"""Every field a row of quality.json can hold (``bench tables --check`` holds the file to them)."""


if __name__ == "__main__":
    main()
