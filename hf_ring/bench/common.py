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
