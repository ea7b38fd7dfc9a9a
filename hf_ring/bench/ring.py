"""``python -m hf_ring.bench ring``: exact ring attention against single-process SDPA.

Every configuration runs in fresh one-thread processes, one after another, so
ratios are measured side by side in one run and peak memory is per process.
"""
from __future__ import annotations

import argparse
from typing import Dict, List

import torch
import torch.nn.functional as F

from .common import best_time, format_table, peak_rss_mb, rss_mb, run_ranks, save


def _measure(impl: str, n: int, layout: str, b: int, h: int, d: int, repeats: int) -> Dict:
    import torch.distributed as dist

    import hf_ring

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def inputs(length):
        g = torch.Generator().manual_seed(0)
        rows = len(hf_ring.local_positions(length, rank, world, layout))
        ts = [torch.randn(b, h, rows, d, generator=g) for _ in range(4)]
        return [t.requires_grad_(i < 3) for i, t in enumerate(ts)]

    def attn_fn(q, k, v, length):
        if impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return hf_ring.ring_attention(q, k, v, layout=layout, seq_len=length)

    # Warm up kernels, threads and the allocator on a small problem so the
    # timings and the memory high-water mark below belong to size n alone.
    wq, wk, wv, wdo = inputs(256)
    attn_fn(wq, wk, wv, 256).backward(wdo)
    base = rss_mb()
    q, k, v, do = inputs(n)

    def attn():
        return attn_fn(q, k, v, n)

    def fwd():
        with torch.no_grad():
            attn()

    def fwd_bwd():
        attn().backward(do)
        q.grad = k.grad = v.grad = None

    if world > 1:
        dist.barrier()
    t_fwd = best_time(fwd, repeats)
    if world > 1:
        dist.barrier()
    t_fb = best_time(fwd_bwd, repeats)
    return {"fwd_s": t_fwd, "fwd_bwd_s": t_fb, "peak_mb": peak_rss_mb() - base}


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
