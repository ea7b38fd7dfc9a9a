"""``python -m bench generate``: long-prompt generation on 1 and 2 ranks.

A small random Llama (built from a config in every process, same seed) reads
a prompt of each length and generates ``--new-tokens`` greedy tokens with
:func:`hf_ring.generate`; transformers' own ``generate`` with SDPA and its
dynamic cache runs alongside as the single-process reference. Reported per
configuration: prefill time (and its ratio to one process), decode tokens/s,
the KV cache bytes each rank holds, the resident-set peak per rank, and
whether the tokens equal the reference's. Every configuration runs one
untimed warm-up call of the same size and then ``--repeats`` timed calls
(median reported, spread beside it, each call counted at its slowest rank).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import torch

from hf_ring.generation.cache import cache_nbytes
from hf_ring.integration.seams import CACHE_KEYWORD
from .common import (clock, command_line, finish_figure, format_table, peak_rss_mb, rss_mb, run_ranks, save, spread, summary, timed)
from .hybrid import generate_file

MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1 << 20, attention_dropout=0.0,
             tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)

TABLES = {
    "generate": (("n", "prompt"), ("world", "ranks"), ("prefill_s", "prefill s"), ("prefill_ratio", "prefill / 1 rank"),
                 ("decode_tok_s", "decode tok/s"), ("decode_spread", "spread"), ("decode_speedup", "decode / 1 rank"),
                 ("cache_mb_per_rank", "KV cache MiB per rank"), ("peak_mb_per_rank", "peak MB per rank"),
                 ("sdpa_decode_tok_s", "SDPA generate tok/s"), ("same_tokens_as_sdpa", "tokens = SDPA's")),
    "generate_evict": (("model", "model"), ("n", "prompt"), ("world", "ranks"),
                       ("cache_mb_kept", "cache MiB per rank, every row"),
                       ("cache_mb_evicted", "cache MiB per rank, evicting"), ("cache_ratio", "cache ratio"),
                       ("decode_tok_s_kept", "decode tok/s, every row"), ("decode_tok_s_evicted", "decode tok/s, evicting"),
                       ("decode_ratio", "decode ratio"), ("same_tokens", "same tokens")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""

WRITES = {
    "generate": {"rows": (
        "n", "world", "layout", "prefill_s", "prefill_spread", "prefill_ratio", "decode_tok_s", "decode_spread",
        "decode_speedup", "cache_mb_per_rank", "cache_ratio", "peak_mb_per_rank", "same_tokens", "repeats",
        "decode_ms_per_token_parts", "merge_allgather_alone_ms", "merge_arithmetic_alone_ms", "sdpa_prefill_s",
        "sdpa_decode_tok_s", "sdpa_cache_mb", "same_tokens_as_sdpa")},
    "generate_evict": {"rows": (
        "model", "n", "world", "layout", "cache_mb_kept", "cache_mb_evicted", "cache_ratio", "decode_tok_s_kept",
        "decode_tok_s_evicted", "decode_ratio", "decode_spread_kept", "decode_spread_evicted", "prefill_s_kept",
        "prefill_s_evicted", "same_tokens", "repeats")},
}
"""Every field a row of this benchmark's files can hold (``bench tables --check`` holds the files to them)."""
BESIDE = {"generate": ("config", "model"), "generate_evict": ("config", "models", "pattern")}
"""What each file holds beside its rows (and the stamps every file has)."""


MERGE_EXCHANGE = "of it the all-gather (posting and waiting)"


def _clock_merge_exchange(spent: Dict[str, float], seen: List) -> None:
    """Time the decode merge's all-gather apart from the merge's own arithmetic; ``seen`` gets its ring and row."""
    from hf_ring.engine.comm import RingComm
    from hf_ring.engine.decode import MERGE_WHAT

    inner = RingComm.all_gather

    def timed_all_gather(self, tensor, what):
        t0 = time.perf_counter()
        try:
            return inner(self, tensor, what)
        finally:
            if what == MERGE_WHAT:
                spent[MERGE_EXCHANGE] = spent.get(MERGE_EXCHANGE, 0.0) + time.perf_counter() - t0
                seen[:] = [self, tensor]

    RingComm.all_gather = timed_all_gather


def _exchange_alone(seen: List, calls: int = 300) -> List[float]:
    """The merge's all-gather of the same row with nothing around it, ``calls`` times back to back after one
    untimed call: its floor on this machine and backend (milliseconds per call)."""
    if not seen:
        return []
    comm, row = seen
    return [1e3 * t for t in timed(lambda: comm.all_gather(row, "the decode merge's exchange alone"), calls)]


class _Copies:
    """A stand-in for the ranks that hands back this rank's row once per rank, at no exchange's cost."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def all_gather(self, tensor, what):
        return tensor.unsqueeze(0).expand(self.world_size, *tensor.shape).clone()


def _arithmetic_alone(partials: List, world_size: int, calls: int = 300) -> List[float]:
    """The merge's own work on the last layer's partials (its all-gather a local copy), ``calls`` times back to
    back: milliseconds per call."""
    from hf_ring.engine.decode import merge_ranks

    if not partials:
        return []
    out, lse = partials
    return [1e3 * t for t in timed(lambda: merge_ranks(out, lse, _Copies(world_size)), calls)]


def _measure(impl: str, n: int, new_tokens: int, layout: str, repeats: int, broadcast_logits: bool) -> Dict:
    """Generate calls on this rank: forward start times give prefill and per-token decode time."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_ring
    from hf_ring.generation import step

    spent: Dict[str, float] = {}  # clocked during the timed runs: microseconds against milliseconds
    clock(step, "cached_attention", "attention over the local cache", spent)
    clock(step, "merge_ranks", "merging partials (exchange and waits included)", spent)
    seen: List = []
    _clock_merge_exchange(spent, seen)
    partials: List = []  # the last merge's own partials, for its arithmetic alone
    merge = step.merge_ranks

    def keep_partials(out, lse, *args, **kwargs):
        partials[:] = [out, lse]
        return merge(out, lse, *args, **kwargs)

    step.merge_ranks = keep_partials
    base = rss_mb()
    if dist.is_initialized():
        hf_ring.setup_sequence_parallel(None, layout=layout)
    torch.manual_seed(0)
    attn = "sdpa" if impl == "sdpa" else "ring_dilated"
    model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL), attn_implementation=attn, dtype=torch.float32)
    model.eval()
    hf_ring.configure(model, layout=layout)
    # Token 0 is the pad token: keep it out of the prompt, or generate would infer padding and mask it.
    ids = torch.randint(1, MODEL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True)
    if impl == "ring":
        kw["broadcast_logits"] = broadcast_logits
    prefill, decode, parts = [], [], []
    for _ in range(1 + repeats):  # the first call is the untimed warm-up
        starts: List[float] = []
        spent.clear()
        hook = model.register_forward_pre_hook(lambda m, a: starts.append(time.perf_counter()))
        if dist.is_initialized():
            dist.barrier()
        with torch.no_grad():
            out = hf_ring.generate(model, ids, **kw) if impl == "ring" else model.generate(ids, **kw)
        starts.append(time.perf_counter())
        hook.remove()
        prefill.append(starts[1] - starts[0])
        steps = len(starts) - 2  # forwards after the prefill
        decode.append((starts[-1] - starts[1]) / steps)  # seconds per decoded token
        parts.append({k: v / steps for k, v in spent.items()})
    alone = _exchange_alone(seen)
    arithmetic = _arithmetic_alone(partials, dist.get_world_size()) if alone else []
    hf_ring.clear_sequence_parallel()
    return {"prefill_runs": prefill[1:], "decode_s_runs": decode[1:], "decode_parts": parts[1:], "alone_ms": alone,
            "arithmetic_ms": arithmetic,
            "cache_mb": cache_nbytes(getattr(out, CACHE_KEYWORD)) / 2**20, "peak_mb": peak_rss_mb() - base,
            "tokens": out.sequences[0, n:].tolist()}


EVICT_MODELS: Dict[str, Dict] = {
    # Gemma 3's layer mix: five sliding-window layers (window 1024) for every global one.
    "gemma3": dict(family="gemma3_text", config=dict(
        MODEL, num_hidden_layers=6, head_dim=64, query_pre_attn_scalar=64, sliding_window=1024,
        layer_types=["sliding_attention"] * 5 + ["full_attention"])),
    # The README's dilated pattern on the 2-layer Llama, one and four query heads per K/V head.
    "dilated1": dict(family="llama", config=dict(MODEL, num_attention_heads=4, num_key_value_heads=4), dilated=True),
    "dilated4": dict(family="llama", config=dict(MODEL, num_attention_heads=8, num_key_value_heads=2, head_dim=32),
                     dilated=True),
}
"""The configurations ``--evict`` compares with the sharded cache evicting and keeping every row."""
DILATED_PATTERN = {"segment_lengths": [2048, 4096, 8192, 16384, 32768, 65536], "dilation_rates": [1, 2, 4, 8, 16, 32]}
EVICT_LABELS = {"gemma3": "Gemma-3-like (5 window-1024 : 1 full, 6 layers)",
                "dilated1": "dilated, Hq/Hkv = 1 (4/4 heads)", "dilated4": "dilated, Hq/Hkv = 4 (8/2 heads)"}


def _measure_evict(name: str, n: int, new_tokens: int, layout: str, repeats: int) -> Dict:
    """On this rank, the same generate calls with the sharded cache evicting and keeping every row, interleaved.

    Each call: prefill time, seconds per decoded token, and the most K/V
    bytes the cache held after any forward of the call.
    """
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_ring

    spec = EVICT_MODELS[name]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world > 1:
        hf_ring.setup_sequence_parallel(None, layout=layout)
    torch.manual_seed(0)
    config = AutoConfig.for_model(spec["family"], **spec["config"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated", dtype=torch.float32).eval()
    hf_ring.configure(model, pattern=DILATED_PATTERN if spec.get("dilated") else None, layout=layout)
    ids = torch.randint(1, MODEL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True)
    runs: Dict[bool, Dict[str, List]] = {e: {"prefill": [], "decode": [], "cache": [], "tokens": []} for e in (False, True)}
    for i in range(1 + repeats):  # the first round is the untimed warm-up
        for evict in (False, True):
            cache = hf_ring.ShardedCache(rank, world, layout, evict=evict)
            starts: List[float] = []
            held: List[int] = []
            pre = model.register_forward_pre_hook(lambda m, a: starts.append(time.perf_counter()))
            post = model.register_forward_hook(lambda m, a, o: held.append(cache.nbytes()))
            if dist.is_initialized():
                dist.barrier()
            with torch.no_grad():
                out = hf_ring.generate(model, ids, past_key_values=cache, **kw)
            starts.append(time.perf_counter())
            pre.remove()
            post.remove()
            if i:
                run = runs[evict]
                run["prefill"].append(starts[1] - starts[0])
                run["decode"].append((starts[-1] - starts[1]) / (len(starts) - 2))
                run["cache"].append(max(held) / 2**20)
                run["tokens"] = out.sequences[0, n:].tolist()
    if world > 1:
        hf_ring.clear_sequence_parallel()
    return {str(e): r for e, r in runs.items()}


def run_evict(names: List[str], sizes: List[int], new_tokens: int, layout: str, repeats: int) -> List[Dict]:
    rows = []
    for name in names:
        for n in sizes:
            for world in (1, 2):
                res = run_ranks(world, _measure_evict, name, n, new_tokens, layout, repeats, exact_peak=False)
                got = {}
                for evict in (False, True):
                    per_rank = [r[str(evict)] for r in res]
                    decode = summary([r["decode"] for r in per_rank])
                    got[evict] = {"prefill": summary([r["prefill"] for r in per_rank])["median"],
                                  "tok_s": 1 / decode["median"], "spread": f"{1 / decode['max']:.3g}-{1 / decode['min']:.3g}",
                                  "cache": max(max(r["cache"]) for r in per_rank), "tokens": per_rank[0]["tokens"],
                                  "same": all(r["tokens"] == per_rank[0]["tokens"] for r in per_rank)}
                off, on = got[False], got[True]
                row = {"model": EVICT_LABELS[name], "n": n, "world": world, "layout": layout if world > 1 else "-",
                       "cache_mb_kept": round(off["cache"], 2), "cache_mb_evicted": round(on["cache"], 2),
                       "cache_ratio": round(on["cache"] / off["cache"], 3),
                       "decode_tok_s_kept": round(off["tok_s"], 1), "decode_tok_s_evicted": round(on["tok_s"], 1),
                       "decode_ratio": round(on["tok_s"] / off["tok_s"], 3),
                       "decode_spread_kept": off["spread"], "decode_spread_evicted": on["spread"],
                       "prefill_s_kept": round(off["prefill"], 2), "prefill_s_evicted": round(on["prefill"], 2),
                       "same_tokens": off["same"] and on["same"] and off["tokens"] == on["tokens"],
                       "repeats": repeats}
                rows.append(row)
                print(format_table([row], list(row)), flush=True)
    return rows


def _decode_parts(res: List[Dict], decode_s: float) -> List[Dict[str, float]]:
    """Per rank, milliseconds per decoded token in each clocked part (median over the runs) and the rest."""
    out = []
    for r in res:
        labels = sorted({k for run in r["decode_parts"] for k in run})
        ms = {k: 1e3 * statistics.median(run.get(k, 0.0) for run in r["decode_parts"]) for k in labels}
        ms["rest of the model and generate"] = 1e3 * decode_s - sum(v for k, v in ms.items() if k != MERGE_EXCHANGE)
        out.append({k: round(v, 2) for k, v in ms.items()})
    return out


def _summarise(res: List[Dict]) -> Dict:
    prefill, decode = summary([r["prefill_runs"] for r in res]), summary([r["decode_s_runs"] for r in res])
    return {"prefill": prefill, "decode_tok_s": 1 / decode["median"],
            "decode_spread": f"{1 / decode['max']:.3g}-{1 / decode['min']:.3g}",
            "cache_mb": max(r["cache_mb"] for r in res), "peak_mb": max(r["peak_mb"] for r in res),
            "tokens": res[0]["tokens"], "same_on_ranks": all(r["tokens"] == res[0]["tokens"] for r in res),
            "decode_ms_parts": _decode_parts(res, decode["median"]),
            "alone": [round(statistics.median(r["alone_ms"]), 3) for r in res if r["alone_ms"]],
            "alone_mean": [round(statistics.mean(r["alone_ms"]), 3) for r in res if r["alone_ms"]],
            "arithmetic": [round(statistics.median(r["arithmetic_ms"]), 3) for r in res if r["arithmetic_ms"]]}


def run(sizes: List[int], new_tokens: int, layout: str, reference: bool, repeats: int,
        broadcast_logits: bool) -> List[Dict]:
    rows = []
    for n in sizes:
        ref = _summarise(run_ranks(1, _measure, "sdpa", n, new_tokens, layout, repeats, False, exact_peak=False)
                         ) if reference else None
        one = None
        for world in (1, 2):
            # Timed with the allocator's defaults, as a launched job runs; the peak in a run of its own (the
            # warm-up call alone) under the fixed mmap threshold that makes the resident-set peak follow live tensors.
            got = _summarise(run_ranks(world, _measure, "ring", n, new_tokens, layout, repeats, broadcast_logits,
                                       exact_peak=False))
            got["peak_mb"] = max(r["peak_mb"] for r in run_ranks(world, _measure, "ring", n, new_tokens, layout, 0,
                                                                  broadcast_logits))
            one = one or got
            row = {
                "n": n, "world": world, "layout": layout if world > 1 else "-",
                "prefill_s": round(got["prefill"]["median"], 3), "prefill_spread": spread(got["prefill"]),
                "prefill_ratio": round(got["prefill"]["median"] / one["prefill"]["median"], 3),
                "decode_tok_s": round(got["decode_tok_s"], 1), "decode_spread": got["decode_spread"],
                "decode_speedup": round(got["decode_tok_s"] / one["decode_tok_s"], 3),
                "cache_mb_per_rank": round(got["cache_mb"], 2),
                "cache_ratio": round(got["cache_mb"] / one["cache_mb"], 3),
                "peak_mb_per_rank": round(got["peak_mb"], 1),
                "same_tokens": got["same_on_ranks"] and got["tokens"] == one["tokens"],
                "repeats": got["prefill"]["runs"], "decode_ms_per_token_parts": got["decode_ms_parts"],
            }
            if got["alone"]:  # per rank, 300 calls back to back: the same all-gather (median, mean), and the
                # merge's own arithmetic with a local copy for the all-gather (median)
                row["merge_allgather_alone_ms"] = {"median": got["alone"], "mean": got["alone_mean"]}
                row["merge_arithmetic_alone_ms"] = got["arithmetic"]
            if ref is not None:
                row.update({
                    "sdpa_prefill_s": round(ref["prefill"]["median"], 3), "sdpa_decode_tok_s": round(ref["decode_tok_s"], 1),
                    "sdpa_cache_mb": round(ref["cache_mb"], 2), "same_tokens_as_sdpa": got["tokens"] == ref["tokens"],
                })
            rows.append(row)
            print(format_table(rows[-1:], [c for c in rows[-1] if c not in (
                "decode_ms_per_token_parts", "merge_allgather_alone_ms", "merge_arithmetic_alone_ms")]), flush=True)
            for rank, ms in enumerate(row["decode_ms_per_token_parts"]):
                print(f"  rank {rank}, ms per decoded token: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()),
                      flush=True)
            if "merge_allgather_alone_ms" in row:
                print(f"  the merge's all-gather alone, ms: {row['merge_allgather_alone_ms']}; its arithmetic "
                      f"alone, ms: {row['merge_arithmetic_alone_ms']}", flush=True)
    return rows


def _plot(rows: List[Dict]):
    def draw(path: str) -> None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        panels = ((axes[0], "prefill_s", "prefill time (s)"), (axes[1], "decode_tok_s", "decode tokens/s"),
                  (axes[2], "cache_mb_per_rank", "KV cache per rank (MiB)"))
        for ax, key, title in panels:
            for world in sorted({r["world"] for r in rows}):
                pts = [(r["n"], r[key]) for r in rows if r["world"] == world]
                ax.plot(*zip(*pts), marker="o", label=f"hf_ring.generate, p={world}")
            if key != "cache_mb_per_rank" and "sdpa_prefill_s" in rows[0]:
                pts = sorted({(r["n"], r[f"sdpa_{key}"]) for r in rows})
                ax.plot(*zip(*pts), marker="x", ls="--", color="gray", label="model.generate, SDPA")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt length")
            ax.set_title(title)
            ax.legend()
        finish_figure(fig, path, "generation, 2-layer Llama (H=4, Hkv=2, D=64, fp32), greedy")

    return draw


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench generate", description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="default: 8K to 64K; with --hybrid 64K and 256K")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    ap.add_argument("--no-reference", action="store_true", help="skip the single-process SDPA generate")
    ap.add_argument("--repeats", type=int, default=2, help="timed generate calls per configuration, after one warm-up")
    ap.add_argument("--broadcast-logits", action="store_true", help="hf_ring.generate(broadcast_logits=True)")
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--evict", nargs="+", choices=sorted(EVICT_MODELS), metavar="MODEL",
                    help="instead: compare the sharded cache evicting and keeping every row, in the same runs, for "
                         f"these configurations ({', '.join(sorted(EVICT_MODELS))}); saved as generate_evict")
    ap.add_argument("--hybrid", action="store_true",
                    help="instead: the Qwen3.5-like hybrid of bench hybrid (its attention layer on the linear dilated "
                         "pattern) on 2 ranks and in one process: time to first token and decode tokens/s "
                         "(--sizes default 64K and 256K; saved as generate_hybrid)")
    ap.add_argument("--one-process-max", type=int, default=1 << 18,
                    help="with --hybrid: the longest prompt also run in one process")
    args = ap.parse_args(argv)
    args.sizes = args.sizes or ([1 << 16, 1 << 18] if args.hybrid else [8192, 16384, 32768, 65536])
    command = command_line("generate", argv)
    if args.hybrid:
        generate_file(args, command)
        return
    if args.evict:
        rows = run_evict(args.evict, args.sizes, args.new_tokens, args.layout, args.repeats)
        cols = ["model", "n", "world", "cache_mb_kept", "cache_mb_evicted", "cache_ratio", "decode_tok_s_kept",
                "decode_tok_s_evicted", "decode_ratio", "prefill_s_kept", "prefill_s_evicted", "same_tokens"]
        print("\n" + format_table(rows, cols))
        save(args.out, "generate_evict", {"config": vars(args), "models": EVICT_MODELS,
                                          "pattern": DILATED_PATTERN, "rows": rows}, command=command)
        return
    rows = run(args.sizes, args.new_tokens, args.layout, not args.no_reference, args.repeats, args.broadcast_logits)
    cols = ["n", "world", "layout", "prefill_s", "prefill_spread", "prefill_ratio", "decode_tok_s", "decode_spread",
            "decode_speedup", "cache_mb_per_rank", "cache_ratio", "peak_mb_per_rank", "same_tokens"]
    if not args.no_reference:
        cols += ["sdpa_prefill_s", "sdpa_decode_tok_s", "same_tokens_as_sdpa"]
    print("\n" + format_table(rows, cols))
    save(args.out, "generate", {"config": vars(args), "model": MODEL, "rows": rows}, _plot(rows), command=command)
