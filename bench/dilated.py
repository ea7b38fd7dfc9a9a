"""``python -m bench dilated``: LongNet dilated attention against dense SDPA.

Default pattern: segments (2048, 4096, 8192, 16384, 32768, 65536) with rates
(1, 2, 4, 8, 16, 32), capped at n. Dense SDPA is timed only up to
``--dense-max`` tokens (its cost grows as n²). Every configuration runs in
fresh one-thread processes, one after another, in this one run, with the
same untimed warm-up and the same number of timed repeats (median reported,
spread beside it).
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Optional

from .common import (command_line, finish_figure, format_table, measure_attention, planned_ring_mb, run_ranks, save, spread, summary)

SEGMENTS = [2048, 4096, 8192, 16384, 32768, 65536]
RATES = [1, 2, 4, 8, 16, 32]

TABLES = {
    "dilated": (("n", "n"), ("world", "ranks"), ("layout", "layout"), ("fwd_s", "fwd s"),
                ("fwd_bwd_s", "fwd+bwd s"), ("fwd_bwd_spread", "spread"), ("dense_fwd_bwd_s", "dense SDPA fwd+bwd s"),
                ("speedup_fwd_bwd", "speed-up over dense"), ("sent_mb", "MB sent per rank"),
                ("unshared_sent_mb", "MB if each branch sent its own rows"), ("dense_ring_sent_mb", "dense ring MB"),
                ("peak_mb", "peak MB per rank")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def _run(world: int, impl: str, n: int, layout: str, b: int, h: int, d: int, repeats: int,
         pattern: Optional[Dict]) -> Dict:
    # Timed with the allocator's defaults, as a launched job runs; the peak in a run of its own (one
    # forward+backward) under the fixed mmap threshold that makes the resident-set peak follow live tensors.
    res = run_ranks(world, measure_attention, impl, n, layout, b, h, d, repeats, pattern, exact_peak=False)
    mem = run_ranks(world, measure_attention, impl, n, layout, b, h, d, 0, pattern, "fwd_bwd")
    fwd, fwd_bwd = summary([r["fwd_runs"] for r in res]), summary([r["fwd_bwd_runs"] for r in res])
    return {"fwd_s": fwd["median"], "fwd_bwd_s": fwd_bwd["median"], "fwd_bwd_spread": spread(fwd_bwd),
            "sent_mb": max(r.get("sent_mb", 0.0) for r in res), "peak_mb": max(r["peak_mb"] for r in mem)}


def run(sizes: List[int], layouts: List[str], dense_max: int, b: int, h: int, d: int, repeats: int) -> List[Dict]:
    rows = []
    for n in sizes:
        segs = [min(w, n) for w in SEGMENTS]
        pattern = {"segment_lengths": segs, "dilation_rates": RATES}
        dense = _run(1, "sdpa", n, "contiguous", b, h, d, repeats, None) if n <= dense_max else None
        configs = [(1, "contiguous")] + [(2, lay) for lay in layouts]
        for world, layout in configs:
            got = _run(world, "ring", n, layout, b, h, d, repeats, pattern)
            row = {
                "n": n, "world": world, "layout": layout if world > 1 else "-",
                "fwd_s": round(got["fwd_s"], 3), "fwd_bwd_s": round(got["fwd_bwd_s"], 3),
                "fwd_bwd_spread": got["fwd_bwd_spread"],
                "dense_fwd_s": round(dense["fwd_s"], 3) if dense else "",
                "dense_fwd_bwd_s": round(dense["fwd_bwd_s"], 3) if dense else "",
                "speedup_fwd_bwd": round(dense["fwd_bwd_s"] / got["fwd_bwd_s"], 2) if dense else "",
                "sent_mb": round(got["sent_mb"], 1),
                "unshared_sent_mb": round(planned_ring_mb(n, world, layout, list(zip(segs, RATES)), h, h, b, d, shared=False), 1)
                if world > 1 else 0,
                "dense_ring_sent_mb": round(planned_ring_mb(n, world, layout, [(n, 1)], h, h, b, d), 1) if world > 1 else 0,
                "peak_mb": round(got["peak_mb"], 1),
            }
            rows.append(row)
            print(format_table([row], list(row)), flush=True)
    return rows


def _plot(rows: List[Dict]):
    def draw(path: str) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for world, layout in sorted({(r["world"], r["layout"]) for r in rows}):
            pts = [(r["n"], r["fwd_bwd_s"]) for r in rows if (r["world"], r["layout"]) == (world, layout)]
            ax.plot(*zip(*pts), marker="o", label=f"dilated p={world} {layout}")
        dense = sorted({(r["n"], r["dense_fwd_bwd_s"]) for r in rows if r["dense_fwd_bwd_s"] != ""})
        if dense:
            ax.plot(*zip(*dense), marker="s", color="black", label="dense SDPA p=1")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("forward+backward seconds")
        ax.set_title("dilated vs dense, causal (B=1, H=8, D=64, fp32)")
        ax.legend()
        finish_figure(fig, path)

    return draw


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench dilated", description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536, 262144])
    ap.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"])
    ap.add_argument("--dense-max", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per configuration, after one warm-up")
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    command = command_line("dilated", argv)
    rows = run(args.sizes, args.layouts, args.dense_max, args.batch, args.heads, args.head_dim, args.repeats)
    print("\n" + format_table(rows, list(rows[0])))
    by = {(r["n"], r["world"], r["layout"]): r["fwd_bwd_s"] for r in rows}
    scaling = {f"p={w} {lay}": round(by[(262144, w, lay)] / by[(65536, w, lay)], 2)
               for (n, w, lay) in by if n == 262144 and (65536, w, lay) in by}
    if scaling:
        print(f"fwd+bwd time ratio 256K / 64K (linear = 4): {scaling}")
    save(args.out, "dilated", {"config": vars(args), "rows": rows, "scaling_256k_over_64k": scaling}, _plot(rows), command=command)
