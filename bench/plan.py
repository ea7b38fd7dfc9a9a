"""``python -m bench plan``: memory per GPU of a long-context fine-tune, engine by engine.

Arithmetic, not a measurement: a Llama-3.1-8B shape (32 layers, hidden 4096,
8.03e9 parameters) trained with Adam in bf16 mixed precision on 8 GPUs of
80 GB at 131,072 tokens, gradient checkpointing, tiled loss, MLP and norms.
Every row is an estimate, and says what it counts:

- weights, gradients and optimizer states: bytes per parameter of the
  engine's mixed precision (16 in all: bf16 or fp32 weights and gradients,
  fp32 master weights and two Adam states), sharded as the engine shards them;
- buffers: what an engine keeps whole besides (FSDP2's gathered layers, two
  in flight; ZeRO-3's live-parameter budget; the tiled loss's logits chunk);
- logits: where the sequence-tiled loss cannot run, the whole shard's logits
  (bf16, their fp32 copy and its gradient, 10 bytes per row and vocabulary
  entry). Under FSDP2 the head is a sharded module whose forward gathers its
  weight, so the tiled loss, which reads the weight directly, stays off;
- activations: per token and rank, the checkpointed layer inputs (one
  row-sized tensor per layer) plus the row-sized tensors of the layer being
  recomputed, whose count comes from the scale benchmark's measured fit
  (``docs/bench/scale.json``, a CPU measurement at hidden 256); with
  ``hf_ring.offload_checkpoints`` the layer inputs live in host memory.

Under tensor parallelism the layer inputs are whole on every tensor-parallel
rank (only the heads and the MLP's columns are split), so they count per
sequence-parallel shard; the recomputed layer's tensors count as if unsplit,
which over-estimates them.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from .common import command_line, format_table, save

GB = 1e9

LLAMA_8B = {"layers": 32, "hidden": 4096, "params": 8.03e9, "layer_params": 0.218e9, "vocab": 128256}
"""The Llama-3.1-8B shape: a decoder layer's parameters, 0.218e9, are what FSDP2 gathers at a time."""

RECOMPUTED_ROWS = 8.4
"""Row-sized tensors of the layer being recomputed, per token, when ``docs/bench/scale.json`` is not at hand."""

LOGIT_BYTES = 10
"""Bytes per row and vocabulary entry of an untiled loss: bf16 logits, their fp32 copy, and its gradient."""

LOSS_CHUNK_GB = (1 << 25) * 4 / GB
"""The tiled loss's fp32 logits chunk (``hf_ring.patches.tiled_loss.LOSS_CHUNK_ELEMENTS``) and its gradient."""

TABLES = {
    "plan": (("engine", "engine"), ("mesh", "mesh (8 GPUs)"), ("weights_gb", "weights GB"), ("grads_gb", "gradients GB"),
             ("optimizer_gb", "optimizer GB"), ("buffers_gb", "buffers GB"), ("logits_gb", "untiled logits GB"),
             ("checkpoints_gb", "checkpoints GB"),
             ("recompute_gb", "recomputed layer GB"), ("total_gb", "total GB"),
             ("total_offloaded_gb", "total, checkpoints offloaded GB"), ("fits", "fits 80 GB"),
             ("kind", "measured or estimate")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


@dataclass(frozen=True)
class Engine:
    """How one engine lays the model's state out over ``gpus`` ranks: ``sp`` x ``tp`` (x the rest data parallel)."""

    name: str
    mesh: str
    sp: int
    tp: int
    weights_b: float  # bytes per parameter of weights kept, and over how many ranks they are sharded
    weights_over: int
    grads_b: float
    grads_over: int
    optim_b: float
    optim_over: int
    buffers_gb: float
    buffers: str
    tiled_loss: bool = True


def engines(gpus: int, shape: Dict) -> List[Engine]:
    layer_bf16 = shape["layer_params"] * 2 / GB
    return [
        Engine("DDP", f"dp 1 x sp {gpus}", gpus, 1, 4, 1, 4, 1, 8, 1, LOSS_CHUNK_GB, "loss chunk"),
        Engine("FSDP2", f"dp 1 x sp {gpus}", gpus, 1, 4, gpus, 4, gpus, 8, gpus,
               2 * layer_bf16, "2 gathered bf16 layers", tiled_loss=False),
        Engine("DeepSpeed ZeRO-2", f"dp 1 x sp {gpus}", gpus, 1, 2, 1, 2, gpus, 12, gpus,
               LOSS_CHUNK_GB, "loss chunk"),
        Engine("DeepSpeed ZeRO-3", f"dp 1 x sp {gpus}", gpus, 1, 2, gpus, 2, gpus, 12, gpus,
               1e9 * 2 / GB + LOSS_CHUNK_GB, "1e9 live bf16 parameters (stage3_max_live_parameters), loss chunk"),
        Engine("TP x SP + FSDP2", f"sp {gpus // 2} x tp 2", gpus // 2, 2, 4, gpus, 4, gpus, 8, gpus,
               2 * layer_bf16 / 2, "2 gathered bf16 layer shards", tiled_loss=False),
    ]


def recomputed_rows(scale_json: Optional[str]) -> float:
    """Row-sized tensors per token besides the layer inputs, from the scale benchmark's fit when available."""
    if scale_json and os.path.exists(scale_json):
        with open(scale_json) as f:
            payload = json.load(f)
        fit = payload["fits"]["dilated tiling=loss+mlp+norm"]
        return fit["b_kib_per_token"] * 1024 / (payload["model"]["hidden_size"] * 4) - payload["model"]["num_hidden_layers"]
    return RECOMPUTED_ROWS


def plan(engine: Engine, shape: Dict, tokens: int, gpu_gb: float, extra_rows: float) -> Dict:
    """One engine's row: GB per GPU of each part, the total with and without offloaded checkpoints, and the fit."""
    p = shape["params"]
    row_gb = shape["hidden"] * 2 / GB  # one bf16 row
    per_rank = tokens / engine.sp
    parts = {
        "weights_gb": engine.weights_b * p / engine.weights_over / GB,
        "grads_gb": engine.grads_b * p / engine.grads_over / GB,
        "optimizer_gb": engine.optim_b * p / engine.optim_over / GB,
        "buffers_gb": engine.buffers_gb,
        "logits_gb": 0.0 if engine.tiled_loss else per_rank * shape["vocab"] * LOGIT_BYTES / GB,
        "checkpoints_gb": shape["layers"] * row_gb * per_rank,
        "recompute_gb": extra_rows * row_gb * per_rank,
    }
    total = sum(parts.values())
    offloaded = total - parts["checkpoints_gb"]
    row = {"engine": engine.name, "mesh": engine.mesh}
    row.update({k: round(v, 1) for k, v in parts.items()})
    row.update({"total_gb": round(total, 1), "total_offloaded_gb": round(offloaded, 1),
                "fits": "yes" if total <= gpu_gb else ("with offload" if offloaded <= gpu_gb else "no"),
                "counts": engine.buffers, "kind": "estimate"})
    return row


def run(gpus: int, tokens: int, gpu_gb: float, scale_json: Optional[str]) -> List[Dict]:
    extra = recomputed_rows(scale_json)
    return [plan(e, LLAMA_8B, tokens, gpu_gb, extra) for e in engines(gpus, LLAMA_8B)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8, help="GPUs in the job (default 8)")
    ap.add_argument("--tokens", type=int, default=131072, help="tokens per sequence (default 131072)")
    ap.add_argument("--gpu-gb", type=float, default=80.0, help="memory of one GPU in GB (default 80)")
    ap.add_argument("--scale-json", default=os.path.join("docs", "bench", "scale.json"),
                    help="the scale benchmark's JSON, for the recomputed layer's tensors per token "
                         "(default docs/bench/scale.json)")
    ap.add_argument("--out", default="bench_results", help="where plan.json goes (default bench_results)")
    args = ap.parse_args(argv)
    command = command_line("plan", argv)
    rows = run(args.gpus, args.tokens, args.gpu_gb, args.scale_json)
    print(format_table(rows, list(rows[0])))
    save(args.out, "plan", {"config": vars(args), "shape": LLAMA_8B, "recomputed_rows": recomputed_rows(args.scale_json),
                            "engines": [asdict(e) for e in engines(args.gpus, LLAMA_8B)], "rows": rows}, command=command)
