"""``python -m bench ring``: exact ring attention, and its head-parallel modes, against single-process SDPA.

``--mode`` picks the sequence-parallel modes measured side by side: ``ring``
(the ring over 2 ranks, zigzag and contiguous), ``ulysses`` (head parallelism
over 2 ranks: all-to-all, whole-sequence attention over half the heads,
all-to-all back) and ``hybrid`` (head parallelism in groups of 2, the ring
across 2 groups: 4 ranks, shown beside the ring and head parallelism over the
same 4 ranks). Sent bytes are counted on the wire: point-to-point sends and
the all-to-all pieces that leave a rank.

Every configuration runs in fresh one-thread processes, one after another, so
ratios are measured side by side in one run and peak memory is per process.
Every configuration gets the same untimed warm-up call at its size and the
same number of timed repeats, in each of ``--rounds`` interleaved sweeps
over the configurations; tables give the median and the spread
(fastest-slowest) of all of them, each repeat counted at its slowest rank. ``--breakdown``
adds where each rank's forward+backward time goes (kernels, merges, waiting
for K/V or gradients, posting transfers).
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Dict, List, Optional

from .common import (HEAD_PARALLEL, clock, command_line, finish_figure, format_table, measure_attention, planned_mode_mb, run_ranks, save, spread, summary)

BASE_N = 512
BASELINES = (("sdpa", 1, "-"), ("ring", 1, "-"))
MODES = {
    "ring": (("ring", 2, "zigzag"), ("ring", 2, "contiguous")),
    "ulysses": (("ulysses", 2, "-"),),
    "hybrid": (("hybrid", 4, "zigzag"), ("ring", 4, "zigzag"), ("ulysses", 4, "-")),
}
"""Configurations ``(impl, ranks, layout)`` each ``--mode`` adds beside the one-process baselines."""


WIRE_MODEL = {"model": "Llama-3.1-8B shape", "hq": 32, "hkv": 8, "head_dim": 128, "bytes": 2, "n": 131072}
"""The attention shape ``--wire`` plans the traffic of (bf16, 128K tokens)."""

TABLES = {
    "ring": (("n", "n"), ("impl", "impl"), ("world", "ranks"), ("layout", "layout"),
             ("fwd_bwd_s", "fwd+bwd s (median)"), ("fwd_bwd_spread", "spread"),
             ("speedup_over_1_rank", "speed-up over 1 rank"), ("fwd_bwd_ratio", "fwd+bwd / SDPA"),
             ("fwd_ratio", "fwd / SDPA"), ("peak_mb_per_rank", "peak MB per rank"),
             ("peak_ratio_to_1_rank", "peak / 1 rank"), ("sent_mb", "MB sent per rank"),
             ("planned_sent_mb", "MB planned")),
    "ring_wire": (("world", "ranks"), ("mode", "mode"), ("ulysses_size", "ulysses_size"),
                  ("mb_per_layer_per_rank", "MiB sent per layer per rank"), ("over_ring", "/ ring")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def wire_rows(shape: Dict = WIRE_MODEL, worlds=(2, 4, 8, 16)) -> List[Dict]:
    """MiB each mode sends per layer and per rank (busiest rank, causal forward+backward), from the plans alone.

    The same counts as the measured ``sent_mb`` of :func:`run` (checked there, side by side).
    """
    rows = []
    for world in worlds:
        ring = planned_mode_mb(shape["n"], world, 1, "zigzag", shape["hq"], shape["hkv"], 1, shape["head_dim"],
                               shape["bytes"])
        for u in [d for d in range(1, world + 1) if world % d == 0]:
            if shape["hq"] % u or (shape["hkv"] % u and u % shape["hkv"]):
                continue
            mb = planned_mode_mb(shape["n"], world, u, "zigzag", shape["hq"], shape["hkv"], 1, shape["head_dim"],
                                 shape["bytes"])
            mode = "ring" if u == 1 else ("ulysses" if u == world else f"hybrid {u}x{world // u}")
            rows.append({"model": shape["model"], "n": shape["n"], "world": world, "ulysses_size": u, "mode": mode,
                         "mb_per_layer_per_rank": round(mb, 1), "over_ring": round(mb / ring, 2)})
    return rows


def configs(modes: List[str]) -> List[tuple]:
    """The baselines, then each mode's configurations (each once, in the order asked)."""
    out = list(BASELINES)
    for mode in modes:
        out += [c for c in MODES[mode] if c not in out]
    return out


def _timed_parts(impl: str, n: int, layout: str, b: int, h: int, d: int, repeats: int) -> Dict:
    """``measure_attention`` with the ring's kernels, merges and waits timed (seconds per forward+backward)."""
    from hf_ring.engine import comm
    from hf_ring.engine import ring

    spent: Dict[str, float] = defaultdict(float)
    clock(ring, "block_forward", "forward kernels", spent)
    clock(ring, "block_backward", "backward kernels", spent)
    clock(ring, "merge_into", "merges", spent)
    clock(ring, "post", "posting transfers", spent)
    clock(ring, "_scatter_grads", "adding returned gradients", spent)
    clock(comm.Pending, "wait", "waiting for peers", spent)
    got = measure_attention(impl, n, layout if layout != "-" else "zigzag", b, h, d, repeats, what="fwd_bwd")
    calls = repeats + 1  # the warm-up call is timed too
    got["parts"] = {k: v / calls for k, v in spent.items()}
    return got


def _measured(impl: str, world: int, n: int, layout: str, b: int, h: int, d: int, repeats: int,
              floor: Dict, breakdown: bool, earlier: Optional[Dict] = None) -> Dict:
    """Timed runs per rank and the largest rank's peak memory above the same run at ``BASE_N``.

    The resident-set high-water mark carries a fixed cost (libraries paged
    in, the autograd engine's first large backward) that does not depend on
    n; subtracting a run at a small length leaves the memory that grows with n.
    ``earlier``: this configuration's result from an earlier round, whose
    runs are kept beside the new ones.
    """
    lay = layout if layout != "-" else "zigzag"
    key = (impl, world, layout)
    if key not in floor:
        small = run_ranks(world, measure_attention, impl, BASE_N, lay, b, h, d, 1)
        floor[key] = max(r["peak_mb"] for r in small)
    res = run_ranks(world, measure_attention, impl, n, lay, b, h, d, repeats, exact_peak=False)
    out = {"fwd_runs": [r["fwd_runs"] for r in res], "fwd_bwd_runs": [r["fwd_bwd_runs"] for r in res],
           "sent_mb": max(r["sent_mb"] for r in res)}
    if earlier is not None:
        for k in ("fwd_runs", "fwd_bwd_runs"):  # rank by rank, so a repeat's ranks stay side by side
            out[k] = [old + new for old, new in zip(earlier[k], out[k])]
        out.update({k: earlier[k] for k in ("peak_mb", "parts") if k in earlier})
        return out
    # Memory in runs of its own, under the allocator setting that makes the peak exact (see run_ranks).
    mem = run_ranks(world, measure_attention, impl, n, lay, b, h, d, 1, None, "fwd_bwd")
    out["peak_mb"] = max(r["peak_mb"] for r in mem) - floor[key]
    if breakdown and impl == "ring":
        parts = run_ranks(world, _timed_parts, impl, n, layout, b, h, d, repeats, exact_peak=False)
        out["parts"] = [{k: round(v, 3) for k, v in sorted(r["parts"].items())} for r in parts]
    return out


def run(sizes: List[int], repeats: int, b: int, h: int, d: int, breakdown: bool, rounds: int = 1,
        modes: List[str] = ("ring",)) -> List[Dict]:
    """Every configuration at every size; ``rounds`` > 1 sweeps the configurations again and pools the runs.

    Speed on a shared machine drifts over minutes: configurations measured
    one after another would carry that drift into their ratios, while rounds
    interleave them, so each one's runs are spread over the same stretch.
    """
    rows, floor, todo = [], {}, configs(list(modes))
    for n in sizes:
        got: Dict = {}
        for _ in range(rounds):
            for cfg in todo:
                got[cfg] = _measured(cfg[0], cfg[1], n, cfg[2], b, h, d, repeats, floor, breakdown, got.get(cfg))
        for m in got.values():
            m["fwd"], m["fwd_bwd"] = summary(m.pop("fwd_runs")), summary(m.pop("fwd_bwd_runs"))
        sdpa, one = got[BASELINES[0]], got[BASELINES[1]]
        for (impl, world, layout), m in got.items():
            row = {
                "n": n, "impl": impl, "world": world, "layout": layout,
                "fwd_s": round(m["fwd"]["median"], 3), "fwd_spread": spread(m["fwd"]),
                "fwd_bwd_s": round(m["fwd_bwd"]["median"], 3), "fwd_bwd_spread": spread(m["fwd_bwd"]),
                "fwd_ratio": round(m["fwd"]["median"] / sdpa["fwd"]["median"], 3),
                "fwd_bwd_ratio": round(m["fwd_bwd"]["median"] / sdpa["fwd_bwd"]["median"], 3),
                "speedup_over_1_rank": round(one["fwd_bwd"]["median"] / m["fwd_bwd"]["median"], 3),
                "peak_mb_per_rank": round(m["peak_mb"], 1),
                "peak_ratio_to_1_rank": round(m["peak_mb"] / one["peak_mb"], 3),
                "sent_mb": round(m["sent_mb"], 1),
                "planned_sent_mb": round(planned_mode_mb(n, world, HEAD_PARALLEL[impl](world) if impl in HEAD_PARALLEL
                                                         else 1, layout if layout != "-" else "zigzag", h, h, b, d), 1),
                "repeats": m["fwd_bwd"]["runs"],
            }
            if "parts" in m:
                row["time_parts"] = m["parts"]
            rows.append(row)
            print(format_table([row], [c for c in row if c != "time_parts"]), flush=True)
            for rank, parts in enumerate(m.get("parts", [])):
                print(f"  rank {rank}: " + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items()), flush=True)
    return rows


def _plot(rows: List[Dict]):
    def draw(path: str) -> None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        ring_rows = [r for r in rows if r["impl"] != "sdpa"]
        labels = sorted({(r["impl"], r["world"], r["layout"]) for r in ring_rows})
        for impl, world, layout in labels:
            pts = [r for r in ring_rows if (r["impl"], r["world"], r["layout"]) == (impl, world, layout)]
            name = f"{impl} p={world}" + (f" {layout}" if layout != "-" else "") if world > 1 else "p=1"
            axes[0].plot([r["n"] for r in pts], [r["speedup_over_1_rank"] for r in pts], marker="o", label=name)
            axes[1].plot([r["n"] for r in pts], [r["peak_ratio_to_1_rank"] for r in pts], marker="o", label=name)
        axes[0].axhline(2.0, color="gray", ls="--", lw=1)
        axes[0].set_ylabel("forward+backward speed-up over one rank (median)")
        axes[1].set_ylabel("peak memory per rank / one rank")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length")
            ax.legend()
        finish_figure(fig, path, "exact causal attention by mode (B=1, H=8, D=64, fp32, one thread per rank)")

    return draw


COLUMNS = ["n", "impl", "world", "layout", "fwd_bwd_s", "fwd_bwd_spread", "fwd_bwd_ratio", "speedup_over_1_rank",
           "fwd_s", "fwd_ratio", "peak_mb_per_rank", "peak_ratio_to_1_rank", "sent_mb", "planned_sent_mb"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench ring", description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration, after one warm-up")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--breakdown", action="store_true", help="also time the ring's parts (extra runs)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="sweeps over the configurations, interleaved; each runs --repeats timed runs per round")
    ap.add_argument("--mode", nargs="+", choices=sorted(MODES), default=["ring"],
                    help="sequence-parallel modes to measure beside one process (see the module notes)")
    ap.add_argument("--wire", action="store_true",
                    help=f"only plan each mode's traffic per layer and rank for {WIRE_MODEL['model']} (no processes)")
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    command = command_line("ring", argv)
    if args.wire:
        rows = wire_rows()
        print(format_table(rows, list(rows[0])))
        save(args.out, "ring_wire", {"config": dict(vars(args), **WIRE_MODEL), "rows": rows}, command=command)
        return
    rows = run(args.sizes, args.repeats, args.batch, args.heads, args.head_dim, args.breakdown, args.rounds, args.mode)
    print("\n" + format_table(rows, COLUMNS))
    save(args.out, "ring", {"config": vars(args), "rows": rows}, _plot(rows), command=command)
