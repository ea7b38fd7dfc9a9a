"""``python -m bench sft``: does ``examples/sft.py`` learn? Its held-out token accuracy, seed by seed.

Launches the example as its docstring does (2 CPU processes, one sequence split
over both, its defaults otherwise) once per seed, and keeps each run's summary:
the token accuracy on the completions of words it never trained on (chance 1 in
29), the losses and the wall time of the whole launch.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import List

from .common import command_line, format_table, save
from .quality import launch

EXAMPLE = os.path.join("examples", "sft.py")

TABLES = {
    "sft": (("seed", "seed"), ("ranks", "ranks"), ("steps", "steps"), ("held_out_token_accuracy", "held-out accuracy"),
            ("eval_loss", "eval loss"), ("wall_s", "launch s")),
}
"""The columns of this benchmark's table in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench sft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--ranks", type=int, default=2, help="processes, one sequence split over all of them")
    ap.add_argument("--out", default="bench_results", help="where the JSON goes (default bench_results)")
    args = ap.parse_args(argv)
    command = command_line("sft", argv)
    rows = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as work:
            t0 = time.perf_counter()
            summary = launch(EXAMPLE, args.ranks, ["--sp-size", str(args.ranks), "--seed", str(seed),
                                                   "--output", work])
            rows.append({"seed": seed, "ranks": args.ranks, "steps": summary["steps"],
                         "held_out_token_accuracy": round(summary["held_out_token_accuracy"], 3),
                         "eval_loss": round(summary["eval_loss"], 4), "wall_s": round(time.perf_counter() - t0, 1)})
        print(format_table(rows[-1:], list(rows[-1])), flush=True)
    save(args.out, "sft", {"config": vars(args), "rows": rows}, command=command)
