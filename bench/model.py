"""``python -m bench model``: one training step of a whole model, ``ring_dilated`` against ``sdpa``.

One process, one thread, the scale benchmark's Llama (4 layers, hidden 256, 8
heads, 4 K/V heads, vocabulary 32000, fp32) with the same weights under both
attention implementations. The two alternate step by step (sdpa, ring,
sdpa, ring, ...), after one untimed warm-up step each, so drift of the
machine falls on both alike; the table gives the median step of each and
their ratio. Without sequence parallelism ``ring_dilated`` is exact dense
attention and should cost what ``sdpa`` costs.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Tuple

import torch

from . import race
from .common import ROOT, command_line, commit, format_table, run_ranks, save
from .rowfile import RECORDED, RowFile, add_replace_unrecorded
from hf_ring.integration.seams import enable_checkpointing
from .configs import MODEL

TABLES = {
    "model": (("n", "n"), ("checkpointing", "checkpointing"), ("sdpa_step_s", "sdpa step s"),
              ("ring_step_s", "ring_dilated step s"), ("ring_over_sdpa", "ring_dilated / sdpa"),
              ("pairwise_ratio_spread", "spread of step-by-step ratios")),
    **race.TABLES,
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`);
``--peers`` writes the race's."""
WRITES = race.WRITES
"""Every field a row of the files ``--peers`` writes can hold."""
BESIDE = race.BESIDE


def steps(n: int, repeats: int, checkpointing: bool, device: str = "cpu", dtype: torch.dtype = torch.float32,
          impls: Tuple[str, ...] = ("sdpa", "ring_dilated"), offload: bool = False) -> Dict:
    """Seconds of ``repeats`` training steps per implementation (alternating, after one warm-up each), and on
    CUDA the peak memory each step allocated (MiB). ``offload``: checkpointed layer inputs in host memory."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_ring

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL), attn_implementation="sdpa", dtype=dtype)
    model.to(device).train()
    if checkpointing:
        enable_checkpointing(model)
    if offload:
        hf_ring.offload_checkpoints(model)
    ids = torch.randint(0, MODEL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n)).to(device)
    cuda = device.startswith("cuda")
    peaks: Dict[str, float] = {}

    def step(impl: str) -> float:
        model.set_attn_implementation(impl)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if cuda:
            torch.cuda.synchronize()
            peaks[impl] = max(peaks.get(impl, 0.0), (torch.cuda.max_memory_allocated() - base) / 2**20)
        elapsed = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return elapsed

    times: Dict[str, List[float]] = {impl: [] for impl in impls}
    for impl in times:  # warm-up
        step(impl)
    for _ in range(repeats):
        for impl in times:
            times[impl].append(step(impl))
    return {"times": times, "peak_mb": peaks}


def run(sizes: List[int], repeats: int, checkpointing: bool) -> List[Dict]:
    rows = []
    for n in sizes:
        times = run_ranks(1, steps, n, repeats, checkpointing)[0]["times"]
        sdpa, ring = statistics.median(times["sdpa"]), statistics.median(times["ring_dilated"])
        ratios = sorted(r / s for r, s in zip(times["ring_dilated"], times["sdpa"]))
        rows.append({"n": n, "checkpointing": checkpointing, "sdpa_step_s": round(sdpa, 3),
                     "ring_step_s": round(ring, 3), "ring_over_sdpa": round(ring / sdpa, 3),
                     "pairwise_ratio_spread": f"{ratios[0]:.3f}-{ratios[-1]:.3f}", "repeats": repeats})
        print(format_table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench model", description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per implementation, after one warm-up each")
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on")
    ap.add_argument("--peers", action="store_true",
                    help="race a whole training step on 2 ranks against DeepSpeed's Ulysses (ALST) instead "
                         "(needs the bench extra's deepspeed; see bench.race); off by default")
    ap.add_argument("--batches", nargs="+", choices=race.BATCHES, default=list(race.BATCHES),
                    help="with --peers: the batch forms raced (default: all of them)")
    ap.add_argument("--sides", nargs="+", choices=race.SIDES, default=list(race.SIDES),
                    help="with --peers: alst, ring and/or head (head parallelism) (default: all three)")
    ap.add_argument("--profile", action="store_true",
                    help="with --peers: instead of timing, profile --repeats dense steps of each side and write "
                         "where a step's time goes per layer, their mean (race_profile.json)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="with --peers: timing rounds, each running every side in turn in fresh processes")
    ap.add_argument("--out", default="bench_results",
                    help="where the JSON goes (default bench_results); with --peers each row joins race.json or "
                         "race_profile.json in the place of the row run with the same settings")
    add_replace_unrecorded(ap, "with --peers: ")
    args = ap.parse_args(argv)
    command = command_line("model", argv)
    if args.peers:
        name = "race_profile" if args.profile else "race"
        options = vars(args)
        sink = RowFile(args.out, name, race.WRITES[name], options, command, commit(ROOT),
                       keys={"rows": (race.OPTIONS[name], race.OWN[name])}, beside=race.BESIDE[name],
                       replace_unrecorded=args.replace_unrecorded)

        def keep(row: Dict) -> None:
            sink.keep("rows", row, beside={"model": race.RACE_MODEL})

        if args.profile:
            rows = race.breakdown(args.sizes, args.sides, steps=args.repeats, keep=keep)
        else:
            rows = race.run(args.sizes, args.batches, args.sides, args.repeats, rounds=args.rounds, keep=keep)
        measured = [k for k in rows[0] if k not in RECORDED]  # the stamps keeping added are in the file, not here
        print("\n" + format_table(rows, measured))
        return
    rows = run(args.sizes, args.repeats, args.checkpointing)
    print("\n" + format_table(rows, list(rows[0])))
    save(args.out, "model", {"config": vars(args), "model": MODEL, "rows": rows}, command=command)
