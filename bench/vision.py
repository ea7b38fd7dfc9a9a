"""``python -m bench vision``: one long multimodal sample split over ranks, and the vision example's loss curve.

**Steps.** A small Llava (``examples/vision_sft.py``'s model: a CLIP tower,
a Llama language model) trains on one row of ``--n`` tokens, almost all of
them visual: frames of 16 tokens and a short question. ``sdpa`` in one process
is the baseline; ``ring_dilated`` runs on 1, 2 and 4 ranks (4 ranks share this
machine's cores when it has fewer). Each configuration's step is timed
``--repeats`` times after a warm-up (median and spread); the peak resident
memory is the busiest rank's, above its baseline. Every rank encodes every
frame (what hf_ring ships): "tower s" is the tower's forward and backward over
all the frames, timed alone on each rank, and "tower share" its part of the
step. "tower s, 1/p frames" times the tower over one rank's share of the
frames: what each rank would spend if the frames were split too.

**Loss curve.** ``examples/vision_sft.py`` launched as its docstring does, in one
process and on 2 ranks, with the same seed and steps, for each of ``--seeds``:
every step's loss, the largest relative difference between the two curves, and
the held-out token accuracy each run reaches.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from typing import Dict, List

import torch

from .common import command_line, format_table, peak_rss_mb, rss_mb, run_ranks, save, split_for, timed
from .quality import launch

EXAMPLE = os.path.join("examples", "vision_sft.py")
FRAME_TOKENS = 16
QUESTION = 48

TABLES = {
    "vision": (("attn", "attention"), ("ranks", "ranks"), ("n", "tokens"), ("frames", "frames"),
                     ("step_s", "step s"), ("step_spread", "spread"), ("over_sdpa", "/ sdpa"),
                     ("peak_mb", "peak MiB per rank"), ("tower_s", "tower s"), ("tower_share", "tower share"),
                     ("tower_split_s", "tower s, 1/p frames")),
    "vision_curve": (("seed", "seed"), ("ranks", "ranks"), ("steps", "steps"), ("first_loss", "first loss"), ("last_loss", "last loss"),
                     ("max_rel_diff", "largest relative difference to 1 process"),
                     ("held_out_token_accuracy", "held-out accuracy")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def _model(attn: str):
    from transformers import AutoModelForImageTextToText, LlavaConfig

    text = dict(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 17,
                tie_word_embeddings=False, pad_token_id=0)
    vision = dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, image_size=16, patch_size=4, projection_dim=64)
    config = LlavaConfig(text_config=text, vision_config=vision, vision_feature_layer=-1, image_token_id=63)
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, attn_implementation=attn).train()


def _sample(n: int) -> Dict[str, torch.Tensor]:
    frames = (n - QUESTION) // FRAME_TOKENS
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(1, 60, (1, n), generator=g)
    ids[0, :frames * FRAME_TOKENS] = 63
    labels = ids.masked_fill(ids == 63, -100)
    return {"input_ids": ids, "labels": labels, "pixel_values": torch.randn(frames, 3, 16, 16, generator=g)}


def _tower_s(model, pixels: torch.Tensor, repeats: int) -> List[float]:
    def run():
        model.model.get_image_features(pixel_values=pixels).pooler_output[0].sum().backward()
        model.zero_grad(set_to_none=True)
    return timed(run, repeats)


def measure(attn: str, n: int, repeats: int) -> Dict:
    """One rank's step times, peak memory and tower times (fn of :func:`run_ranks`)."""
    import torch.distributed as dist

    with split_for(attn) as (world, split):
        model = _model(attn)
        small = _sample(512)
        model(**split(small)).loss.backward()  # kernels, threads and the allocator warmed
        model.zero_grad(set_to_none=True)
        base = rss_mb()
        batch = _sample(n)

        def step():
            model(**split(batch)).loss.backward()
            model.zero_grad(set_to_none=True)

        steps = timed(step, repeats, dist.barrier if world > 1 else None)
        peak = peak_rss_mb() - base
        pixels = batch["pixel_values"]
        tower = _tower_s(model, pixels, repeats)
        share = pixels[: max(1, len(pixels) // world)]
        return {"steps": steps, "peak_mb": peak, "tower": tower, "tower_split": _tower_s(model, share, repeats),
                "frames": len(pixels)}


def _spread(runs: List[float]) -> str:
    return f"{min(runs):.3g}-{max(runs):.3g}"


def step_rows(n: int, worlds: List[int], repeats: int) -> List[Dict]:
    rows = []
    base = None
    for attn, world in [("sdpa", 1)] + [("ring_dilated", w) for w in worlds]:
        found = run_ranks(world, measure, attn, n, repeats)
        steps = [max(ts) for ts in zip(*(r["steps"] for r in found))]  # each run at its slowest rank
        tower = statistics.median(found[0]["tower"])
        step = statistics.median(steps)
        base = step if attn == "sdpa" else base
        rows.append({"attn": attn, "ranks": world, "n": n, "frames": found[0]["frames"], "step_s": round(step, 3),
                     "step_spread": _spread(steps), "over_sdpa": round(step / base, 3),
                     "peak_mb": round(max(r["peak_mb"] for r in found), 1), "tower_s": round(tower, 3),
                     "tower_share": round(tower / step, 3),
                     "tower_split_s": round(statistics.median(found[0]["tower_split"]), 3), "repeats": repeats})
        print(format_table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def curve_rows(steps: int, frames: int, seeds: List[int]) -> List[Dict]:
    rows = []
    for seed in seeds:
        rows += _curves(steps, frames, seed)
    return rows


def _curves(steps: int, frames: int, seed: int) -> List[Dict]:
    curves, rows = {}, []
    for ranks in (1, 2):
        with tempfile.TemporaryDirectory() as work:
            losses = os.path.join(work, "losses.json")
            summary = launch(EXAMPLE, ranks, ["--sp-size", str(ranks), "--steps", str(steps), "--frames",
                                              str(frames), "--seed", str(seed), "--output", work, "--losses", losses])
            with open(losses) as f:
                curves[ranks] = json.load(f)
        diff = max(abs(a - b) / abs(b) for a, b in zip(curves[ranks], curves[1]))
        rows.append({"seed": seed, "ranks": ranks, "steps": len(curves[ranks]), "first_loss": round(curves[ranks][0], 4),
                     "last_loss": round(curves[ranks][-1], 4), "max_rel_diff": float(f"{diff:.2g}"),
                     "held_out_token_accuracy": round(summary["held_out_token_accuracy"], 3),
                     "losses": curves[ranks]})
        print(format_table(rows[-1:], [k for k in rows[-1] if k != "losses"]), flush=True)
    return rows


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench vision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384, help="tokens of the long sample (default %(default)s)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="ranks of the ring_dilated runs")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (default %(default)s)")
    ap.add_argument("--curve-steps", type=int, default=120, help="steps of the example's runs (default %(default)s)")
    ap.add_argument("--curve-frames", type=int, default=64, help="frames per row of the example (default %(default)s)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the example's runs")
    ap.add_argument("--skip-curve", action="store_true", help="time the steps only")
    ap.add_argument("--out", default="bench_results", help="where the JSON goes (default bench_results)")
    args = ap.parse_args(argv)
    command = command_line("vision", argv)
    payload = {"config": vars(args),"cores": os.cpu_count(), "rows": step_rows(args.n, args.worlds, args.repeats)}
    if not args.skip_curve:
        payload["curve"] = curve_rows(args.curve_steps, args.curve_frames, args.seeds)
    save(args.out, "vision", payload, command=command)
