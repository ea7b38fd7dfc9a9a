"""``python -m bench endings``: how each way a user's script can end exits, counted over many launches.

A launch must exit 0 on every rank. gloo processes that end with work still
outstanding abort at exit ("terminate called without an active exception"),
and the launcher reports a finished job as failed; the abort comes in some
launches and not others, so one launch proves little. This launches, for a
Llama and for a hybrid (Qwen3.5: gated-delta-rule layers beside attention,
whose last exchange before the end is a recurrent layer's, in its backward),
each ending a script has — ``dist.destroy_process_group()``, nothing at all,
``accelerator.end_training()``, ``hf_ring.shutdown()`` — ``--launches`` times
under ``torchrun`` on 2 CPU ranks, one training step through ``shard_batch``
each, and counts the exit codes. Rows go to ``endings.json``.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from .common import command_line, save

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "ending_step.py"
ENDINGS = ("destroy", "none", "end_training", "shutdown")
"""How the launched script ends: ``dist.destroy_process_group()``, nothing, ``accelerator.end_training()``,
``hf_ring.shutdown()``."""
MODELS = ("llama", "qwen3_5_text")

TABLES = {
    "endings": (("model", "model"), ("ending", "the script ends with"), ("launches", "launches"),
                ("exit_0", "every rank exit 0"), ("codes", "exit codes (launcher)")),
}
"""The columns of this benchmark's table in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""
WRITES = {"endings": {"rows": ("model", "ending", "launches", "exit_0", "codes", "aborts")}}
BESIDE = {"endings": ("config",)}


def launch(model_dir: str, ending: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    """One 2-rank ``torchrun`` launch of :data:`SCRIPT` with ``ending``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           "--model", model_dir, "--ending", ending]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=str(ROOT))


def saved_model(model_type: str, where: str) -> str:
    """A tiny model of ``model_type`` (four layers; the hybrid three gated-delta-rule layers, then attention),
    saved with safetensors under ``where``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    if model_type == "qwen3_5_text":
        sizes.update(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **sizes))
    path = os.path.join(where, model_type)
    model.save_pretrained(path, safe_serialization=True)
    return path


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench endings", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=20, help="launches of each model and ending (%(default)s)")
    ap.add_argument("--endings", nargs="+", choices=ENDINGS, default=list(ENDINGS))
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--out", default="docs/bench")
    args = ap.parse_args(argv)
    rows: List[Dict] = []
    with tempfile.TemporaryDirectory() as where:
        for model_type in args.models:
            path = saved_model(model_type, where)
            for ending in args.endings:
                codes, aborts = collections.Counter(), 0
                for _ in range(args.launches):
                    done = launch(path, ending)
                    codes[done.returncode] += 1
                    aborts += "terminate called" in done.stderr
                    if done.returncode != 0:
                        print(done.stderr[-2000:], file=sys.stderr)
                row = {"model": model_type, "ending": ending, "launches": args.launches, "exit_0": codes[0],
                       "codes": ", ".join(f"{code}: {n}" for code, n in sorted(codes.items())), "aborts": aborts}
                print(row, flush=True)
                rows.append(row)
    save(args.out, "endings", {"config": {"world": 2, "launcher": "torchrun --standalone", "backend": "gloo"},
                               "rows": rows}, command=command_line("endings", argv))
