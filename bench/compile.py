"""``python -m bench compile``: one training step of a ``torch.compile``-d model against the same model eager.

The scale benchmark's Llama (4 layers, hidden 256, fp32) with ``ring_dilated``,
in one process and with the sequence split over 2 gloo ranks (``shard_batch``),
one thread per rank. The eager and the compiled model share their weights and
alternate step by step after one untimed step each (the compiled one's first
step compiles, and is reported apart); the table gives the median step of
each, their ratio and the spread of the pairwise ratios. hf_ring's attention,
mask hook, tiled loss and rows stay outside the graph on purpose
(``torch.compiler.disable``: they hold collectives and host-side plans), so
compiling speeds up the rest of the model: projections, MLPs, norms, RoPE.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import torch

from .common import command_line, format_table, run_ranks, save
from .configs import MODEL

TABLES = {
    "compile": (("n", "n"), ("world", "ranks"), ("eager_step_s", "eager step s"),
                ("compiled_step_s", "compiled step s"), ("compiled_over_eager", "compiled / eager"),
                ("pairwise_ratio_spread", "spread of step-by-step ratios"),
                ("first_compiled_step_s", "first compiled step s"), ("repeats", "steps"), ("torch", "torch")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def steps(n: int, repeats: int) -> Dict:
    """Seconds of ``repeats`` steps of the eager and the compiled model (alternating, after one step each), and
    of the compiled model's first step."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_ring

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        hf_ring.setup_sequence_parallel(None)
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL), attn_implementation="ring_dilated",
                                                 dtype=torch.float32).train()
        compiled = torch.compile(model)
        ids = torch.randint(0, MODEL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
        batch = hf_ring.shard_batch({"input_ids": ids, "labels": ids}) if world > 1 else {"input_ids": ids,
                                                                                          "labels": ids}

        def step(which) -> float:
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            which(**batch).loss.backward()
            elapsed = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            return elapsed

        first = step(compiled)
        step(model)
        times: Dict[str, List[float]] = {"eager": [], "compiled": []}
        for _ in range(repeats):
            times["eager"].append(step(model))
            times["compiled"].append(step(compiled))
        return {"times": times, "first_compiled_s": first}
    finally:
        hf_ring.clear_sequence_parallel()


def run(sizes: List[int], worlds: List[int], repeats: int) -> List[Dict]:
    rows = []
    for world in worlds:
        for n in sizes:
            results = run_ranks(world, steps, n, repeats, exact_peak=False)
            # a step of the group lasts as long as its slowest rank
            eager = [max(r["times"]["eager"][i] for r in results) for i in range(repeats)]
            comp = [max(r["times"]["compiled"][i] for r in results) for i in range(repeats)]
            ratios = sorted(c / e for c, e in zip(comp, eager))
            rows.append({"n": n, "world": world, "eager_step_s": round(statistics.median(eager), 3),
                         "compiled_step_s": round(statistics.median(comp), 3),
                         "compiled_over_eager": round(statistics.median(comp) / statistics.median(eager), 3),
                         "pairwise_ratio_spread": f"{ratios[0]:.3f}-{ratios[-1]:.3f}",
                         "first_compiled_step_s": round(max(r["first_compiled_s"] for r in results), 1),
                         "repeats": repeats, "torch": torch.__version__})
            print(format_table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench compile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="ranks the sequence is split over")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps of each, after one untimed step each")
    ap.add_argument("--out", default="bench_results", help="where the JSON goes (default bench_results)")
    args = ap.parse_args(argv)
    command = command_line("compile", argv)
    rows = run(args.sizes, args.worlds, args.repeats)
    print("\n" + format_table(rows, list(rows[0])))
    save(args.out, "compile", {"config": vars(args), "model": MODEL, "rows": rows}, command=command)
