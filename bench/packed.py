"""``python -m bench packed``: packed rows split by position (zigzag) against split by document (balanced).

Counted (no processes): for each packing of a ``--n`` row and each ring size,
the worst rank's attention work over the mean's, under ``zigzag`` and under the
plan ``layout="balanced"`` chooses (:mod:`hf_ring.engine.balance`), and what
the plan costs to make; for dense causal attention and for a window of 4096
rows (there also the plan that weighs causal pairs, as without
``balance_for``). Head parallelism attends the whole row on
every rank for a share of the heads, so its ratio is 1.0 by construction.

Timed (``--time-n``, 0 to skip): a 4-layer Llama-like model (the benchmarks'
sizes, fp32, random weights) trains one packed row in fresh one-thread
processes: one process (``ring_dilated`` over the whole row given the
documents' offsets, so that it computes what the ranks compute and skips the
blocks two documents do not share, as they do), then 2 ranks as the ring with each layout
and as head parallelism, one untimed step then ``--repeats`` timed steps (the slowest
rank's), interleaved over ``--rounds``. A row holds the median step, the real
tokens per second, the speed-up over one process and its ratio to the same
layout's speed-up on one document of the same length, and the peak memory per
rank.

The packings: one document; 16 equal documents; one of half the row, then 32
equal ones; the same reversed; and three seeded draws of log-normal lengths
(median 1/32 of the row, sigma 1), the last document taking the rest.
"""
from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import hf_ring
from hf_ring.engine.balance import Work, plan_documents, worst_over_mean
from hf_ring.engine.layout import local_runs

from .common import command_line, format_table, run_ranks, save, timed_steps
from .configs import MODEL

SEEDS = (0, 1, 2)
TABLES = {
    "packed_counted": (("n", "tokens"), ("packing", "packing"), ("documents", "documents"), ("ranks", "ranks"),
                       ("attention", "attention"), ("zigzag_worst_over_mean", "zigzag: worst rank's work / mean"),
                       ("balanced_worst_over_mean", "balanced: worst / mean"),
                       ("causal_weighed_worst_over_mean", "balanced weighing causal pairs: worst / mean"),
                       ("balanced_runs", "runs per rank"), ("plan_ms", "plan ms")),
    "packed_timed": (("n", "tokens"), ("packing", "packing"), ("ranks", "ranks"), ("mode", "mode"),
                     ("step_s", "step s"), ("step_spread", "spread"), ("real_tok_s", "real tokens/s"),
                     ("speedup", "speed-up"), ("vs_one_document", "vs one document's"), ("peak_mb", "peak MB per rank"),
                     ("repeats", "steps")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def packings(n: int) -> Dict[str, Tuple[int, ...]]:
    """Document lengths of each packing of an ``n``-row row, by name."""
    half, small = n // 2, n // 64
    out = {"one document": (n,), "16 equal": (n // 16,) * 16,
           "half, then 32 small": (half,) + (small,) * 32 + ((n - half - 32 * small,) if n - half - 32 * small else ()),
           "32 small, then half": (small,) * 32 + (n - 32 * small,)}
    for seed in SEEDS:
        rng, lengths = random.Random(seed), []
        while True:
            length = max(1, int(rng.lognormvariate(math.log(n / 32), 1.0)))
            if sum(lengths) + length >= n:
                lengths.append(n - sum(lengths))
                break
            lengths.append(length)
        out[f"log-normal, seed {seed}"] = tuple(lengths)
    return out


def _starts(lengths) -> Tuple[int, ...]:
    starts, at = [], 0
    for length in lengths:
        starts.append(at)
        at += length
    return tuple(starts)


WORKS = {"causal": Work(), "window 4096": Work(((1, 4096, ()),))}
"""The attention a document is weighed by in the counted rows: dense causal, and a sliding window of 4096 rows."""


def counted_rows(sizes: List[int], ranks: List[int]) -> List[Dict]:
    rows = []
    for n in sizes:
        for name, lengths in packings(n).items():
            starts = _starts(lengths)
            for p in ranks:
                for attention, work in WORKS.items():
                    t0 = time.perf_counter()
                    plan = plan_documents(n, starts, p, work)
                    spent = time.perf_counter() - t0
                    zigzag = [local_runs(n, r, p, "zigzag") for r in range(p)]
                    row = {"n": n, "packing": name, "documents": len(lengths), "ranks": p, "attention": attention,
                           "zigzag_worst_over_mean": round(worst_over_mean(zigzag, starts, n, work), 3),
                           "balanced_worst_over_mean": round(worst_over_mean(plan.runs, starts, n, work), 3),
                           "balanced_runs": max(len(r) for r in plan.runs), "plan_ms": round(spent * 1e3, 2)}
                    if work != Work():  # the plan that weighs causal pairs, counted under this attention
                        causal = plan_documents(n, starts, p)
                        row["causal_weighed_worst_over_mean"] = round(worst_over_mean(causal.runs, starts, n, work), 3)
                    rows.append(row)
    return rows


def _batch(lengths, whole: bool) -> Dict[str, torch.Tensor]:
    """One packed row. ``whole`` (one process) adds the documents' offsets and ``use_cache=False``: from restarting
    positions alone transformers' mask in one process lets rows attend across documents (``shard_batch`` reads
    them as documents), and with a cache it does not separate them while the offsets do."""
    n = sum(lengths)
    ids = torch.randint(0, MODEL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
    positions = torch.cat([torch.arange(length) for length in lengths])[None]
    batch = {"input_ids": ids, "labels": ids, "position_ids": positions}
    if whole:
        offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        batch.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=max(lengths),
                     max_length_k=max(lengths), use_cache=False)
    return batch


def measure(mode: str, lengths, repeats: int) -> Dict:
    """One rank's step times and peak memory for ``mode`` ("one process", "zigzag", "balanced", "heads")."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**MODEL), attn_implementation="ring_dilated").train()
    split = dict
    if world > 1:
        layout = "zigzag" if mode == "heads" else mode
        hf_ring.configure(model, layout=layout)
        hf_ring.setup_sequence_parallel(None, layout=layout, ulysses_size=world if mode == "heads" else 1,
                                        balance_for=model)
        split = hf_ring.shard_batch
    try:
        return timed_steps(model, split, _batch((512,), world == 1), _batch(lengths, world == 1), repeats)
    finally:
        hf_ring.clear_sequence_parallel()


MODES = (("one process", 1), ("zigzag", 2), ("balanced", 2), ("heads", 2))


def timed_rows(n: int, names: List[str], repeats: int, rounds: int) -> List[Dict]:
    chosen = {name: packings(n)[name] for name in names}
    found: Dict = {(name, mode): [] for name in chosen for mode, _ in MODES}
    for _ in range(rounds):  # interleaved, so drift of the machine falls on every configuration alike
        for name, lengths in chosen.items():
            for mode, world in MODES:
                found[name, mode].append(run_ranks(world, measure, mode, lengths, repeats))
    stats = {}
    for key, runs in found.items():
        steps = [max(times) for ranks in runs for times in zip(*(r["steps"] for r in ranks))]
        stats[key] = {"step": statistics.median(steps), "steps": steps, "repeats": len(steps),
                      "peak": max(r["peak_mb"] for ranks in runs for r in ranks)}
    rows = []
    for (name, mode), s in stats.items():
        world = dict(MODES)[mode]
        speedup = stats[name, "one process"]["step"] / s["step"]
        single = stats.get(("one document", mode))
        one_doc = stats["one document", "one process"]["step"] / single["step"] if single else None
        rows.append({"n": n, "packing": name, "ranks": world, "mode": mode, "step_s": round(s["step"], 3),
                     "step_spread": f"{min(s['steps']):.3g}-{max(s['steps']):.3g}",
                     "real_tok_s": round(n / s["step"]), "speedup": round(speedup, 3),
                     "vs_one_document": None if one_doc is None else round(speedup / one_doc, 3),
                     "peak_mb": round(s["peak"], 1), "repeats": s["repeats"]})
        print(format_table([rows[-1]], list(rows[-1])), flush=True)
    return rows


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench packed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[16384, 65536], help="row lengths counted")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="ring sizes counted")
    ap.add_argument("--time-n", type=int, default=16384, help="row length timed (0: no timed rows)")
    ap.add_argument("--time-packings", nargs="+", default=["one document", "16 equal", "half, then 32 small",
                                                           "32 small, then half", "log-normal, seed 0"],
                    help="packings timed (names as in the counted table)")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per configuration and round")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the configurations")
    ap.add_argument("--out", default="bench_results", help="where the JSON goes (default bench_results)")
    args = ap.parse_args(argv)
    counted = counted_rows(args.n, args.ranks)
    print(format_table(counted, [k for k, _ in TABLES["packed_counted"]]), flush=True)
    timed = timed_rows(args.time_n, args.time_packings, args.repeats, args.rounds) if args.time_n else []
    save(args.out, "packed", {"config": vars(args), "model": MODEL, "counted": counted, "timed": timed},
         command=command_line("packed", argv))
    if timed:
        print("\n" + format_table(timed, [k for k, _ in TABLES["packed_timed"]]))
