"""``python -m bench compat``: what a new user meets on the installed releases, as one row of ``compat.json``.

Four probes, each against an implementation independent of hf_ring (transformers'
``sdpa`` in one process on the whole input):

1. ``import hf_ring`` (it refuses a release below :data:`hf_ring.versions.FLOORS`);
2. one process: ``ring_dilated`` logits against ``sdpa``'s;
3. two gloo ranks: a sharded training step (``shard_batch``, ``sync_gradients``):
   the loss and every parameter gradient against one process;
4. two gloo ranks: a ``transformers.Trainer`` under ``prepare_trainer``: the
   loss of its first step against one process.

``--suite`` also runs the test suite's compatibility subset (``pytest -m compat``)
and records its counts. The row is added to ``--out``/compat.json, replacing
an earlier row of the same releases and Python; it records the commit and the
command that wrote it.

``--matrix`` writes every row of :data:`MATRIX` that way: for each, a fresh
virtual environment under ``--venvs`` (kept for the next run) with those
releases installed (torch first, so nothing pulls another build), then this
command with ``--suite`` inside it. A row that cannot run on this machine is
written by the same command with ``ran: false`` and why.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from hf_ring.versions import FLOORS, installed
from .common import commit, rel_err, run_ranks

PACKAGES = tuple(FLOORS)

NEWEST = {"torch": "2.15.0", "transformers": "5.25.0", "accelerate": "1.16.0"}
BASE = {"torch": "2.13.0", "transformers": "5.25.0", "accelerate": "1.16.0"}
MATRIX: List[Dict[str, str]] = (
    [dict(BASE, torch=t) for t in ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")]
    + [dict(BASE, transformers=t) for t in ("5.17.0", "5.18.0", "5.19.0", "5.20.2", "5.21.1", "5.22.2", "5.23.0",
                                            "5.24.0")]
    + [dict(BASE, accelerate=a) for a in ("1.10.1", "1.11.0", "1.12.0", "1.13.0", "1.14.0", "1.15.0")]
    + [{"torch": "2.13.0", "transformers": "5.17.0", "accelerate": "1.10.1"},  # the floor CI job
       dict(NEWEST, python="3.10", transformers="5.20.2"), dict(NEWEST, python="3.12"),
       {"torch": "2.11.0", "transformers": "5.17.0", "accelerate": "1.15.0", "python": "3.12"}])  # the GPU machine's
"""Every row of compat.json: each minor release of each package with the others at the newest pinned stack, the
floor, the declared Python floor and a newer Python (the newest releases each allows: transformers needs Python
3.11 from 5.21; ``python`` defaults to 3.11), and the stack of the GPU machine ``bench gpu`` runs on (its CUDA build
of torch runs on the CPU here). Rows of an earlier base stay in the file as they were written."""
NO_CONSTRAINT = {"PIP_CONSTRAINT": "/dev/null"}
"""The environment of the matrix's installs: a machine's pip constraint file may cap torch (this image's stops at
2.14.1, below the newest published); each row pins every release it installs, so no cap is needed."""

MODEL = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
N, ROWS = 37, 2
WHERE = "CPU, gloo"
"""Where every probe computes, on a GPU machine too: on the CPU, its two ranks in a gloo group (the CUDA route is
``bench gpu``'s)."""

TABLES = {
    "compat": (("transformers", "transformers"), ("accelerate", "accelerate"), ("torch", "torch"),
               ("python", "Python"), ("where", "where"), ("date", "date"), ("one_process_logits", "1 process: logits vs sdpa"),
               ("sp2_step_loss", "2 ranks: loss vs 1 process"), ("sp2_step_grads", "2 ranks: worst gradient"),
               ("sp2_trainer_loss", "2-rank Trainer: loss"), ("compat_subset", "compatibility subset")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""
WRITES = {"compat": {"rows": PACKAGES + (
    "python", "where", "date", "commit", "command", "ran", "why", "one_process_logits", "sp2_step_loss",
    "sp2_step_grads", "sp2_trainer_loss", "compat_subset", "compat_failures")}}
"""Every field a row of compat.json can hold (``bench tables --check`` holds the file to them)."""
BESIDE = {"compat": ("config",)}


def _save_model(directory: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(directory)
    return directory


def _batch() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (ROWS, N), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _load(path: str, impl: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.float32)


def _reference(path: str):
    """Loss and gradients of ``sdpa`` in one process on the whole batch."""
    model = _load(path, "sdpa").train()
    loss = model(**_batch()).loss
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}


def one_process(path: str) -> float:
    """Worst relative error of ``ring_dilated``'s logits against ``sdpa``'s, one process."""
    import hf_ring  # noqa: F401  (registers ring_dilated)

    models = {impl: _load(path, impl) for impl in ("ring_dilated", "sdpa")}
    assert models["ring_dilated"].config._attn_implementation == "ring_dilated"
    with torch.no_grad():
        got, want = (m(input_ids=_batch()["input_ids"]).logits for m in models.values())
    return rel_err(got, want)


def _sharded_step(path: str) -> Dict:
    import hf_ring

    hf_ring.setup_sequence_parallel(sp_size=2)
    model = _load(path, "ring_dilated").train()
    assert model.config._attn_implementation == "ring_dilated"
    loss = model(**hf_ring.shard_batch(_batch())).loss
    loss.backward()
    hf_ring.sync_gradients(model)
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)  # each rank's loss is its shard's share of the sequence's
    want_loss, want_grads = _reference(path)
    worst_grad = max(rel_err(p.grad, want_grads[k]) for k, p in model.named_parameters())
    hf_ring.clear_sequence_parallel()
    return {"loss": rel_err(total, want_loss), "grads": worst_grad}


def _trainer(path: str) -> float:
    from transformers import Trainer, TrainingArguments

    import hf_ring

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):  # every row the same: the first step's batch is known whatever the order
            return {k: v[0] for k, v in _batch().items()}

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # accelerate finds the running gloo world from the launcher's variables
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", ACCELERATE_USE_CPU="true")
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=1, logging_steps=1,
                                 report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                 learning_rate=1e-3)
        trainer = Trainer(model=_load(path, "ring_dilated"), args=args, train_dataset=Rows())
        hf_ring.prepare_trainer(trainer, sp_size=2)
        logged = trainer.train().training_loss  # unrounded, unlike the logged history
    model = _load(path, "sdpa")
    with torch.no_grad():
        want = model(**{k: v[:1] for k, v in _batch().items()}).loss
    hf_ring.clear_sequence_parallel()
    return abs(logged - want.item()) / abs(want.item())


def _suite(root: Path) -> Dict:
    """``pytest -m compat`` in a checkout: its closing counts and the tests that failed."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "compat", "-p", "no:cacheprovider"], cwd=root,
                         capture_output=True, text=True)
    lines = run.stdout.splitlines()
    counts = [line for line in lines if re.search(r"\d+ (passed|failed)", line)]
    failed = [line.split()[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    told = ", ".join(re.findall(r"\d+ (?:passed|failed|errors?)", counts[-1])) if counts else ""
    return {"compat_subset": told or f"pytest exit {run.returncode}", "compat_failures": failed}


def probe(suite: bool) -> Dict:
    root = Path(__file__).resolve().parents[1]
    row: Dict = {p: installed(p) for p in PACKAGES}
    row["python"] = ".".join(map(str, sys.version_info[:3]))
    row["where"] = WHERE
    row["date"] = datetime.date.today().isoformat()
    row["commit"] = commit(str(root))
    row["command"] = "python -m bench compat" + (" --suite" if suite else "")
    row["ran"] = True
    with tempfile.TemporaryDirectory() as tmp:
        path = _save_model(tmp)
        row["one_process_logits"] = float(f"{one_process(path):.2g}")
        step = run_ranks(2, _sharded_step, path, exact_peak=False)
        row["sp2_step_loss"] = float(f"{max(r['loss'] for r in step):.2g}")
        row["sp2_step_grads"] = float(f"{max(r['grads'] for r in step):.2g}")
        row["sp2_trainer_loss"] = float(f"{max(run_ranks(2, _trainer, path, exact_peak=False)):.2g}")
    if suite:
        row.update(_suite(root))
    return row


def _key(row: Dict) -> Tuple:
    """What a row is of: its releases, its Python and where it computed."""
    return tuple(row.get(p) for p in PACKAGES) + (".".join(str(row.get("python", "3.11")).split(".")[:2]),
                                                   row.get("where"))


def _recorded(row: Dict) -> bool:
    return "command" in row and "commit" in row


def write(out: str, row: Dict, replace_unrecorded: bool = False) -> None:
    """Add ``row`` to ``out``/compat.json, replacing the row of the same releases and Python run in the same place
    (and, with ``replace_unrecorded``, every row that records no command and commit)."""
    path = os.path.join(out, "compat.json")
    rows = json.load(open(path))["rows"] if os.path.exists(path) else []
    rows = [r for r in rows if _key(r) != _key(row) and not (replace_unrecorded and not _recorded(r))] + [row]
    rows.sort(key=lambda r: [tuple(int(x) for x in re.findall(r"\d+", str(r.get(p)))[:3]) for p in
                             ("transformers", "accelerate", "torch", "python")])
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"config": {"model": MODEL, "n": N, "rows": ROWS}, "rows": rows}, f, indent=2)


def _interpreter(version: str) -> Optional[str]:
    """A ``python<version>`` on PATH, or one pyenv has installed."""
    found = shutil.which(f"python{version}")
    if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0:
        return found
    bare = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True, text=True).stdout.split()
    for name in bare:
        if name.startswith(version + "."):
            prefix = subprocess.run(["pyenv", "prefix", name], capture_output=True, text=True).stdout.strip()
            if prefix:
                return os.path.join(prefix, "bin", "python")
    return None


def matrix(out: str, venvs: str, only: Optional[List[int]] = None, replace_unrecorded: bool = False) -> None:
    """Every row of :data:`MATRIX` (or the rows numbered ``only``), each in its own environment."""
    root = Path(__file__).resolve().parents[1]
    for i, spec in enumerate(MATRIX):
        if only and i not in only:
            continue
        python = spec.get("python", "3.11")
        releases = {p: spec[p] for p in PACKAGES}
        interpreter = _interpreter(python)
        why = None if interpreter is not None else f"no Python {python} on this machine"
        if why is not None:
            write(out, dict(releases, python=python, date=datetime.date.today().isoformat(), commit=commit(str(root)),
                            command="python -m bench compat --matrix", ran=False, why=why,
                            compat_subset=f"not run: {why}"), replace_unrecorded)
            continue
        env = os.path.join(venvs, "-".join([f"py{python}"] + [f"{p}{v}" for p, v in releases.items()]))
        pip = [os.path.join(env, "bin", "python"), "-m", "pip", "install", "--quiet"]
        unconstrained = dict(os.environ, **NO_CONSTRAINT)
        if not os.path.exists(os.path.join(env, "bin", "python")):
            subprocess.run([interpreter, "-m", "venv", env], check=True)
            subprocess.run(pip + ["--upgrade", "pip"], check=True, env=unconstrained)
        subprocess.run(pip + [f"torch=={releases['torch']}"], check=True, env=unconstrained)
        subprocess.run(pip + ["-e", f"{root}[test]"] + [f"{p}=={v}" for p, v in releases.items()], check=True,
                       env=unconstrained)
        subprocess.run([os.path.join(env, "bin", "python"), "-m", "bench", "compat", "--suite", "--out", out]
                       + (["--replace-unrecorded"] if replace_unrecorded else []), cwd=root, check=True)


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench compat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", action="store_true", help="also run the compatibility subset (pytest -m compat)")
    ap.add_argument("--matrix", action="store_true",
                    help="write every row of the matrix, each in a virtual environment of its releases (see above)")
    ap.add_argument("--rows", type=int, nargs="+", help="with --matrix: only these rows (numbered from 0)")
    ap.add_argument("--venvs", default=".venv-compat", help="with --matrix: where the environments are kept")
    ap.add_argument("--replace-unrecorded", action="store_true",
                    help="drop the rows that record no command and commit (gathered by hand, or written before "
                         "rows recorded them) once this run's row is written")
    ap.add_argument("--out", default="docs/bench")
    args = ap.parse_args(argv)
    if args.matrix:
        matrix(os.path.abspath(args.out), os.path.abspath(args.venvs), args.rows, args.replace_unrecorded)
        return
    row = probe(args.suite)
    print(json.dumps(row), flush=True)
    write(args.out, row, args.replace_unrecorded)
