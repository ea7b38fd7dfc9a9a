"""``python -m hf_ring.bench tables``: the documentation's benchmark tables, rendered from the benchmarks' JSON.

Each table sits in the page that shows it (README.md or a page of docs/)
between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; ``--write``
replaces what is there with the rows of ``DIR/NAME.json`` (as
``python -m hf_ring.bench NAME --out DIR`` wrote it), in every page that has
the markers, so the figures shown are the ones the benchmarks measured.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
from typing import Dict, List, Sequence, Tuple

Column = Tuple[str, str]  # (JSON key, header)

COLUMNS: Dict[str, Sequence[Column]] = {
    "ring": (("n", "n"), ("impl", "impl"), ("world", "ranks"), ("layout", "layout"),
             ("fwd_bwd_s", "fwd+bwd s (median)"), ("fwd_bwd_spread", "spread"),
             ("speedup_over_1_rank", "speed-up over 1 rank"), ("fwd_bwd_ratio", "fwd+bwd / SDPA"),
             ("fwd_ratio", "fwd / SDPA"), ("peak_mb_per_rank", "peak MB per rank"),
             ("peak_ratio_to_1_rank", "peak / 1 rank"), ("sent_mb", "MB sent per rank"),
             ("planned_sent_mb", "MB planned")),
    "ring_wire": (("world", "ranks"), ("mode", "mode"), ("ulysses_size", "ulysses_size"),
                  ("mb_per_layer_per_rank", "MiB sent per layer per rank"), ("over_ring", "/ ring")),
    "dilated": (("n", "n"), ("world", "ranks"), ("layout", "layout"), ("fwd_s", "fwd s"),
                ("fwd_bwd_s", "fwd+bwd s"), ("fwd_bwd_spread", "spread"), ("dense_fwd_bwd_s", "dense SDPA fwd+bwd s"),
                ("speedup_fwd_bwd", "speed-up over dense"), ("sent_mb", "MB sent per rank"),
                ("unshared_sent_mb", "MB if each branch sent its own rows"), ("dense_ring_sent_mb", "dense ring MB"),
                ("peak_mb", "peak MB per rank")),
    "generate": (("n", "prompt"), ("world", "ranks"), ("prefill_s", "prefill s"), ("prefill_ratio", "prefill / 1 rank"),
                 ("decode_tok_s", "decode tok/s"), ("decode_spread", "spread"), ("decode_speedup", "decode / 1 rank"),
                 ("cache_mb_per_rank", "KV cache MiB per rank"), ("peak_mb_per_rank", "peak MB per rank"),
                 ("sdpa_decode_tok_s", "SDPA generate tok/s"), ("same_tokens_as_sdpa", "tokens = SDPA's")),
    "generate_evict": (("model", "model"), ("n", "prompt"), ("world", "ranks"),
                       ("cache_mb_kept", "cache MiB per rank, every row"),
                       ("cache_mb_evicted", "cache MiB per rank, evicting"), ("cache_ratio", "cache ratio"),
                       ("decode_tok_s_kept", "decode tok/s, every row"), ("decode_tok_s_evicted", "decode tok/s, evicting"),
                       ("decode_ratio", "decode ratio"), ("same_tokens", "same tokens")),
    "model": (("n", "n"), ("checkpointing", "checkpointing"), ("sdpa_step_s", "sdpa step s"),
              ("ring_step_s", "ring_dilated step s"), ("ring_over_sdpa", "ring_dilated / sdpa"),
              ("pairwise_ratio_spread", "spread of step-by-step ratios")),
    "gpu_routes": (("block", "block"), ("dtype", "dtype"), ("kernel", "kernel (forward and backward)"),
                   ("checked", "checked"), ("checked_on", "checked on")),
    "gpu_exact": (("block", "block"), ("dtype", "dtype"), ("n", "n"), ("worst_rel_err", "worst relative error"),
                  ("worst_tensor", "in"), ("within", "within tolerance"), ("tolerance", "tolerance")),
    "gpu_speed": (("n", "n"), ("impl", "impl"), ("fwd_ms", "fwd ms"), ("fwd_bwd_ms", "fwd+bwd ms"),
                  ("fwd_over_sdpa", "fwd / SDPA"), ("fwd_bwd_over_sdpa", "fwd+bwd / SDPA"), ("peak_mb", "peak MiB"),
                  ("peak_over_sdpa", "peak / SDPA")),
    "gpu_model": (("n", "n"), ("checkpointing", "checkpointing"), ("offload", "offloaded inputs"),
                  ("sdpa_step_s", "sdpa step s"), ("ring_step_s", "ring_dilated step s"),
                  ("ring_over_sdpa", "ring_dilated / sdpa"), ("ring_peak_mb", "ring_dilated peak MiB")),
    "gpu_nccl": (("n", "n"), ("ranks", "ranks"), ("backend", "backend"), ("fwd_bwd_s_1", "fwd+bwd s, 1 GPU"),
                 ("fwd_bwd_s_2", "fwd+bwd s, 2 GPUs"), ("speedup", "speed-up"), ("max_rel_err_fp32", "fp32 error"),
                 ("killed_peer", "a killed peer raises"), ("raised_after_s", "after s"), ("timeout_s", "timeout s")),
    "scale": (("n", "n"), ("world", "ranks"), ("attention", "attention"), ("tiling", "tiled"), ("step_s", "step s"),
              ("peak_mb", "peak MB per rank"), ("fit_mb", "fit MB"), ("fit_off", "fit off by")),
}


def _cell(value) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def render(name: str, payload: Dict) -> str:
    """The markdown table of one benchmark's JSON."""
    rows: List[Dict] = [dict(r) for r in payload["rows"]]
    if name == "scale":
        for r in rows:
            f = payload.get("fits", {}).get(f"{r['attention']} tiling={r['tiling']}")
            if f:
                pred = f["a_mb"] + f["b_mb_per_token"] * r["n"] / r["world"]
                r["fit_mb"], r["fit_off"] = round(pred), f"{100 * (r['peak_mb'] - pred) / pred:+.1f}%"
    cols = [(k, h) for k, h in COLUMNS[name] if any(k in r for r in rows)]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k, _ in cols) + " |" for r in rows]
    if name == "scale":
        for key, f in payload.get("fits", {}).items():
            lines.append("")
            lines.append(f"Fit ({key}): peak MB per rank = {f['a_mb']} + {f['b_kib_per_token']} KiB × n/p "
                         f"(worst point off by {100 * f['max_rel_err']:.1f}%, {f['points']} points).")
    return "\n".join(lines)


def rewrite(text: str, tables: Dict[str, str]) -> str:
    """``text`` with the content between each ``<!-- bench:NAME -->`` marker pair replaced."""
    for name, table in tables.items():
        pattern = re.compile(rf"(<!-- bench:{name} -->\n)(.*?)(<!-- /bench:{name} -->)", re.S)
        text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(3), text)
    return text


def pages(root: str = ".") -> List[str]:
    """The pages that may hold tables: README.md and docs/*.md."""
    return [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hf_ring.bench tables", description=__doc__)
    ap.add_argument("--dir", default="docs/bench", help="where the benchmarks' JSON files are")
    ap.add_argument("--root", default=".", help="the checkout whose README.md and docs/*.md get the tables")
    ap.add_argument("--write", action="store_true", help="rewrite the tables in the pages (else print them)")
    args = ap.parse_args(argv)
    tables = {}
    for name in COLUMNS:
        path = os.path.join(args.dir, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                tables[name] = render(name, json.load(f))
    if not args.write:
        for name, table in tables.items():
            print(f"{name}:\n{table}\n")
        return
    for page in pages(args.root):
        with open(page) as f:
            text = f.read()
        new = rewrite(text, tables)
        if new != text:
            with open(page, "w") as f:
                f.write(new)
            print(f"wrote the tables of {page}")
