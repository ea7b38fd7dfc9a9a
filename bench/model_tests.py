"""``python -m bench model_tests --transformers DIR``: transformers' own model tests with ``ring_dilated`` forced.

For each model type of ``--models``, the test file a checkout of transformers
ships for it (``DIR/tests/models/<type>/test_modeling_<type>.py``: its
ModelTester, the causal-LM and generation mixins) runs twice in one process
per run: as it is (stock), and with :mod:`bench.ring_forced`, which makes
``ring_dilated`` the attention wherever a test names none and transformers
would pick ``sdpa``. A test that fails forced but passes stock is hf_ring's,
unless it checks the implementation's name (a test asserting that the
default is ``sdpa``), which is listed apart; a test that fails stock as well
is the checkout's own. The test files are not in transformers' wheel or sdist,
so this runs from a checkout of the same release as the installed
transformers (``git clone --branch v<release>``), not in CI.

One row per type goes to ``--out``/model_tests.json, replacing an earlier row
of the same type and release; each records the commit and command.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .common import ROOT, command_line, commit

MODELS = ("llama", "mistral", "qwen3_5", "qwen3_next", "jamba", "lfm2", "granitemoehybrid", "bamba", "nemotron_h",
          "falcon_h1", "zamba2", "minimax", "recurrent_gemma", "mamba2", "kimi_linear", "deepseek_v3",
          "glm4_moe_lite", "minicpm3")
"""README's supported families, and the multi-head latent attention types it names."""

NAME_CHECK = re.compile(r"ring_dilated.{0,40}(?:sdpa|eager)|(?:sdpa|eager).{0,40}ring_dilated|_attn_implementation")
"""A failure that is a check of the implementation's name, not of what it computes."""

Outcomes = Dict[str, Tuple[str, str]]
"""Per test id, its outcome (``passed``, ``failed``, ``skipped``) and, for a failure, its message."""


def outcomes(junit_xml: str) -> Outcomes:
    """Each test's outcome in pytest's ``--junitxml`` report ``junit_xml``."""
    got: Outcomes = {}
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        failed = case.find("failure")
        if failed is None:
            failed = case.find("error")
        if failed is not None:
            got[name] = ("failed", (failed.get("message") or failed.text or "")[:400])
        elif case.find("skipped") is not None:
            got[name] = ("skipped", "")
        else:
            got[name] = ("passed", "")
    return got


def compare(stock: Outcomes, forced: Outcomes) -> Dict:
    """The counts of both runs and the forced run's failures sorted: hf_ring's, the name checks, the stock ones."""
    def count(run: Outcomes, outcome: str) -> int:
        return sum(1 for o, _ in run.values() if o == outcome)

    failed = {name: message for name, (o, message) in forced.items() if o == "failed"}
    stock_failed = {name for name, (o, _) in stock.items() if o == "failed"}
    names = sorted(n for n, m in failed.items() if n not in stock_failed and NAME_CHECK.search(m))
    ours = {n: m for n, m in sorted(failed.items()) if n not in stock_failed and n not in names}
    return {"stock_passed": count(stock, "passed"), "stock_failed": count(stock, "failed"),
            "forced_passed": count(forced, "passed"), "forced_failed": count(forced, "failed"),
            "hf_ring_failures": ours, "name_checks": names,
            "failing_stock_too": sorted(n for n in failed if n in stock_failed)}


def _run(checkout: Path, test_file: Path, forced: bool, timeout_s: float) -> Outcomes:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               str(test_file.relative_to(checkout))]
        if forced:
            cmd[3:3] = ["-p", "bench.ring_forced"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        subprocess.run(cmd, cwd=checkout, env=env, timeout=timeout_s, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        if not os.path.exists(report):
            raise RuntimeError(f"pytest wrote no report for {test_file} ({'forced' if forced else 'stock'})")
        return outcomes(report)


def row(checkout: Path, model_type: str, timeout_s: float) -> Dict:
    """One type's row: its test file run stock and forced, compared."""
    import transformers

    test_file = checkout / "tests" / "models" / model_type / f"test_modeling_{model_type}.py"
    base = {"model_type": model_type, "transformers": transformers.__version__,
            "date": datetime.date.today().isoformat(), "commit": commit(ROOT)}
    if not test_file.exists():
        return dict(base, ran=False, why=f"{test_file} does not exist in the checkout")
    stock = _run(checkout, test_file, False, timeout_s)
    return dict(base, ran=True, **compare(stock, _run(checkout, test_file, True, timeout_s)))


def write(out_dir: str, rows: List[Dict], command: str) -> str:
    """``rows`` into ``out_dir``/model_tests.json, each replacing a row of the same type and release."""
    path = Path(out_dir) / "model_tests.json"
    kept = json.loads(path.read_text())["rows"] if path.exists() else []
    new = {(r["model_type"], r["transformers"]) for r in rows}
    kept = [r for r in kept if (r["model_type"], r["transformers"]) not in new]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": kept + [dict(r, command=command) for r in rows]}, indent=2) + "\n")
    return str(path)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench model_tests", description=__doc__.splitlines()[0])
    ap.add_argument("--transformers", required=True, type=Path,
                    help="a checkout of transformers (its tests/ directory) of the installed release")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for one run of one test file")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    args = ap.parse_args(argv)
    if not (args.transformers / "tests" / "models").is_dir():
        ap.error(f"--transformers {args.transformers} has no tests/models directory; pass a checkout of "
                 "transformers (git clone --branch v<installed release> https://github.com/huggingface/transformers)")
    rows = []
    for model_type in args.models:
        rows.append(row(args.transformers, model_type, args.timeout))
        r = rows[-1]
        print(f"{model_type}: " + (r["why"] if not r["ran"] else
              f"stock {r['stock_passed']} passed / {r['stock_failed']} failed; forced {r['forced_passed']} / "
              f"{r['forced_failed']}; hf_ring's {len(r['hf_ring_failures'])}, name checks {len(r['name_checks'])}"))
        for name, message in r.get("hf_ring_failures", {}).items():
            print(f"  {name}: {message.splitlines()[0] if message else ''}")
    print("wrote", write(args.out, rows, command_line("model_tests", argv)))
