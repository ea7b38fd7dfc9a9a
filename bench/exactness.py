"""``python -m bench exactness``: how close to its reference each exactness test the docs cite lands.

Runs those tests (``--tests``, by default :data:`TESTS`) with ``pytest
--record-errors``: every relative error a test asserts within its tolerance
(``tests/helpers.py``'s ``close``) against an independent reference (one
process with transformers' own attention, a plain run without hf_ring, or
float64) is kept, and a test function's row is the largest of them over its
parametrized cases, in the norm the test measures it: ``max`` is ``max|a - b| / max|b|``, ``l2`` is
``||a - b|| / ||b||``, each per tensor. The figures in the docs are these rows,
not numbers copied from a test's output. A skipped test writes no row; a test
that fails ends the command with the tests' output before any row is written.

Every row joins ``exactness.json`` as soon as the tests end, in the place of
the row of the same test and norm or after the others (see
:mod:`bench.rowfile`), so one file can be run again alone.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List

import torch
import transformers

from .common import ROOT, command_line, commit, format_table
from .rowfile import RECORDED, RowFile, add_replace_unrecorded

TESTS = ("tests/test_trainer.py", "tests/test_deepspeed.py", "tests/test_tensor_parallel.py",
         "tests/test_packed_attention.py", "tests/test_packed_models.py", "tests/test_tiling.py",
         "tests/test_model_zoo.py", "tests/test_post_training.py")
"""The test files whose measured errors the docs give."""

TABLES = {
    "exactness": (("test", "test"), ("cases", "cases"), ("norm", "norm"), ("worst", "largest relative error"),
                  ("torch", "torch"), ("transformers", "transformers")),
}
"""The columns of this benchmark's table in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""

WRITES = {"exactness": {"rows": ("test", "norm", "cases", "worst", "torch", "transformers") + RECORDED}}
"""What this benchmark writes to each list of rows (see :func:`bench.tables.unwritten`)."""


def record(tests: List[str]) -> Dict[str, Dict[str, float]]:
    """Run ``tests`` under pytest in a fresh process; per passed test (node id), its largest error per norm."""
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "errors.json")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--record-errors", path, *tests]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}")
        with open(path) as f:
            return json.load(f)


def rows(recorded: Dict[str, Dict[str, float]]) -> List[Dict]:
    """One row per test function and norm, in the order the tests ran: the largest error over its parametrized
    cases, and how many cases passed and asserted one."""
    worst: Dict[tuple, float] = {}
    cases: Dict[tuple, int] = {}
    for node, by_norm in recorded.items():
        for norm, err in by_norm.items():
            key = (node.split("[")[0], norm)
            worst[key] = max(worst.get(key, 0.0), err)
            cases[key] = cases.get(key, 0) + 1
    return [{"test": test, "norm": norm, "cases": cases[test, norm], "worst": float(f"{err:.2g}"),
             "torch": torch.__version__, "transformers": transformers.__version__}
            for (test, norm), err in worst.items()]


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench exactness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", nargs="+", default=list(TESTS),
                    help="test files or node ids, as pytest takes them (default: the files the docs cite)")
    ap.add_argument("--out", default="bench_results", help="where exactness.json goes (default: %(default)s)")
    add_replace_unrecorded(ap)
    args = ap.parse_args(argv)
    found = rows(record(args.tests))
    if not found:
        raise SystemExit(f"no test of {args.tests} asserted an error against its reference")
    sink = RowFile(args.out, "exactness", WRITES["exactness"], vars(args), command_line("exactness", argv),
                   commit(ROOT), keys={"rows": ((), ("test", "norm"))}, replace_unrecorded=args.replace_unrecorded)
    for row in found:
        sink.keep("rows", row)
    print(format_table(found, [k for k, _ in TABLES["exactness"]]), flush=True)
