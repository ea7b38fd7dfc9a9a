"""Hybrid models on the GPU kernel packages' own Python entry points (their launches in torch: kernel_standins),
in fresh processes: one process, then 2 and 4 ranks, each rank a new process.

transformers picks a kernel package when a modeling module is imported (none is imported before
:func:`kernel_standins.install` here), so these runs cannot share a process with tests that import the torch paths
first; ``python tests/kernel_ranks.py --out FILE`` writes, per model type and
world size, the worst relative error of the loss and every gradient against the one-process step, the greedy tokens
of ``hf_ring.generate`` (``model.generate``'s in one process), and what the kernels were called with.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import helpers  # noqa: E402
import hybrid_cases  # noqa: E402
import hybrid_models  # noqa: E402
import kernel_standins  # noqa: E402
import sweep  # noqa: E402

import hf_ring  # noqa: E402
from hf_ring.integration.context import CONTEXT_KEY  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64}
SCAN_ROWS = 7
"""The most rows of a scan kernel's call over shards: shorter than every run, so that a torch-path scan runs in
pieces, and a linear-time package's whole."""


def _step(model_type: str, split: bool, dtype: str, packed: bool = False) -> Dict:
    """The padded batch's step in ``dtype`` (the kernels as installed, not replaced): loss, every gradient, and the
    kernel launches this process made. ``packed``: the packed row's (position ids restarting at each document), in
    one process its documents run one by one."""
    sp = hf_ring.setup_sequence_parallel(None) if split else None
    kernel_standins.CALLS.clear()
    try:
        model, why = sweep.build(model_type, "ring_dilated" if split else "sdpa", DTYPES[dtype], "hybrid")
        assert model is not None, why
        model.eval()  # a Mamba2 layer's training forward tries the fused kernel first, which the hooks decline
        data = hybrid_cases.packed_batch() if packed else hybrid_cases.padded_batch()
        if split:
            data = hf_ring.shard_batch(data)
            data[CONTEXT_KEY].scan_rows = SCAN_ROWS
        loss = hybrid_cases.documents_apart(model, data) if packed and not split else model(**data).loss
        loss.backward()
        loss = loss.detach()
        if split:
            hf_ring.sync_gradients(model)
            dist.all_reduce(loss, group=sp.sp_group)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return {"loss": loss, "grads": grads, "calls": list(kernel_standins.CALLS)}
    finally:
        if split:
            hf_ring.clear_sequence_parallel()


def _generate(path: str, split: bool) -> List[List[int]]:
    """Greedy tokens of the hybrid saved at ``path`` (float32), its prompt's first row left-padded:
    ``model.generate`` (``sdpa``) in one process, ``hf_ring.generate`` over the ranks."""
    ids = hybrid_cases.padded_batch()["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ring_dilated" if split else "sdpa",
                                                 dtype=torch.float32).eval()
    if not split:
        return model.generate(ids, attention_mask=mask, **settings).tolist()
    hf_ring.setup_sequence_parallel(None)
    try:
        return hf_ring.generate(model, ids, mask, **settings).tolist()
    finally:
        hf_ring.clear_sequence_parallel()


def _rank(rank: int, world: int, init: str, types: List[str], packages: List[str], dtype: str, paths: Dict[str, str],
          out: str) -> None:
    os.environ.setdefault("HF_RING_TIMEOUT", "120")
    torch.set_num_threads(1)
    kernel_standins.install(packages)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        got = {t: _step(t, True, dtype) for t in types}
        for t in types:
            got[t]["packed"] = _step(t, True, dtype, packed=True)
            kernel_standins.CALLS.clear()
            got[t]["tokens"] = _generate(paths[t], True)
            got[t]["generate_calls"] = list(kernel_standins.CALLS)
        gathered = [None] * world
        dist.all_gather_object(gathered, {t: (r["calls"], r["generate_calls"], r["tokens"]) for t, r in got.items()})
        for r in got.values():
            r["packed"] = {"loss": r["packed"]["loss"], "grads": r["packed"]["grads"]}
        if rank == 0:
            torch.save({t: dict(r, calls=[c[t][0] for c in gathered], generate_calls=[c[t][1] for c in gathered],
                                tokens=[c[t][2] for c in gathered]) for t, r in got.items()}, out)
    finally:
        # The last collective here is the test's own (all_gather_object): hf_ring's exit exchange then
        # destroy, so that gloo's worker holds none of its tensors when the interpreter ends (an abort at exit
        # otherwise, in about one launch of eight).
        hf_ring.shutdown()


def _worst(got: Dict, want: Dict) -> float:
    errs = [helpers.rel_err(got["loss"], want["loss"])]
    assert set(got["grads"]) == set(want["grads"]), set(got["grads"]) ^ set(want["grads"])
    errs += [helpers.rel_err(got["grads"][n], want["grads"][n]) for n in want["grads"]]
    return max(errs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--types", nargs="+", required=True)
    ap.add_argument("--packages", nargs="+", choices=kernel_standins.PACKAGES, required=True,
                    help="the kernel packages transformers may find (the others hidden)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    packages = kernel_standins.install(args.packages)
    torch.set_num_threads(1)
    want = {t: _step(t, False, args.dtype) for t in args.types}
    packed = {t: _step(t, False, args.dtype, packed=True) for t in args.types}
    paths = {t: hybrid_models.saved(t) for t in args.types}
    report = {"packages": packages, "types": {}}
    for t in args.types:
        kernel_standins.CALLS.clear()
        tokens = _generate(paths[t], False)
        report["types"][t] = {"one_process_calls": want[t]["calls"], "tokens": tokens,
                              "generate_calls": list(kernel_standins.CALLS)}
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rank0.pt")
            mp.start_processes(_rank, args=(world, os.path.join(tmp, "init"), args.types, args.packages, args.dtype, paths, out), nprocs=world,
                               start_method="spawn")
            got = torch.load(out, weights_only=False)
        for t in args.types:
            report["types"][t][str(world)] = {"worst": _worst(got[t], want[t]), "calls": got[t]["calls"],
                                              "packed_worst": _worst(got[t]["packed"], packed[t]),
                                              "tokens": got[t]["tokens"], "generate_calls": got[t]["generate_calls"]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
