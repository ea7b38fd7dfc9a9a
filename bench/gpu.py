"""``python -m bench gpu``: the CUDA route, checked and measured, in one command on any CUDA machine.

Sections, each written as ``gpu_<section>.json`` and rendered as a README table:

- ``routes``: the kernel every kind of block takes, forward and backward, seen
  by an op spy (:mod:`bench.routes`): fused op, run-time contracts,
  K/V never repeated, no score-sized allocation.
- ``exact``: ``ring_attention`` on the device against the float64 reference
  (``tests/reference.py``, so run from a checkout), per block kind and dtype:
  the worst relative error per tensor over out, dq, dk, dv (and the sinks').
- ``speed``: forward and forward+backward of ``ring_attention`` on one GPU
  against ``F.scaled_dot_product_attention`` on its flash kernel (bf16, B=1,
  32/8 heads, D=128, causal) at ``--sizes``, and the dilated pattern of the
  README (segments 2048..65536, rates 1..32, capped at n); the peak memory
  each allocates above its inputs. The implementations alternate within each
  of ``--repeats`` rounds; a ratio is of the medians, and the row states the
  lowest and highest round's ratio beside it (so does ``model``).
- ``model``: one training step of the scale benchmark's Llama in bf16, ``ring_dilated`` against ``sdpa``,
  and with checkpointing, the peak memory with and without :func:`hf_ring.offload_checkpoints`.
- ``nccl`` (two GPUs or more): the ring on 2 GPUs against 1 (speed-up,
  exactness against the reference) and a killed rank making its peer raise
  ``CommTimeoutError`` in time.

``--hybrid`` checks and times the recurrent kernels of hybrid models instead (:mod:`bench.gpu_hybrid`).

``--fake`` runs it without a GPU, so CI runs this code: routes under
``FakeTensorMode`` with fake CUDA tensors, every other section on the CPU at
small sizes (gloo for the two-rank section).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from . import gpu_hybrid
from . import model as model_bench
from . import routes as route_check
from .common import command_line, format_table, ratio_range, rel_err, run_ranks, save, sync
from .configs import dilated_pattern

SIZES = [8192, 16384, 32768, 65536]
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
"""Worst relative error per tensor allowed against the float64 reference."""

EXACT_CASES: Dict[str, Dict] = {
    "dense causal": {},
    "non-causal": {"causal": False},
    "sliding window": {"window": 37},
    "grouped-query 8/2": {"heads": (8, 2)},
    "multi-query 8/1": {"heads": (8, 1)},
    "dilated": {"pattern": {"segment_lengths": [128, 256, 512], "dilation_rates": [1, 2, 4]}},
    "padded keys": {"pad": 100},
    "packed documents": {"documents": (1, 37, 300, 91)},
    "soft-capping": {"softcap": 20.0},
    "sinks": {"sinks": True},
}

TABLES = {
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
    **gpu_hybrid.TABLES,
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def load_reference() -> ModuleType:
    """``tests/reference.py`` of this checkout: the float64 reference, which shares no code with hf_ring."""
    path = Path(__file__).resolve().parents[1] / "tests" / "reference.py"
    if not path.exists():
        raise SystemExit(f"bench gpu measures against {path}, which is not there: run it from a checkout of hf_ring "
                         "installed with pip install --no-deps -e .")
    spec = importlib.util.spec_from_file_location("hf_ring_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _position_ids(lengths, n: int) -> torch.Tensor:
    row = [i for length in lengths for i in range(length)]
    row += list(range(n - len(row)))
    return torch.tensor(row[:n])


def exact_case(R: ModuleType, spec: Dict, dtype: torch.dtype, n: int, device: str) -> Dict:
    """Worst relative error per tensor of one block kind's ring_attention against the reference."""
    import hf_ring

    hq, hkv = spec.get("heads", (8, 2))
    b, d = 2, 64
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, n, d, generator=g)
    causal, window, pattern = spec.get("causal", True), spec.get("window"), spec.get("pattern")
    kw: Dict = {"causal": causal, "window": window, "pattern": pattern, "softcap": spec.get("softcap")}
    branches = None if pattern is None else tuple(zip(pattern["segment_lengths"], pattern["dilation_rates"]))
    positions = torch.arange(n).expand(b, n)
    if "documents" in spec:
        positions = _position_ids(spec["documents"], n).expand(b, n)
        kw["position_ids"] = positions.to(device)
    bias = R.packed_bias(positions, hq, causal=causal, window=window, branches=branches)
    if spec.get("pad"):
        key_mask = torch.ones(b, n, dtype=torch.bool)
        key_mask[0, : spec["pad"]] = False
        bias[0, :, :, : spec["pad"]] = float("-inf")
        kw["key_mask"] = key_mask.to(device)
    sinks = torch.randn(hq, generator=g) if spec.get("sinks") else None
    ref_kw = {"bias": bias, "softcap": spec.get("softcap")}
    if sinks is None:
        ref = R.with_grads(lambda q, k, v: R.attention(q, k, v, **ref_kw), q.to(device), k.to(device), v.to(device),
                           dout.to(device))
    else:
        ref = R.with_grads_sinks(lambda q, k, v, sinks: R.attention(q, k, v, sinks=sinks, **ref_kw), q.to(device),
                                 k.to(device), v.to(device), sinks.to(device), dout.to(device))
    leaves = [t.to(device=device, dtype=dtype).requires_grad_(True) for t in (q, k, v)]
    if sinks is not None:
        kw["sinks"] = sinks.to(device).requires_grad_(True)
    out = hf_ring.ring_attention(*leaves, **kw)
    out.backward(dout.to(device=device, dtype=dtype))
    got = [out.detach()] + [t.grad for t in leaves] + ([kw["sinks"].grad] if sinks is not None else [])
    errs = {name: rel_err(x, r) for name, x, r in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref)}
    return errs


def exact(R: ModuleType, n: int, device: str, dtypes) -> List[Dict]:
    rows = []
    for name, spec in EXACT_CASES.items():
        for dtype in dtypes:
            if dtype != torch.float32 and device == "cpu" and spec.get("softcap"):
                continue
            errs = exact_case(R, spec, dtype, n, device)
            worst = max(errs.values())
            rows.append({"block": name, "dtype": str(dtype).replace("torch.", ""), "n": n,
                         "worst_rel_err": float(f"{worst:.2e}"), "worst_tensor": max(errs, key=errs.get),
                         "within": worst <= TOLERANCE[dtype], "tolerance": TOLERANCE[dtype]})
            print(format_table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def _peak_mb(fn: Callable[[], None], device: str) -> Optional[float]:
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)


def _attention_fns(n: int, device: str, dtype: torch.dtype, heads, d: int):
    """The implementations timed against each other, over one set of inputs laid out as a model's projections."""
    import hf_ring

    hq, hkv = heads
    g = torch.Generator().manual_seed(n)
    leaves = [torch.randn(1, n, h, d, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
              for h in (hq, hkv, hkv)]
    dout = torch.randn(1, hq, n, d, generator=g).to(device=device, dtype=dtype)

    def sdpa(q, k, v):
        if device.startswith("cuda"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    fns = {"sdpa (flash)": sdpa, "ring_attention": lambda q, k, v: hf_ring.ring_attention(q, k, v),
           "ring_attention dilated": lambda q, k, v: hf_ring.ring_attention(q, k, v, pattern=dilated_pattern(n))}

    def views():
        return [t.transpose(1, 2) for t in leaves]

    def forward(fn):
        def run():
            with torch.no_grad():
                fn(*views())
        return run

    def forward_backward(fn):
        def run():
            fn(*views()).backward(dout)
            for t in leaves:
                t.grad = None
        return run

    return fns, forward, forward_backward


def _rounds(fns: Dict[str, Callable[[], None]], repeats: int, device: str) -> Dict[str, List[float]]:
    """Seconds of each of ``fns`` in each of ``repeats`` rounds, one call of each a round after a warm-up of each,
    so that a ratio of two is taken within a round: side by side, not one's repeats after the other's."""
    for fn in fns.values():
        fn()
    sync(device)
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def speed(sizes: List[int], repeats: int, device: str, dtype: torch.dtype, heads, d: int) -> List[Dict]:
    rows = []
    for n in sizes:
        fns, forward, forward_backward = _attention_fns(n, device, dtype, heads, d)
        runs: Dict[str, Callable] = {}
        for name, fn in fns.items():  # an implementation that runs out of memory once is left out of the rounds
            try:
                forward_backward(fn)()
                runs[name] = fn
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
        fwd = _rounds({name: forward(fn) for name, fn in runs.items()}, repeats, device)
        both = _rounds({name: forward_backward(fn) for name, fn in runs.items()}, repeats, device)
        peaks = {name: _peak_mb(forward_backward(fn), device) for name, fn in runs.items()}
        base = "sdpa (flash)"
        for name in fns:
            if name not in runs:
                rows.append({"n": n, "impl": name, "fwd_ms": "OOM", "fwd_bwd_ms": "OOM", "peak_mb": "OOM"})
                print(format_table(rows[-1:], list(rows[-1])), flush=True)
                continue
            row = {"n": n, "impl": name, "fwd_ms": round(1e3 * statistics.median(fwd[name]), 3),
                   "fwd_bwd_ms": round(1e3 * statistics.median(both[name]), 3), "peak_mb": peaks[name],
                   "rounds": repeats}
            if base in runs:
                row["fwd_over_sdpa"] = round(statistics.median(fwd[name]) / statistics.median(fwd[base]), 3)
                row["fwd_bwd_over_sdpa"] = round(statistics.median(both[name]) / statistics.median(both[base]), 3)
                row["fwd_bwd_over_sdpa_range"] = ratio_range(both[name], both[base])
                if isinstance(peaks[name], float) and isinstance(peaks[base], float) and peaks[base]:
                    row["peak_over_sdpa"] = round(peaks[name] / peaks[base], 3)
            rows.append(row)
            print(format_table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def model_steps(sizes: List[int], repeats: int, device: str, dtype: torch.dtype) -> List[Dict]:
    rows = []
    for n in sizes:
        got = model_bench.steps(n, repeats, False, device, dtype)
        sdpa, ring = (statistics.median(got["times"][i]) for i in ("sdpa", "ring_dilated"))
        rows.append({"n": n, "checkpointing": "off", "offload": "-", "sdpa_step_s": round(sdpa, 4),
                     "ring_step_s": round(ring, 4), "ring_over_sdpa": round(ring / sdpa, 3), "rounds": repeats,
                     "ring_over_sdpa_range": ratio_range(got["times"]["ring_dilated"], got["times"]["sdpa"])})
        for offload in (False, True):
            peak = model_bench.steps(n, 1, True, device, dtype, impls=("ring_dilated",), offload=offload)["peak_mb"]
            rows.append({"n": n, "checkpointing": "on", "offload": "yes" if offload else "no",
                         "ring_peak_mb": round(peak["ring_dilated"], 1) if peak else None})
        for row in rows[-3:]:
            print(format_table([row], list(row)), flush=True)
    return rows


def _two_rank_ring(n: int, exact_n: int, repeats: int, device_kind: str, dtype: torch.dtype, heads, d: int) -> Dict:
    """On each rank: the ring's forward+backward time at n, and its rows' errors against the reference."""
    import torch.distributed as dist

    import hf_ring

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = f"cuda:{torch.cuda.current_device()}" if device_kind == "cuda" else "cpu"
    hq, hkv = heads
    pos = hf_ring.local_positions(n, rank, world)
    g = torch.Generator().manual_seed(n)
    full = [torch.randn(1, n, h, d, generator=g) for h in (hq, hkv, hkv, hq)]
    leaves = [t[:, pos].to(device=device, dtype=dtype).requires_grad_(True) for t in full[:3]]
    dout = full[3][:, pos].transpose(1, 2).to(device=device, dtype=dtype)

    def step():
        hf_ring.ring_attention(*(t.transpose(1, 2) for t in leaves), seq_len=n).backward(dout)
        for t in leaves:
            t.grad = None

    if world > 1:
        dist.barrier()
    times = _rounds({"step": step}, repeats, device)["step"]
    R = load_reference()
    pos = hf_ring.local_positions(exact_n, rank, world)
    g = torch.Generator().manual_seed(exact_n)
    q, k, v, do = (torch.randn(1, h, exact_n, d, generator=g) for h in (hq, hkv, hkv, hq))
    ref = R.with_grads(R.dense_attention, q.to(device), k.to(device), v.to(device), do.to(device))
    mine = [t[:, :, pos].to(device).requires_grad_(True) for t in (q, k, v)]
    out = hf_ring.ring_attention(*mine, seq_len=exact_n)
    out.backward(do[:, :, pos].to(device))
    errs = [rel_err(got, r[:, :, pos]) for got, r in zip([out.detach()] + [t.grad for t in mine], ref)]
    return {"times": times, "max_rel_err": max(errs)}


def _killed_peer(timeout_s: float, device_kind: str) -> Dict:
    """Rank 1 dies before the ring; rank 0 reports what it raised and how long that took."""
    import torch.distributed as dist

    import hf_ring

    os.environ["HF_RING_TIMEOUT"] = str(timeout_s)
    rank = dist.get_rank()
    device = f"cuda:{torch.cuda.current_device()}" if device_kind == "cuda" else "cpu"
    q = torch.randn(1, 4, 512, 64, device=device)
    dist.barrier()
    if rank == 1:
        os._exit(0)
    t0 = time.perf_counter()
    try:
        hf_ring.ring_attention(q, q, q, seq_len=1024)
        raised = "nothing"
    except Exception as err:  # what a survivor sees is what is reported
        raised = type(err).__name__
    return {"raised": raised, "seconds": round(time.perf_counter() - t0, 2)}


def nccl(sizes: List[int], repeats: int, backend: str, dtype: torch.dtype, heads, d: int, exact_n: int,
         timeout_s: float) -> List[Dict]:
    kind = "cuda" if backend == "nccl" else "cpu"
    rows = []
    for n in sizes:
        one = run_ranks(1, _two_rank_ring, n, exact_n, repeats, kind, dtype, heads, d, exact_peak=False,
                        backend=backend)
        two = run_ranks(2, _two_rank_ring, n, exact_n, repeats, kind, dtype, heads, d, exact_peak=False,
                        backend=backend)
        t1 = statistics.median(one[0]["times"])
        t2 = statistics.median([max(ts) for ts in zip(*(r["times"] for r in two))])
        rows.append({"n": n, "ranks": 2, "backend": backend, "fwd_bwd_s_1": round(t1, 4), "fwd_bwd_s_2": round(t2, 4),
                     "speedup": round(t1 / t2, 3),
                     "max_rel_err_fp32": float(f"{max(r['max_rel_err'] for r in two):.2e}")})
        print(format_table(rows[-1:], list(rows[-1])), flush=True)
    killed = _run_killed(timeout_s, backend, kind)
    rows.append({"n": 1024, "ranks": 2, "backend": backend, "killed_peer": killed["raised"],
                 "raised_after_s": killed["seconds"], "timeout_s": timeout_s})
    print(format_table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def _run_killed(timeout_s: float, backend: str, kind: str) -> Dict:
    """Only rank 0 reports: rank 1 is the one that dies."""
    import tempfile

    import torch.multiprocessing as mp

    from .common import _entry

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(r, 2, init, _killed_peer, (timeout_s, kind), results, backend))
                 for r in range(2)]
        for p in procs:
            p.start()
        rank, got = results.get(timeout=timeout_s + 300)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def main(argv=None) -> None:
    if "--hybrid" in (sys.argv[1:] if argv is None else argv):
        gpu_hybrid.main(argv)
        return
    ap = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fake", action="store_true", help="no GPU: fake CUDA routes, the rest on the CPU at small sizes")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help=f"speed sizes (default {SIZES})")
    ap.add_argument("--model-sizes", type=int, nargs="+", default=None, help="model step sizes (default 8192 32768)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sections", nargs="+", default=["routes", "exact", "speed", "model", "nccl"])
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    command = command_line("gpu", argv)
    if not args.fake and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or pass --fake to run this code on the CPU")
    fake = args.fake
    device = "cpu" if fake else "cuda"
    where = "fake CUDA (FakeTensorMode, CPU)" if fake else torch.cuda.get_device_name()
    config = {"device": where, "torch": torch.__version__, "fake": fake}
    if "routes" in args.sections:
        rows = route_check.routes(fake=fake)
        for row in rows:
            row["checked_on"] = "fake CUDA tensors" if fake else "GPU"
        print(format_table(rows, list(rows[0])), flush=True)
        save(args.out, "gpu_routes", {"config": config, "rows": rows}, command=command)
    if "exact" in args.sections:
        dtypes = [torch.float32] if fake else [torch.float32, torch.bfloat16, torch.float16]
        rows = exact(load_reference(), 200 if fake else 1500, device, dtypes)
        save(args.out, "gpu_exact", {"config": config, "rows": rows}, command=command)
    dtype, heads, d = (torch.float32, (4, 2), 64) if fake else (torch.bfloat16, (HEADS, KV_HEADS), HEAD_DIM)
    if "speed" in args.sections:
        sizes = args.sizes or ([256, 512] if fake else SIZES)
        rows = speed(sizes, 1 if fake else args.repeats, device, dtype, heads, d)
        save(args.out, "gpu_speed", {"config": {**config, "heads": heads, "head_dim": d, "dtype": str(dtype)},
                                     "rows": rows}, command=command)
    if "model" in args.sections:
        sizes = args.model_sizes or ([128] if fake else [8192, 32768])
        rows = model_steps(sizes, 1 if fake else args.repeats, device, dtype)
        save(args.out, "gpu_model", {"config": config, "rows": rows}, command=command)
    gpus = 0 if fake else torch.cuda.device_count()
    if "nccl" in args.sections and (fake or gpus >= 2):
        sizes = [256] if fake else [16384, 32768]
        rows = nccl(sizes, 1 if fake else args.repeats, "gloo" if fake else "nccl", torch.float32 if fake else dtype,
                    heads, d, 128 if fake else 1024, 5.0 if fake else 20.0)
        save(args.out, "gpu_nccl", {"config": config, "rows": rows}, command=command)
    elif "nccl" in args.sections:
        print(f"nccl: {gpus} GPU here; the two-rank section needs 2", flush=True)
