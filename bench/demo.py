"""``python -m bench demo``: README command 1 after its install, seed by seed: does it retrieve, and in how long?

Runs what a user runs: ``accelerate launch`` of ``examples/finetune.py`` with
the sequence split over the ranks (its defaults otherwise, with ``--seed``),
then ``python examples/generate.py --model CHECKPOINT --passkey`` on the
checkpoint it wrote. Each seed's row holds the retrieval accuracy at the full
length before and after training and by the passkey's depth (from the
example's ``summary.json``), how many passkeys ``generate.py`` recalled (from
what it printed), the training time the example reports and the wall time of
each command. The first seed's training curve (the example's ``accuracy.png``)
becomes ``demo.png``.

Every row joins ``demo.json`` as soon as its seed ends, in the place of the
row with the same settings or after the others (see :mod:`bench.rowfile`).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

from .common import ROOT, command_line, commit, device_name, format_table
from .quality import depth_cells, launch
from .rowfile import RECORDED, RowFile, add_replace_unrecorded

FINETUNE = os.path.join(ROOT, "examples", "finetune.py")
GENERATE = os.path.join(ROOT, "examples", "generate.py")

TABLES = {
    "demo": (("seed", "seed"), ("ranks", "ranks"), ("steps", "steps"), ("accuracy_before", "accuracy before"),
             ("accuracy_after", "accuracy after"), ("by_depth", "after, by passkey depth 0/10/…/50%"),
             ("prompts", "`generate.py --passkey` prompts"), ("recalled", "recalled"), ("training_s", "training s"),
             ("finetune_s", "`finetune.py` launch s"), ("generate_s", "`generate.py` s"),
             ("commands_s", "both commands s"), ("device", "device")),
}
"""The columns of this benchmark's table in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""

ROW = ("seed", "ranks", "device", "steps", "seq_len", "accuracy_before", "accuracy_after", "accuracy_by_depth",
       "by_depth", "chance", "final_loss", "recalled", "prompts", "training_s", "finetune_s", "generate_s",
       "commands_s")
WRITES = {"demo": {"rows": ROW + RECORDED}}
"""What this benchmark writes to each list of rows (see :func:`bench.tables.unwritten`)."""
BESIDE = {"demo": ("figure_seed",)}
"""What it writes beside the rows: the seed whose training curve ``demo.png`` is."""

ANSWER = re.compile(r"^prompt \d+: passkey +(\d+), model says (.+)$", re.MULTILINE)
"""One line of ``generate.py --passkey``'s answers: the passkey, then what the model said."""


def recalled(printed: str) -> Tuple[int, int]:
    """How many of the prompts ``generate.py --passkey`` answered with their passkey, and of how many, from what it
    printed."""
    answers = ANSWER.findall(printed)
    if not answers:
        raise RuntimeError(f"generate.py --passkey printed no answers:\n{printed[-2000:]}")
    return sum(key == said.strip() for key, said in answers), len(answers)


def generate_passkeys(checkpoint: str) -> str:
    """README command 1's last part on ``checkpoint``: what it printed."""
    cmd = [sys.executable, GENERATE, "--model", checkpoint, "--passkey"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def seed_row(seed: int, ranks: int, work: str) -> Dict:
    """Both commands for ``seed``, timed one after the other as a user runs them; the row, with the example's files
    left in ``work``."""
    t0 = time.perf_counter()
    got = launch(FINETUNE, ranks, ["--sp-size", str(ranks), "--seed", str(seed), "--output", work])
    t1 = time.perf_counter()
    hits, prompts = recalled(generate_passkeys(work))
    t2 = time.perf_counter()
    return {"seed": seed, "ranks": ranks, "device": device_name(), "steps": got["steps"], "seq_len": got["seq_len"],
            "accuracy_before": got["accuracy_before"], "accuracy_after": got["accuracy_after"],
            "accuracy_by_depth": got["accuracy_by_depth"], "by_depth": depth_cells(got), "chance": got["chance"],
            "final_loss": got["final_loss"], "recalled": hits, "prompts": prompts, "training_s": got["wall_s"],
            "finetune_s": round(t1 - t0, 1), "generate_s": round(t2 - t1, 1), "commands_s": round(t2 - t0, 1)}


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                    help="one run of both commands each, in this order (default: %(default)s)")
    ap.add_argument("--ranks", type=int, default=2, help="processes, one sequence split over all of them "
                                                         "(default: %(default)s, as README command 1)")
    ap.add_argument("--out", default="bench_results", help="where demo.json and demo.png go (default: %(default)s)")
    add_replace_unrecorded(ap)
    args = ap.parse_args(argv)
    if args.ranks < 1:
        ap.error(f"--ranks must be at least 1, got {args.ranks}")
    if len(set(args.seeds)) != len(args.seeds):
        ap.error(f"--seeds lists a seed twice: {args.seeds}; each seed is one row")
    sink = RowFile(args.out, "demo", WRITES["demo"], vars(args), command_line("demo", argv), commit(ROOT),
                   keys={"rows": (("ranks",), ("seed", "device"))}, beside=BESIDE["demo"],
                   replace_unrecorded=args.replace_unrecorded)
    os.makedirs(args.out, exist_ok=True)
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as work:
            row = seed_row(seed, args.ranks, work)
            print(format_table([row], [k for k, _ in TABLES["demo"]]), flush=True)
            beside = None
            if seed == args.seeds[0]:
                shutil.copyfile(os.path.join(work, "accuracy.png"), os.path.join(args.out, "demo.png.part"))
                os.replace(os.path.join(args.out, "demo.png.part"), os.path.join(args.out, "demo.png"))
                beside = {"figure_seed": seed}
            sink.keep("rows", row, beside)
