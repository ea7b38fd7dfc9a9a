"""``python -m bench linear``: dilated attention whose cost is linear in n, as a model.

Each part launches ``examples/finetune.py`` on ``--ranks`` processes as a user does:

- ``retrieval``: ``--dilated linear`` (a 16-head model, the passkey anywhere in
  the sequence) at each of ``--sizes`` and ``--seeds``: accuracy overall and
  by the passkey's depth over the whole sequence;
- ``extension``: the dense demo (README command 1, ``--extend-from`` tokens)
  fine-tuned at ``--extend-to`` tokens with each of ``--extend-modes`` (the
  linear pattern, dense attention) at each of ``--seeds``, the same steps side
  by side; the accuracy at the new length before, along the way and after, and
  at the original length after;
- ``timing``: whole-model training steps at ``--timing-sizes``, the linear
  pattern against the dense ring on the same model, alternating, with each
  rank's resident peak, and the growth of the step per doubling of n;
- ``recipes``: each ``--recipe`` (the example's own arguments; ``--model DEMO``
  starts from README command 1's dense 4096-token demo, trained first) at each
  of ``--seeds``, into ``linear_recipes.json``: the sweeps that decide the preset.

Retrieval, extension and recipes run ``--parallel`` launches at a time (several
fit one GPU); retrieval and extension train in ``--mixed-precision`` (fp32 by
default, so a GPU's rows compare with a CPU's), and their rows say the device.

The accuracy runs are long and their wall times are those of a shared
machine; only the timing part's step times are comparisons.
``--parts`` picks the parts. Every row records the settings it was run with
(``settings``: the part's options and the row's own length, seed or
attention), the command and the commit; a row joins its file as soon as its
run ends (a sweep cut short keeps what it finished), replacing the row run
with the same settings or after the others, so runs made at different times
(more seeds, another machine) gather in one file with nothing merged by hand. ``WRITES`` names every field
a row can hold, which ``python -m bench tables --check`` holds the files to.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple, TypeVar

import torch

from .common import ROOT, command_line, commit, device_name, finish_figure, format_table, ratio_range
from .quality import EXAMPLE, depth_cells, example_args, launch, pattern_cell
from .rowfile import RECORDED, RowFile, add_replace_unrecorded

PARTS = ("retrieval", "extension", "timing", "recipes")
DEMO = "DEMO"
"""In a recipe, ``--model DEMO`` is README command 1's dense demo (4096 tokens, seed 0), trained first."""
DEMO_LEN = 4096

TABLES = {
    "linear": (("n", "n"), ("heads", "query heads"), ("pattern", "pattern"), ("seed", "seed"), ("steps", "steps"),
               ("lr", "peak lr"),
               ("accuracy", "accuracy (8 held-out batches)"), ("accuracy_over_depths", "accuracy over all depths"),
               ("by_depth", "by passkey depth 0/10/…/90%"), ("wall_s", "training s"),
               ("peak_mb_per_rank", "peak MB per rank"), ("device", "device")),
    "linear_extension": (("from", "from"), ("to", "to"), ("attention", "attention"), ("seed", "seed"),
                         ("pattern", "pattern"), ("steps", "steps"), ("lr", "peak lr"), ("before", "at step 0"), ("curve", "during"),
                         ("after", "after"), ("after_over_depths", "after, over all depths"),
                         ("by_depth", "after, by passkey depth 0/10/…/50%"), ("after_at_from", "after, at the old length"),
                         ("wall_s", "training s"), ("step_s_at_full_length", "step s at the new length"),
                         ("device", "device")),
    "linear_recipes": (("part", "run"), ("attention", "attention"), ("n", "n"), ("pattern", "pattern"),
                       ("first_length", "curriculum from"), ("layers", "layers"), ("steps", "steps"), ("lr", "peak lr"),
                       ("sequences_per_step", "sequences per step"), ("seed", "seed"), ("before", "at step 0"),
                       ("accuracy", "accuracy (8 held-out batches)"), ("accuracy_over_depths", "over all depths"),
                       ("by_depth", "by passkey depth"), ("at_4096", "after, at 4096"), ("device", "device"),
                       ("recipe", "recipe")),
    "linear_timing": (("n", "n"), ("ranks", "ranks"), ("base_segment", "base segment"),
                      ("dense_step_s", "dense ring step s"),
                      ("linear_step_s", "linear pattern step s"), ("step_over_dense", "linear / dense"),
                      ("repeats", "repeats"), ("step_over_dense_range", "linear / dense, each repeat"),
                      ("dense_growth", "dense, × per doubling"), ("linear_growth", "linear, × per doubling"),
                      ("dense_peak_mb", "dense peak MB per rank"), ("linear_peak_mb", "linear peak MB per rank")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


Job = TypeVar("Job")


def side_by_side(jobs: Iterable[Job], one: Callable[[Job], Dict], parallel: int) -> Iterator[Dict]:
    """``one(job)`` for every job, ``parallel`` at a time (several runs share one GPU): each row as soon as its run
    ends, so a sweep cut short keeps every run it finished; a failed run stops the sweep, and its error is raised
    once the runs already under way have ended and given their rows."""
    failed: List[BaseException] = []
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        futures = [pool.submit(one, job) for job in jobs]
        for done in as_completed(futures):
            if done.cancelled():
                continue
            if done.exception() is not None:
                failed.append(done.exception())
                for waiting in futures:  # those not started yet never start
                    waiting.cancel()
            else:
                yield done.result()
    if failed:
        raise failed[0]


def _over_depths(summary: Dict) -> float:
    """Accuracy over all the held-out sequences of the by-depth evaluation (every depth alike)."""
    values = list(summary["accuracy_by_depth"].values())
    return round(sum(values) / len(values), 3)


def _base(base_segment: Optional[int]) -> List[str]:
    """The linear pattern's first segment as finetune.py takes it (none: the preset's, by length)."""
    return [] if base_segment is None else ["--base-segment", str(base_segment)]


def retrieval(script: str, sizes: List[int], seeds: List[int], ranks: int, tokens_per_step: int,
              base_segment: Optional[int], precision: str, parallel: int, work: str,
              lr: Optional[float] = None) -> Iterator[Dict]:
    """The linear preset trained from scratch at each length and seed (at ``lr``, None: the preset's): a row as
    each run ends."""
    def one(job: Tuple[int, int]) -> Dict:
        n, seed = job
        out = os.path.join(work, f"linear_{n}_{seed}")
        got = launch(script, ranks, example_args(ranks, n, max(1, tokens_per_step // n), out) + [
            "--seed", str(seed), "--dilated", "linear", "--mixed-precision", precision] + _base(base_segment)
            + ([] if lr is None else ["--lr", str(lr)]))
        row = {"n": n, "heads": got["heads"], "pattern": pattern_cell(got), "seed": seed, "steps": got["steps"],
               "lr": got["lr"], "accuracy": got["accuracy_after"], "by_depth": depth_cells(got),
               "accuracy_over_depths": _over_depths(got), "wall_s": got["wall_s"],
               "peak_mb_per_rank": max(got["peak_rss_mb_per_rank"]), "precision": precision, "device": device_name()}
        print(format_table([row], list(row)), flush=True)
        return row

    yield from side_by_side([(n, seed) for n in sizes for seed in seeds], one, parallel)


def _evaluate(script: str, ranks: int, model: str, n: int, batch: int, pattern: Optional[Dict], out: str,
              precision: str = "auto") -> float:
    """Retrieval accuracy of a checkpoint at ``n`` tokens under ``pattern`` (None: dense), no training."""
    args = example_args(ranks, n, batch, out) + ["--model", model, "--steps", "0", "--depth-prompts", "0",
                                                 "--save-every", "0", "--mixed-precision", precision]
    if pattern is not None:
        args += ["--segment-lengths", *map(str, pattern["segment_lengths"]),
                 "--dilation-rates", *map(str, pattern["dilation_rates"])]
    return launch(script, ranks, args)["accuracy_after"]


def extension(script: str, ranks: int, short: int, long: int, steps: int, lr: float, every: int,
              base_segment: int, warmup_len: int, modes: List[str], seeds: List[int], precision: str, parallel: int,
              work: str) -> Iterator[Dict]:
    """The dense demo checkpoint extended from ``short`` to ``long`` tokens, linear pattern and dense side by side,
    each at every one of ``seeds`` (the demo is one model, seed 0: a user extends the checkpoint they have).

    Both keep the demo's task, the passkey in the first half of the sequence, at every length."""
    demo = os.path.join(work, f"demo_{short}")
    launch(script, ranks, example_args(ranks, short, 4, demo) + ["--seed", "0", "--mixed-precision", precision])

    def one(job: Tuple[str, int]) -> Dict:
        attention, seed = job
        out = os.path.join(work, f"extend_{attention}_{long}_{seed}")
        extra = ["--dilated", "linear", "--base-segment", str(base_segment), "--dense-frac", "0"] \
            if attention == "linear" else []
        got = launch(script, ranks, example_args(ranks, long, 1, out) + [
            "--seed", str(seed), "--model", demo, "--steps", str(steps), "--lr", str(lr), "--eval-every",
            str(every), "--warmup-len", str(warmup_len), "--save-every", "0", "--min-distance", str(long // 2),
            "--mixed-precision", precision] + extra)
        history = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=True)["history"]
        curve = {h["step"]: h["accuracy"] for h in history if "accuracy" in h}
        row = {"from": short, "to": long, "attention": attention, "seed": seed, "pattern": pattern_cell(got),
               "steps": got["steps"], "lr": lr,
               "before": curve[0]}  # the dense checkpoint at the new length under this run's attention
        row["curve"] = " / ".join(f"{curve[s]:.2f}" for s in sorted(curve) if s)
        row["after"] = got["accuracy_after"]
        row["by_depth"] = depth_cells(got)
        row["after_over_depths"] = _over_depths(got)
        row["after_at_from"] = _evaluate(script, ranks, out, short, 4, got["pattern"],
                                         os.path.join(work, f"eval_{attention}_{short}_{seed}"), precision)
        row["wall_s"] = got["wall_s"]
        row["step_s_at_full_length"] = got["step_s_at_full_length"]
        row.update(precision=precision, device=device_name())
        print(format_table([row], list(row)), flush=True)
        return row

    yield from side_by_side([(attention, seed) for attention in modes for seed in seeds], one, parallel)


def timing(script: str, sizes: List[int], ranks: int, steps: int, repeats: int, base_segment: Optional[int],
           work: str) -> Iterator[Dict]:
    """Full-length training steps, the linear pattern and the dense ring on the preset's model, alternating."""
    previous: Optional[Dict] = None
    for n in sizes:
        times: Dict[str, List[float]] = {"dense": [], "linear": []}
        peaks: Dict[str, List[float]] = {"dense": [], "linear": []}
        base = None
        for _ in range(repeats):
            for mode in ("dense", "linear"):
                out = os.path.join(work, f"timing_{mode}_{n}")
                args = example_args(ranks, n, 1, out) + [
                    "--warmup-len", "0", "--steps", str(steps), "--eval-every", str(10 * steps), "--eval-batches", "1",
                    "--depth-prompts", "0", "--save-every", "0"]
                # dense: the linear preset's model and task, without the pattern
                got = launch(script, ranks, args + (
                    ["--dilated", "linear", "--dense-frac", "0"] + _base(base_segment)
                    if mode == "linear" else ["--heads", "16", "--head-dim", "16", "--min-distance", "1"]))
                if mode == "linear":
                    base = got["pattern"]["segment_lengths"][0]
                times[mode].append(got["step_s_at_full_length"])
                peaks[mode].append(max(got["peak_rss_mb_per_rank"]))
        row = {"n": n, "ranks": ranks, "base_segment": base,
               "dense_step_s": round(statistics.median(times["dense"]), 3),
               "linear_step_s": round(statistics.median(times["linear"]), 3)}
        row["step_over_dense"] = round(row["linear_step_s"] / row["dense_step_s"], 3)
        row["repeats"] = repeats
        row["step_over_dense_range"] = ratio_range(times["linear"], times["dense"])  # each repeat's pair back to back
        row["dense_peak_mb"] = round(max(peaks["dense"]), 1)
        row["linear_peak_mb"] = round(max(peaks["linear"]), 1)
        if previous and n == 2 * previous["n"]:
            row["dense_growth"] = round(row["dense_step_s"] / previous["dense_step_s"], 2)
            row["linear_growth"] = round(row["linear_step_s"] / previous["linear_step_s"], 2)
        print(format_table([row], list(row)), flush=True)
        yield row
        previous = row


def _option(args: List[str], name: str) -> Optional[str]:
    """The value of ``name`` in a command's arguments (its last one), or None."""
    found = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    return found[-1] if found else None


def recipe_row(recipe: str, seed: int, got: Dict, at_demo: Optional[float]) -> Dict:
    """A recipe run's row from its summary, which records what the run used (``at_demo``: its accuracy at the
    demo's length, after)."""
    warmup = got["warmup_len"]
    return {"part": f"extension {DEMO_LEN} → {got['seq_len']}" if _option(shlex.split(recipe), "--model") == DEMO
            else "from scratch",
            "attention": got["dilated"] or ("dense" if got["pattern"] is None else "dilated"),
            "n": got["seq_len"], "pattern": pattern_cell(got),
            "first_length": warmup if 0 < warmup < got["seq_len"] else "none (full length)",
            "layers": got["layers"], "steps": got["steps"], "lr": got["lr"],
            "sequences_per_step": got["batch_size"], "seed": seed,
            "before": got["accuracy_before"], "accuracy": got["accuracy_after"],
            "accuracy_over_depths": _over_depths(got), "by_depth": depth_cells(got), "at_4096": at_demo,
            "recipe": recipe, "device": device_name()}


def check_recipes(chosen: List[str]) -> List[List[str]]:
    """Each recipe's arguments; a recipe without its length, or setting what the benchmark sets, is refused."""
    parsed = [shlex.split(recipe) for recipe in chosen]
    for recipe, args in zip(chosen, parsed):
        if _option(args, "--seq-len") is None:
            raise ValueError(f"--recipe {recipe!r}: give its length (--seq-len N)")
        for name in ("--seed", "--output", "--sp-size"):
            if name in args:
                raise ValueError(f"--recipe {recipe!r}: leave {name} out (bench linear sets it: --seeds, --ranks)")
    return parsed


def recipes(script: str, chosen: List[str], seeds: List[int], ranks: int, parallel: int, work: str) -> Iterator[Dict]:
    """Each recipe at each seed, ``parallel`` launches at a time; a row per run as soon as it ends."""
    parsed = check_recipes(chosen)
    demo = os.path.join(work, "demo")
    if any(_option(args, "--model") == DEMO for args in parsed):
        launch(script, ranks, example_args(ranks, DEMO_LEN, 4, demo) + ["--seed", "0"])

    def one(job: Tuple[int, str, int]) -> Dict:
        index, recipe, seed = job
        out = os.path.join(work, f"recipe_{index}_{seed}")
        args = [demo if a == DEMO else a for a in parsed[index]]
        got = launch(script, ranks, ["--sp-size", str(ranks), "--output", out, "--seed", str(seed),
                                     "--save-every", "0"] + args)
        at_demo = None
        if _option(args, "--model") == demo:
            at_demo = _evaluate(script, ranks, out, DEMO_LEN, 4, got["pattern"], out + "_at_demo_length")
        row = recipe_row(recipe, seed, got, at_demo)
        print(format_table([row], list(row)), flush=True)
        return row

    yield from side_by_side([(i, recipe, seed) for i, recipe in enumerate(chosen) for seed in seeds], one, parallel)


def _plot(payload: Dict):
    rows = payload.get("timing", [])
    if not rows:
        return None

    def plot(path: str) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        # the dense ring's step does not depend on the base; a length timed in two runs shows its last
        dense = {r["n"]: r["dense_step_s"] for r in rows}
        ax.plot(sorted(dense), [dense[n] for n in sorted(dense)], marker="s", color="black", label="dense ring")
        for base in sorted({r.get("base_segment") or 0 for r in rows}):
            mine = [r for r in rows if (r.get("base_segment") or 0) == base]
            ax.plot([r["n"] for r in mine], [r["linear_step_s"] for r in mine], marker="o",
                    label=f"linear dilated pattern, base {base}" if base else "linear dilated pattern")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("tokens per sequence (2 ranks)")
        ax.set_ylabel("training step s")
        ax.legend()
        finish_figure(fig, path, "whole-model training step, 16-head Llama, 2 CPU ranks")

    return plot


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", default=EXAMPLE, help="the fine-tuning example (default: %(default)s)")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="(default: all)")
    ap.add_argument("--ranks", type=int, default=2, help="processes, all on one sequence (default: %(default)s)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768],
                    help="retrieval: lengths (default: %(default)s)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="retrieval, extension and recipes: the seeds of their runs (default: %(default)s)")
    ap.add_argument("--tokens-per-step", type=int, default=16384,
                    help="retrieval: sequences per step are this over the length, at least one (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=None,
                    help="retrieval: the peak learning rate (default: the preset's, 2e-3); rows are kept apart by it")
    ap.add_argument("--base-segment", type=int, default=None,
                    help="the linear pattern's first, dense segment (default: the preset's, 1024 up to 16K tokens, "
                         "2048 above)")
    ap.add_argument("--extend-from", type=int, default=4096, help="extension: the demo's length (default: %(default)s)")
    ap.add_argument("--extend-to", type=int, default=32768, help="extension: the new length (default: %(default)s)")
    ap.add_argument("--extend-steps", type=int, default=60, help="extension: steps (default: %(default)s)")
    ap.add_argument("--extend-lr", type=float, default=1e-3, help="extension: peak learning rate (default: %(default)s)")
    ap.add_argument("--extend-every", type=int, default=20,
                    help="extension: evaluate every N steps (default: %(default)s)")
    ap.add_argument("--extend-base-segment", type=int, default=None,
                    help="extension: the pattern's first segment (default: --extend-from, the length the model knows)")
    ap.add_argument("--extend-warmup-len", type=int, default=None,
                    help="extension: the curriculum's first length (default: 2 × --extend-from)")
    ap.add_argument("--extend-modes", nargs="+", default=["linear", "dense"], choices=["linear", "dense"],
                    help="extension: the attentions, one run each (default: %(default)s)")
    ap.add_argument("--timing-sizes", type=int, nargs="+", default=[16384, 32768, 65536],
                    help="timing: lengths (default: %(default)s)")
    ap.add_argument("--timing-steps", type=int, default=3, help="timing: steps per run (default: %(default)s)")
    ap.add_argument("--timing-repeats", type=int, default=1,
                    help="timing: runs per attention and length, alternating (default: %(default)s)")
    ap.add_argument("--recipe", action="append", default=[], metavar="ARGS",
                    help="recipes: the example's arguments for one run, quoted, with its --seq-len, without --seed, "
                         f"--output or --sp-size; --model {DEMO} starts from README command 1's dense demo; repeat "
                         "for more (default: none)")
    ap.add_argument("--parallel", type=int, default=1,
                    help="retrieval, extension and recipes: runs at a time, e.g. several on one GPU with --ranks 1 "
                         "(default: %(default)s)")
    ap.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "auto"],
                    help="retrieval and extension: the example's --mixed-precision (default: %(default)s, fp32 on "
                         "every device, so CPU and GPU rows compare; auto is bf16 on GPUs)")
    ap.add_argument("--out", default="bench_results",
                    help="where linear.json and linear_recipes.json go (default: %(default)s)")
    add_replace_unrecorded(ap)
    args = ap.parse_args(argv)
    if "recipes" in args.parts and not args.recipe:
        ap.error("--parts recipes needs at least one --recipe")
    check_recipes(args.recipe)  # before hours of the other parts
    sink = Sink(args.out, vars(args), command_line("linear", argv), commit(ROOT), args.replace_unrecorded)
    with tempfile.TemporaryDirectory() as work:
        if "retrieval" in args.parts:
            for row in retrieval(args.script, args.sizes, args.seeds, args.ranks, args.tokens_per_step,
                                 args.base_segment, args.mixed_precision, args.parallel, work, args.lr):
                sink.keep("rows", row)
        if "extension" in args.parts:
            for row in extension(args.script, args.ranks, args.extend_from, args.extend_to, args.extend_steps,
                                 args.extend_lr, args.extend_every, args.extend_base_segment or args.extend_from,
                                 args.extend_warmup_len or 2 * args.extend_from, args.extend_modes, args.seeds,
                                 args.mixed_precision, args.parallel, work):
                sink.keep("extension", row)
        if "timing" in args.parts:
            for row in timing(args.script, args.timing_sizes, args.ranks, args.timing_steps, args.timing_repeats,
                              args.base_segment, work):
                sink.keep("timing", row)
        if "recipes" in args.parts:
            for row in recipes(args.script, args.recipe, args.seeds, args.ranks, args.parallel, work):
                sink.keep("recipes", row)


PLACES = {"rows": ("linear", "rows"), "extension": ("linear", "extension"), "timing": ("linear", "timing"),
          "recipes": ("linear_recipes", "rows")}
"""Each part's file and the list of rows in it."""


class Sink:
    """Where a run of the benchmark puts its rows: each part's rows go to its file (a :class:`RowFile`), stamped
    with the part's settings, as soon as its launch ends."""

    def __init__(self, out: str, options: Dict, command: str, made: str, replace_unrecorded: bool = False):
        self.files = {name: RowFile(out, name, WRITES[name], options, command, made,
                                    keys={key: (OPTIONS[part], OWN[part])
                                          for part, (file, key) in PLACES.items() if file == name},
                                    replace_unrecorded=replace_unrecorded,
                                    plot=_plot if name == "linear" else None)
                      for name in WRITES}

    def keep(self, part: str, row: Dict) -> None:
        name, key = PLACES[part]
        self.files[name].keep(key, row)


OPTIONS = {
    "rows": ("ranks", "tokens_per_step", "base_segment", "mixed_precision"),
    "extension": ("ranks", "extend_from", "extend_to", "extend_steps", "extend_lr", "extend_every",
                  "extend_base_segment", "extend_warmup_len", "mixed_precision"),
    "timing": ("ranks", "timing_steps", "timing_repeats", "base_segment"),
    "recipes": ("ranks",),
}
"""The options each part's runs depend on; with :data:`OWN` they make a row's settings."""

OWN = {"rows": ("n", "seed", "lr", "device"), "extension": ("attention", "seed", "device"), "timing": ("n",), "recipes": ("recipe", "seed")}
"""What tells a part's rows of one run apart."""

WRITES: Dict[str, Dict[str, Tuple[str, ...]]] = {
    "linear": {
        "rows": ("n", "heads", "pattern", "seed", "steps", "lr", "accuracy", "by_depth", "accuracy_over_depths",
                 "wall_s", "peak_mb_per_rank", "precision", "device") + RECORDED,
        "extension": ("from", "to", "attention", "seed", "pattern", "steps", "lr", "before", "curve", "after", "by_depth",
                      "after_over_depths", "after_at_from", "wall_s", "step_s_at_full_length", "precision",
                      "device") + RECORDED,
        "timing": ("n", "ranks", "base_segment", "dense_step_s", "linear_step_s", "step_over_dense", "repeats",
                   "step_over_dense_range", "dense_peak_mb", "linear_peak_mb", "dense_growth",
                   "linear_growth") + RECORDED,
    },
    "linear_recipes": {
        "rows": ("part", "attention", "n", "pattern", "first_length", "layers", "steps", "lr", "sequences_per_step",
                 "seed", "before", "accuracy", "accuracy_over_depths", "by_depth", "at_4096", "recipe",
                 "device") + RECORDED,
    },
}
"""Per file this benchmark writes, per list of rows in it, every field its writer can set."""


if __name__ == "__main__":
    main()
