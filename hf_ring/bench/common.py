"""Shared plumbing for the benchmarks: fresh processes, timing, peak memory, output files."""
from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch
import torch.multiprocessing as mp


def rss_mb() -> float:
    """Current resident set size of this process in MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """High-water mark of this process's resident set size in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best_time(fn: Callable[[], None], repeats: int) -> float:
    """Fastest of ``repeats`` runs, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_attention(impl: str, n: int, layout: str, b: int, h: int, d: int, repeats: int,
                      pattern: Optional[Dict] = None, what: str = "both") -> Dict:
    """Time causal attention on this rank's shard: ``impl`` is "sdpa" (one process) or "ring".

    Returns the fastest forward and forward+backward times, the peak resident
    memory above the pre-input baseline, and the bytes this rank sent
    point-to-point during one forward+backward.
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    import hf_ring

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def inputs(length):
        g = torch.Generator().manual_seed(0)
        rows = len(hf_ring.local_positions(length, rank, world, layout))
        ts = [torch.randn(b, h, rows, d, generator=g) for _ in range(4)]
        return [t.requires_grad_(i < 3) for i, t in enumerate(ts)]

    def attn_fn(q, k, v, length):
        if impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return hf_ring.ring_attention(q, k, v, layout=layout, seq_len=length, pattern=pattern)

    # Warm up kernels, threads and the allocator on a small problem so the
    # timings and the memory high-water mark below belong to size n alone.
    wq, wk, wv, wdo = inputs(256)
    attn_fn(wq, wk, wv, 256).backward(wdo)
    base = rss_mb()
    q, k, v, do = inputs(n)

    def attn():
        return attn_fn(q, k, v, n)

    def fwd():
        with torch.no_grad():
            attn()

    def fwd_bwd():
        attn().backward(do)
        q.grad = k.grad = v.grad = None

    result = {}
    if what in ("both", "fwd"):
        if world > 1:
            dist.barrier()
        result["fwd_s"] = best_time(fwd, repeats)
    if what in ("both", "fwd_bwd"):
        if world > 1:
            dist.barrier()
        sent = []
        if world > 1:
            original = dist.batch_isend_irecv

            def counting(ops):
                sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
                return original(ops)

            dist.batch_isend_irecv = counting
            fwd_bwd()
            dist.batch_isend_irecv = original
        result["fwd_bwd_s"] = best_time(fwd_bwd, repeats)
        result["sent_mb"] = sum(sent) / 2**20
    result["peak_mb"] = peak_rss_mb() - base
    return result



def _entry(rank, world_size, init_file, fn, args, results):
    torch.set_num_threads(1)
    if world_size > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=600))
    try:
        results.put((rank, fn(*args)))
    finally:
        if world_size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args) -> List[Dict]:
    """Run ``fn(*args)`` in ``world_size`` fresh one-thread processes (a gloo group when > 1)."""
    # A fixed mmap threshold makes glibc return large freed blocks at once, so
    # the resident-set high-water mark follows the live tensors.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 17))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(r, world_size, init_file, fn, args, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=3600) for _ in range(world_size))
        for p in procs:
            p.join()
    return [got[r] for r in range(world_size)]


def format_table(rows: List[Dict], columns: List[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(columns), sep] + [line(r) for r in cells])


def save(out_dir: str, name: str, payload: Dict, plot: Optional[Callable[[str], None]] = None) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(payload, f, indent=2)
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            plot(os.path.join(out_dir, f"{name}.png"))
        except ImportError:
            print("matplotlib is not installed; skipped the PNG (pip install hf-ring[bench])")
