"""``python -m hf_ring.bench ring``: exact ring attention against single-process SDPA.

Every configuration runs in fresh one-thread processes, one after another, so
ratios are measured side by side in one run and peak memory is per process.
"""
from __future__ import annotations

import argparse
from typing import Dict, List

from .common import format_table, measure_attention as _measure, run_ranks, save


BASE_N = 512


def _measured(impl: str, world: int, n: int, layout: str, b: int, h: int, d: int, repeats: int,
              floor: Dict) -> Dict:
    """Slowest rank's times and largest rank's peak memory above the same run at ``BASE_N``.

    The resident-set high-water mark carries a fixed cost (libraries paged
    in, the autograd engine's first large backward) that does not depend on
    n; subtracting a run at a small length leaves the memory that grows with n.
    """
    key = (impl, world, layout)
    if key not in floor:
        small = run_ranks(world, _measure, impl, BASE_N, layout, b, h, d, 1)
        floor[key] = max(r["peak_mb"] for r in small)
    res = run_ranks(world, _measure, impl, n, layout, b, h, d, repeats)
    return {"fwd_s": max(r["fwd_s"] for r in res), "fwd_bwd_s": max(r["fwd_bwd_s"] for r in res),
            "peak_mb": max(r["peak_mb"] for r in res) - floor[key]}


def run(sizes: List[int], repeats: int, b: int, h: int, d: int) -> List[Dict]:
    rows, floor = [], {}
    for n in sizes:
        ref = _measured("sdpa", 1, n, "contiguous", b, h, d, repeats, floor)
        configs = [("ring", 1, "zigzag"), ("ring", 2, "zigzag"), ("ring", 2, "contiguous")]
        for impl, world, layout in configs:
            got = _measured(impl, world, n, layout, b, h, d, repeats, floor)
            fwd, fb, peak = got["fwd_s"], got["fwd_bwd_s"], got["peak_mb"]
            rows.append({
                "n": n, "world": world, "layout": layout if world > 1 else "-",
                "sdpa_fwd_s": round(ref["fwd_s"], 3), "fwd_s": round(fwd, 3),
                "fwd_ratio": round(fwd / ref["fwd_s"], 3),
                "sdpa_fwd_bwd_s": round(ref["fwd_bwd_s"], 3), "fwd_bwd_s": round(fb, 3),
                "fwd_bwd_ratio": round(fb / ref["fwd_bwd_s"], 3),
                "sdpa_peak_mb": round(ref["peak_mb"], 1), "peak_mb_per_rank": round(peak, 1),
                "peak_ratio": round(peak / ref["peak_mb"], 3),
            })
            print(format_table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def _plot(rows: List[Dict]):
    def draw(path: str) -> None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, key, title in ((axes[0], "fwd_ratio", "forward"), (axes[1], "fwd_bwd_ratio", "forward+backward")):
            labels = sorted({(r["world"], r["layout"]) for r in rows})
            for world, layout in labels:
                pts = [(r["n"], r[key]) for r in rows if (r["world"], r["layout"]) == (world, layout)]
                ax.plot(*zip(*pts), marker="o", label=f"p={world} {layout}")
            ax.axhline(1.0, color="gray", ls="--", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length")
            ax.set_ylabel("time / single-process SDPA")
            ax.set_title(f"causal {title} (B=1, H=8, D=64, fp32)")
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    return draw


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hf_ring.bench ring", description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    rows = run(args.sizes, args.repeats, args.batch, args.heads, args.head_dim)
    cols = ["n", "world", "layout", "fwd_ratio", "fwd_bwd_ratio", "fwd_s", "fwd_bwd_s",
            "sdpa_fwd_s", "sdpa_fwd_bwd_s", "peak_mb_per_rank", "sdpa_peak_mb", "peak_ratio"]
    print("\n" + format_table(rows, cols))
    save(args.out, "ring", {"config": vars(args), "rows": rows}, _plot(rows))
