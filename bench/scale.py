"""``python -m bench scale``: whole training steps at growing length, time and peak memory per rank.

A random Llama (default: 4 layers, hidden 256, 8 heads, 4 K/V heads,
vocabulary 32000, fp32) takes one step (forward, backward, gradient sync) with
gradient checkpointing on a sequence of n tokens split over p gloo ranks, with
dense attention or a dilated pattern whose longest segment is the whole
sequence (segments 2048, 4096, ... n with rates 1, 2, 4, ...), with sequence
tiling of the loss and the MLP on or off. Every configuration runs in fresh
processes. Reported per rank: step time, peak resident set (absolute, and
above the model-and-warm-up baseline). Peak memory per rank is fitted as
``a + b * n / p`` by least squares for each (attention, tiling) group. At the
largest n of each group the step runs under a tensor tracker that records the
live tensors at their peak, by where they were made (phase, module, op).

``--hybrid`` trains the Qwen3.5-like hybrid of ``bench hybrid`` instead (three
gated delta rule layers to one attention layer, the attention layer on the
same dilated pattern) and reports beside each step the seconds spent in its
recurrent layers, forward, recomputation and backward, on the slowest rank,
and the growth per doubling of n of both (2.0 is linear), in
scale_hybrid.json.

Every row joins the file as soon as its processes end, in the place of the
row with the same settings or after the others (see :mod:`bench.rowfile`),
and the fits are made again from all the rows: lengths run at different times
(a million tokens alone on a quiet machine) gather in one file.
"""
from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_ring.integration.seams import enable_checkpointing
from .common import ROOT, command_line, commit, finish_figure, format_table, peak_rss_mb, rss_mb, run_ranks
from .configs import HYBRID, MODEL, dilated_pattern, hybrid_config
from .hybrid import recurrent_timers
from .rowfile import RECORDED, RowFile, add_replace_unrecorded

TRACK_BYTES = 1 << 20
"""Tensors below this size are left out of the breakdown (their sum is negligible at these lengths)."""

TABLES = {
    "scale": (("n", "n"), ("world", "ranks"), ("attention", "attention"), ("tiling", "tiled"), ("step_s", "step s"),
              ("peak_mb", "peak MB per rank"), ("fit_mb", "fit MB"), ("fit_off", "fit off by")),
    "scale_hybrid": (("n", "n"), ("world", "ranks"), ("attention", "attention"), ("tiling", "tiled"),
                     ("step_s", "step s"), ("step_growth", "step growth per doubling"),
                     ("recurrent_s", "recurrent layers s"), ("recurrent_growth", "recurrent growth per doubling"),
                     ("peak_mb", "peak MB per rank"), ("fit_mb", "fit MB"), ("fit_off", "fit off by")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


class LiveTensors(TorchDispatchMode):
    """Records every tensor of at least ``TRACK_BYTES`` an op makes and the live set at its largest.

    A tensor is labelled ``phase|module|op``: the phase ("forward" or
    "backward"), the innermost module running (layer indices folded into
    ``*``) or, in the backward outside any module, the autograd node, and the
    op. Storage is counted once, however many views share it.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.names = {id(m): _fold(name) for name, m in model.named_modules()}
        self.stack: List[str] = []
        self.phase = "forward"
        self.live: Dict[int, Tuple] = {}
        self.peak_bytes = 0
        self.at_peak: List[Tuple] = []
        self._hooks = []

    def __enter__(self):
        from torch.nn.modules import module as nn_module

        self._hooks = [nn_module.register_module_forward_pre_hook(self._push),
                       nn_module.register_module_forward_hook(self._pop)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def _push(self, module, args):
        name = self.names.get(id(module), type(module).__name__)
        # A recomputation that checkpointing stops early never runs its forward
        # hooks: drop entries that are not ancestors of the module starting now.
        while self.stack and not name.startswith(self.stack[-1]):
            self.stack.pop()
        self.stack.append(name)

    def _pop(self, module, args, out):
        name = self.names.get(id(module), type(module).__name__)
        while self.stack and self.stack.pop() != name:
            pass

    def _where(self) -> str:
        where = (self.stack[-1] or "model") if self.stack else "-"
        node = torch._C._current_autograd_node()
        return where if node is None else f"{where}/{node.name()}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        added = False
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                nbytes = storage.nbytes()
                key = storage.data_ptr()
                if nbytes < TRACK_BYTES or key in self.live:
                    continue
                label = f"{self.phase}|{self._where()}|{func.overloadpacket.__name__}"
                self.live[key] = (StorageWeakRef(storage), nbytes, label, tuple(t.shape), str(t.dtype))
                added = True
        if added:
            self._update()
        return out

    def _update(self) -> None:
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        total = sum(v[1] for v in self.live.values())
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.at_peak = [v[1:] for v in self.live.values()]

    def report(self, top: int = 12) -> Dict:
        """The live tensors at the peak: bytes by label, and the largest tensors."""
        by_label: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
        for nbytes, label, _, _ in self.at_peak:
            by_label[label][0] += nbytes
            by_label[label][1] += 1
        labels = sorted(by_label.items(), key=lambda kv: -kv[1][0])[:top]
        largest = sorted(self.at_peak, key=lambda v: -v[0])[:top]
        return {"peak_tracked_mb": round(self.peak_bytes / 2**20, 1),
                "by_label": [{"label": k, "mb": round(v[0] / 2**20, 1), "tensors": v[1]} for k, v in labels],
                "largest": [{"shape": list(s), "dtype": d, "mb": round(b / 2**20, 1), "label": lab}
                            for b, lab, s, d in largest]}


def _fold(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _step(cfg: Dict) -> Dict:
    """One training step on this rank; returns time, memory and (optionally) the live-tensor breakdown."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_ring

    torch.set_num_threads(cfg["threads"])
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        hf_ring.setup_sequence_parallel(None, layout=cfg["layout"])
    torch.manual_seed(0)
    config = hybrid_config(**cfg["model"]) if cfg["hybrid"] else LlamaConfig(**cfg["model"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated", dtype=torch.float32)
    spent = {"recurrent": 0.0}
    if cfg["hybrid"]:
        recurrent_timers(model, spent)
    model.train()
    enable_checkpointing(model)
    parts = cfg["parts"] if cfg["tiling"] == "on" else ()
    hf_ring.configure_tiling(model, loss="loss" in parts, mlp="mlp" in parts, norm="norm" in parts,
                             loss_chunk_rows=cfg["loss_chunk_rows"], row_chunk_rows=cfg["row_chunk_rows"])
    vocab = cfg["model"]["vocab_size"]

    def step(n: int, tracker: Optional[LiveTensors] = None) -> float:
        pattern = dilated_pattern(n, cfg["min_segment"]) if cfg["attention"] == "dilated" else None
        hf_ring.configure(model, pattern=pattern, layout=cfg["layout"])
        ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n))
        batch = hf_ring.shard_batch({"input_ids": ids, "labels": ids})
        del ids
        if world > 1:
            dist.barrier()
        spent["recurrent"] = 0.0
        t0 = time.perf_counter()
        if tracker is None:
            model(**batch).loss.backward()
        else:
            with tracker:
                loss = model(**batch).loss
                tracker.phase = "backward"
                loss.backward()
                del loss
        hf_ring.sync_gradients(model)
        elapsed = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return elapsed

    step(512)  # warm-up: kernels, threads, allocator, gradient buffers
    base = rss_mb()
    tracker = LiveTensors(model) if cfg["breakdown"] else None
    elapsed = step(cfg["n"], tracker)
    out = {"step_s": elapsed, "peak_mb": peak_rss_mb(), "peak_above_base_mb": peak_rss_mb() - base,
           "base_mb": base,
           "param_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
           "recurrent_s": spent["recurrent"]}
    if tracker is not None:
        out["breakdown"] = tracker.report()
    hf_ring.clear_sequence_parallel()
    return out


def fit(rows: List[Dict]) -> Dict:
    """Least-squares ``peak_mb = a + b * n / p`` over rows; b reported in KiB per local token."""
    xs = torch.tensor([r["n"] / r["world"] for r in rows], dtype=torch.float64)
    ys = torch.tensor([r["peak_mb"] for r in rows], dtype=torch.float64)
    design = torch.stack([torch.ones_like(xs), xs], 1)
    coef = torch.linalg.lstsq(design, ys.unsqueeze(1)).solution.squeeze(1)
    a, b = float(coef[0]), float(coef[1])
    worst = max(abs(a + b * float(x) - float(y)) / float(y) for x, y in zip(xs, ys))
    return {"a_mb": round(a, 1), "b_kib_per_token": round(b * 1024, 3), "b_mb_per_token": b,
            "max_rel_err": round(worst, 4), "points": len(rows)}


def run(args, keep: Callable[[Dict, Dict, Optional[Dict]], None]) -> None:
    """Every configuration of ``args``; each row goes to ``keep`` (row, its settings, its breakdown or None) as its
    processes end."""
    model = run_model(args)
    for attention in args.attention:
        for tiling in args.tiling:
            sizes = [n for n in args.sizes if attention == "dilated" or n <= args.dense_max]
            for n in sizes:
                for world in args.ranks:
                    cfg = {"model": model, "hybrid": args.hybrid, "n": n, "attention": attention, "tiling": tiling,
                           "layout": args.layout,
                           "threads": args.threads, "min_segment": args.min_segment,
                           "loss_chunk_rows": args.loss_chunk_rows, "parts": args.parts, "row_chunk_rows": args.row_chunk_rows,
                           "breakdown": args.breakdown == "all" or (args.breakdown == "largest" and n == sizes[-1])}
                    res = run_ranks(world, _step, cfg)
                    worst = max(res, key=lambda r: r["peak_mb"])
                    label = "+".join(args.parts) if tiling == "on" else "off"
                    row = {"n": n, "world": world, "attention": attention, "tiling": label,
                           "step_s": round(max(r["step_s"] for r in res), 2),
                           "peak_mb": round(worst["peak_mb"], 1),
                           "peak_above_base_mb": round(max(r["peak_above_base_mb"] for r in res), 1),
                           "base_mb": round(worst["base_mb"], 1), "breakdown": "yes" if cfg["breakdown"] else ""}
                    if args.hybrid:
                        slowest = max(res, key=lambda r: r["step_s"])
                        row["recurrent_s"] = round(slowest["recurrent_s"], 2)
                    print(format_table([row], list(row)), flush=True)
                    keep(row, worst["breakdown"] if cfg["breakdown"] else None)


def run_model(args) -> Dict:
    """The model config a run of ``args`` trains (for ``--hybrid`` the sizes :func:`bench.configs.hybrid_config`
    turns into the hybrid)."""
    return dict(MODEL, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)


def written_model(args) -> Dict:
    """What the file records as the model a run of ``args`` trained."""
    return dict(run_model(args), **HYBRID) if args.hybrid else run_model(args)


SETTINGS = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "min_segment", "layout",
            "loss_chunk_rows", "row_chunk_rows", "threads")
"""The options a row depends on; with :data:`OWN` they make its settings."""
OWN = ("n", "world", "attention", "tiling")
"""What tells the rows of one run apart."""


def breakdown_key(row: Dict) -> str:
    """The name of ``row``'s breakdown in the file's ``breakdowns``."""
    return f"{row['attention']} tiling={row['tiling']} n={row['n']} p={row['world']}"


def derive(payload: Dict) -> Dict:
    """What scale.json makes from all its rows: their order (by group, length, ranks), each group's fit, and the
    breakdowns of the rows that have one (a row run again without one takes its old breakdown with it)."""
    rows = sorted(payload["rows"], key=lambda r: (r["attention"], r["tiling"], r["n"], r["world"]))
    growth(rows)
    tracked = {breakdown_key(r) for r in rows if r["breakdown"] == "yes"}
    breakdowns = {k: v for k, v in payload.get("breakdowns", {}).items() if k in tracked}
    return {"rows": rows, "fits": fit_groups(rows), "breakdowns": breakdowns}


def growth(rows: List[Dict]) -> None:
    """Give each row after the shortest of its (attention, tiling, ranks) group the growth per doubling of n of its
    step time (and of its recurrent layers' time, where measured) from the row before it: (t / t_before) ** (1 /
    log2(n / n_before)); 2.0 is linear."""
    groups: Dict[Tuple, List[Dict]] = defaultdict(list)
    for r in rows:
        for key in ("step_growth", "recurrent_growth"):
            r.pop(key, None)
        groups[r["attention"], r["tiling"], r["world"]].append(r)
    for group in groups.values():
        group.sort(key=lambda r: r["n"])
        for before, r in zip(group, group[1:]):
            doublings = math.log2(r["n"] / before["n"])
            for key, out in (("step_s", "step_growth"), ("recurrent_s", "recurrent_growth")):
                if before.get(key) and r.get(key):
                    r[out] = round((r[key] / before[key]) ** (1 / doublings), 2)


_ROW = ("n", "world", "attention", "tiling", "step_s", "peak_mb", "peak_above_base_mb", "base_mb", "breakdown")
WRITES = {"scale": {"rows": _ROW + ("step_growth",) + RECORDED},
          "scale_hybrid": {"rows": _ROW + ("recurrent_s", "step_growth", "recurrent_growth") + RECORDED}}
"""Every field a row of scale.json (and of ``--hybrid``'s scale_hybrid.json) can hold (``bench tables --check``
holds the files to them)."""
BESIDE = {"scale": ("model", "fits", "breakdowns"), "scale_hybrid": ("model", "fits", "breakdowns")}
"""What the files hold beside their rows: the model of the last run, the fits, the breakdowns by row."""


def fit_groups(rows: List[Dict]) -> Dict[str, Dict]:
    """One fit per (attention, tiling) group that has at least two distinct n/p."""
    fits = {}
    for attention, tiling in sorted({(r["attention"], r["tiling"]) for r in rows}):
        group = [r for r in rows if r["attention"] == attention and r["tiling"] == tiling]
        if len({r["n"] / r["world"] for r in group}) >= 2:
            fits[f"{attention} tiling={tiling}"] = fit(group)
    return fits


def _plot(rows: List[Dict], fits: Dict[str, Dict]):
    def draw(path: str) -> None:
        import matplotlib.pyplot as plt

        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
        for key in sorted({(r["attention"], r["tiling"], r["world"]) for r in rows}):
            pts = sorted((r["n"], r["step_s"], r["peak_mb"]) for r in rows
                         if (r["attention"], r["tiling"], r["world"]) == key)
            ns = [p[0] for p in pts]
            label = f"{key[0]}, tiling {key[1]}, p={key[2]}"
            style = "--" if key[1] == "off" else "-"
            ax_t.plot(ns, [p[1] for p in pts], style, marker="o", label=label)
            line = ax_m.plot(ns, [p[2] / 1024 for p in pts], style, marker="o", label=label)[0]
            f = fits.get(f"{key[0]} tiling={key[1]}")
            if f:
                grid = [ns[0] * (ns[-1] / ns[0]) ** (i / 40) for i in range(41)] if len(ns) > 1 else ns
                ax_m.plot(grid, [(f["a_mb"] + f["b_mb_per_token"] * x / key[2]) / 1024 for x in grid], ":",
                          color=line.get_color(), linewidth=1)
        for ax in (ax_t, ax_m):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length n")
        ax_t.set_ylabel("training step seconds")
        ax_m.set_ylabel("peak resident GiB per rank (dotted: a + b·n/p)")
        ax_m.legend(fontsize=7)
        finish_figure(fig, path, "one training step, gradient checkpointing, fp32 (2 CPU cores shared)")

    return draw


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__)
    ap.add_argument("--hybrid", action="store_true",
                    help="train the Qwen3.5-like hybrid of bench hybrid (three gated delta rule layers to one attention "
                         "layer, repeated to --layers) instead of the Llama; its rows go to scale_hybrid.json")
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="default: 16K, 64K, 256K, 1M; with --hybrid 128K, 256K, 512K, 1M")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="default: 1 and 2; with --hybrid 2")
    ap.add_argument("--attention", nargs="+", choices=["dilated", "dense"], default=["dilated"])
    ap.add_argument("--tiling", nargs="+", choices=["on", "off"], default=["on"],
                    help="on: tile the --parts; off: the plain model (rows say which)")
    ap.add_argument("--parts", nargs="+", choices=["loss", "mlp", "norm"], default=["loss", "mlp", "norm"],
                    help="what --tiling on tiles")
    ap.add_argument("--dense-max", type=int, default=262144, help="longest n run with dense attention")
    ap.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"])
    ap.add_argument("--hidden", type=int, default=MODEL["hidden_size"])
    ap.add_argument("--intermediate", type=int, default=MODEL["intermediate_size"])
    ap.add_argument("--heads", type=int, default=MODEL["num_attention_heads"])
    ap.add_argument("--kv-heads", type=int, default=MODEL["num_key_value_heads"])
    ap.add_argument("--vocab", type=int, default=MODEL["vocab_size"])
    ap.add_argument("--min-segment", type=int, default=2048, help="shortest dilated segment")
    ap.add_argument("--layout", default="zigzag")
    ap.add_argument("--loss-chunk-rows", type=int, default=None)
    ap.add_argument("--row-chunk-rows", type=int, default=None, help="rows per chunk of the MLP and norms")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--breakdown", choices=["largest", "all", "none"], default="largest",
                    help="run the step under the live-tensor tracker at the largest n of each group")
    ap.add_argument("--out", default="bench_results",
                    help="where NAME.json goes; each row joins it in the place of the row run with the same settings")
    ap.add_argument("--name", default=None, help="output file stem (default: scale, or scale_hybrid with --hybrid)")
    add_replace_unrecorded(ap)
    args = ap.parse_args(argv)
    if args.sizes is None:
        args.sizes = [1 << 17, 1 << 18, 1 << 19, 1 << 20] if args.hybrid else [1 << 14, 1 << 16, 1 << 18, 1 << 20]
    if args.ranks is None:
        args.ranks = [2] if args.hybrid else [1, 2]
    kind = "scale_hybrid" if args.hybrid else "scale"
    args.name = args.name or kind
    sink = RowFile(args.out, args.name, WRITES[kind], vars(args), command_line("scale", argv), commit(ROOT),
                   keys={"rows": (SETTINGS, OWN)}, beside=BESIDE[kind],
                   replace_unrecorded=args.replace_unrecorded, derive=derive,
                   plot=lambda payload: _plot(payload["rows"], payload["fits"]))

    def keep(row: Dict, breakdown: Optional[Dict]) -> None:
        found = {"model": written_model(args)}
        if breakdown is not None:
            found["breakdowns"] = {breakdown_key(row): breakdown}
            print(f"\nlive tensors at their peak ({breakdown_key(row)}): {breakdown['peak_tracked_mb']} MB tracked")
            print(format_table(breakdown["by_label"], ["label", "mb", "tensors"]))
        sink.keep("rows", row, beside=found)

    run(args, keep)


if __name__ == "__main__":
    main()
