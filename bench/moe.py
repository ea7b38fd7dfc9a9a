"""``python -m bench moe``: a mixture of experts' training step with its router loss, one process against 2 ranks.

A Qwen3-MoE-like model (:data:`MOE`: the benchmarks' Llama sizes, 8 experts,
top-2, 4 layers), random weights in fp32, one row of ``--n`` tokens; each
configuration runs in fresh one-thread processes, one untimed step at the size,
then ``--repeats`` timed steps (forward and backward of the loss), in each of
``--rounds`` interleaved rounds. The router loss (``output_router_logits``,
coefficient 0.02) is on or off; on 2 ranks it is computed over the whole
sequence (:mod:`hf_ring.patches.router_loss`). A row holds the median step of
the slowest rank and its peak memory per rank, and the ratios measured side by
side: with the router loss against without on the same ranks (the cost of the
term and its all-reduce), and 2 ranks against one process.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Dict, List

import torch

from .common import command_line, format_table, ratio_range, run_ranks, save, split_for, timed_steps, token_row
from .configs import MODEL

MOE = dict(MODEL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, decoder_sparse_step=1,
           mlp_only_layers=[], norm_topk_prob=True, router_aux_loss_coef=0.02, use_sliding_window=False)
"""The benchmarks' Llama sizes as a Qwen3-MoE: 8 experts of width 256, two per token, in every layer."""
CONFIGS = (("sdpa", 1, False), ("sdpa", 1, True), ("ring_dilated", 2, False), ("ring_dilated", 2, True))
"""(attention, ranks, router loss on)."""

TABLES = {
    "moe": (("n", "tokens"), ("ranks", "ranks"), ("router_loss", "router loss"), ("step_s", "step s"),
            ("step_spread", "spread"), ("router_over_without", "with / without router loss"),
            ("router_over_without_spread", "spread"), ("over_one_process", "vs one process"),
            ("peak_mb", "peak MB per rank"), ("repeats", "steps")),
}
"""The columns of this benchmark's table in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def _model(attn: str, router: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**MOE, output_router_logits=router)
    return Qwen3MoeForCausalLM._from_config(config, attn_implementation=attn).train()


def measure(attn: str, router: bool, n: int, repeats: int) -> Dict:
    """One rank's step times and peak memory (fn of :func:`run_ranks`)."""
    with split_for(attn) as (_, split):
        model = _model(attn, router)

        return timed_steps(model, split, token_row(MOE["vocab_size"], 512), token_row(MOE["vocab_size"], n), repeats)


def rows_for(n: int, repeats: int, rounds: int) -> List[Dict]:
    found: Dict = {cfg: [] for cfg in CONFIGS}
    for _ in range(rounds):  # interleaved, so drift of the machine falls on every configuration alike
        for attn, world, router in CONFIGS:
            found[attn, world, router].append(run_ranks(world, measure, attn, router, n, repeats))
    stats = {}
    for cfg, runs in found.items():
        steps = [max(times) for ranks in runs for times in zip(*(r["steps"] for r in ranks))]
        stats[cfg] = {"step": statistics.median(steps), "peak": max(r["peak_mb"] for ranks in runs for r in ranks),
                      "repeats": len(steps), "steps": steps}
    rows = []
    for (attn, world, router), s in stats.items():
        without = stats[attn, world, False]
        row = {"n": n, "ranks": world, "router_loss": router, "step_s": round(s["step"], 3),
               "step_spread": f"{min(s['steps']):.3g}-{max(s['steps']):.3g}",
               "router_over_without": round(s["step"] / without["step"], 3),
               # step by step: the configurations with and without the term ran one after the other in a round
               "router_over_without_spread": ratio_range(s["steps"], without["steps"]),
               "over_one_process": round(s["step"] / stats["sdpa", 1, router]["step"], 3),
               "peak_mb": round(s["peak"], 1), "repeats": s["repeats"]}
        rows.append(row)
        print(format_table([row], list(row)), flush=True)
    return rows


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench moe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384, help="tokens of the row")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per configuration and round")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the configurations")
    ap.add_argument("--out", default="bench_results", help="where the JSON goes (default bench_results)")
    args = ap.parse_args(argv)
    rows = rows_for(args.n, args.repeats, args.rounds)
    save(args.out, "moe", {"config": vars(args), "model": MOE, "rows": rows}, command=command_line("moe", argv))
    print("\n" + format_table(rows, [k for k, _ in TABLES["moe"]]))
