"""Shared plumbing for the benchmarks: fresh processes, timing, peak memory, output files."""
from __future__ import annotations

import contextlib
import json
import os
import queue
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def commit(root: str) -> str:
    """The checkout's commit, short, with ``+changes`` when tracked files other than the benchmarks' own results
    (``docs/bench``, which the runs themselves rewrite) differ from it. A tree copied to another machine (a
    cluster's node, a lent GPU) says the commit it was copied from with ``$BENCH_COMMIT``, since its own git, if
    any, need not be the one the copy was made from; without git it says ``unknown``."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)docs/bench"], cwd=root, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    if run.returncode != 0 or not run.stdout.strip():
        return "unknown"
    return run.stdout.strip() + ("+changes" if dirty else "")


def device_name() -> str:
    """What a row ran on: the GPU's name, or the CPU's core count."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({os.cpu_count()} cores)"


def sync(device: str) -> None:
    """Wait for ``device``'s queued work (a GPU's), so that a time or a peak covers it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rel_err(got, ref) -> float:
    """A tensor's (or array's) worst relative error: ``max|got - ref| / max|ref|``, in float64 on ``got``'s device;
    0 where both are zero, inf where only ``ref`` is."""
    got = torch.as_tensor(got).double()
    ref = torch.as_tensor(ref).to(device=got.device, dtype=torch.float64)
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    return diff / scale if scale else (0.0 if diff == 0.0 else float("inf"))


def rss_mb() -> float:
    """Current resident set size of this process in MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """High-water mark of this process's resident set size in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn: Callable[[], None], repeats: int, barrier: Optional[Callable[[], None]] = None) -> List[float]:
    """Seconds of ``repeats`` timed calls of ``fn``, after one untimed warm-up call at the same size.

    Every configuration of every benchmark is timed this way, so none is
    favoured by a warm-up the others lack. ``barrier`` lines the ranks up
    before each call.
    """
    fn()
    times = []
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def split_for(attn: str) -> Iterator[Tuple[int, Callable]]:
    """In a benchmark's rank: the world size, and how a batch reaches a model on ``attn``: through
    ``hf_ring.shard_batch`` for ``ring_dilated`` (the sequence split over every rank), as it is otherwise."""
    import hf_ring

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        hf_ring.setup_sequence_parallel(None)
    try:
        yield world, (hf_ring.shard_batch if attn == "ring_dilated" else dict)
    finally:
        hf_ring.clear_sequence_parallel()


def token_row(vocab: int, length: int) -> Dict[str, torch.Tensor]:
    """One row of ``length`` random tokens below ``vocab`` (seeded by the length), its own labels."""
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))
    return {"input_ids": ids, "labels": ids}


def loss_step(model: torch.nn.Module, split: Callable, data: Dict[str, torch.Tensor]) -> None:
    """One training step's forward and backward of ``model``'s loss on ``split(data)``, gradients dropped after."""
    model(**split(data)).loss.backward()
    model.zero_grad(set_to_none=True)


def timed_steps(model: torch.nn.Module, split: Callable, warm: Dict[str, torch.Tensor],
                data: Dict[str, torch.Tensor], repeats: int) -> Dict:
    """One rank's loss steps: one on ``warm`` (kernels, threads and the allocator warmed), an untimed one on
    ``data``, then ``repeats`` timed ones, each after a barrier when the sequence is split; their times and the
    peak memory above what the warm step left."""
    loss_step(model, split, warm)
    base = rss_mb()
    loss_step(model, split, data)
    times = []
    for _ in range(repeats):
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss_step(model, split, data)
        times.append(time.perf_counter() - t0)
    return {"steps": times, "peak_mb": peak_rss_mb() - base}


def clock(owner, name: str, label: str, spent: Dict[str, float]) -> None:
    """Replace ``owner.name`` by a wrapper that adds the seconds each call takes to ``spent[label]``.

    For the breakdowns of where a rank's time goes; only inside a benchmark's
    own worker process, whose modules are not shared with anything else.
    """
    inner = getattr(owner, name)

    def timed_call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0

    setattr(owner, name, timed_call)


def summary(per_rank: List[List[float]]) -> Dict[str, float]:
    """Median, fastest and slowest of repeated runs, each run counted at its slowest rank."""
    runs = [max(ts) for ts in zip(*per_rank)]
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": len(runs)}


def spread(stats: Dict[str, float]) -> str:
    """``min-max`` of a :func:`summary`, for tables."""
    return f"{stats['min']:.3g}-{stats['max']:.3g}"


def ratio_range(times: List[float], base: List[float]) -> str:
    """The lowest and highest ratio of ``times`` to ``base`` taken pair by pair (each pair run side by side),
    e.g. ``"0.981–1.012"``."""
    ratios = [t / b for t, b in zip(times, base)]
    return f"{min(ratios):.3f}–{max(ratios):.3f}"


def planned_ring_mb(n: int, world: int, layout: str, branches, hq: int, hkv: int, b: int, d: int, elem: int = 4,
                    shared: bool = True) -> float:
    """MiB the busiest rank of a ring sends in one forward+backward, from the schedule alone.

    ``elem``: bytes per number; ``shared=False``: as if every branch sent its own rows, including rows
    another branch already sends.
    """
    from hf_ring.engine.schedule import Geometry, rank_plan, sent

    pick = sent if shared else list
    most = 0.0
    for rank in range(world):
        plan = rank_plan(Geometry(n, world, layout, True, None, tuple(branches), hq, hkv), rank)
        kv = sum(len(p.heads) * p.rows.count for s in plan.steps for p in pick(s.send)) * b * d
        back = sum(len(p.heads) * p.rows.count for s in plan.steps[1:] for p in pick(s.recv.pieces)) * b * d
        # K and V in the forward and again in the backward, then dK and dV back.
        most = max(most, (2 * 2 * kv + 2 * back) * elem / 2**20)
    return most


def planned_mode_mb(n: int, world: int, ulysses: int, layout: str, hq: int, hkv: int, b: int, d: int,
                    elem: int = 4) -> float:
    """MiB the busiest rank sends in one causal forward+backward of one layer, in any mode, without running it.

    Head parallelism: the all-to-all pieces that leave a rank (Q, K, V to heads and the output back
    in the forward; Q, K, V, the output and dO to heads and dQ, dK, dV back in the backward), plus the ring over the
    ``world // ulysses`` groups for its share of the heads (:func:`planned_ring_mb`).
    """
    from hf_ring.engine.layout import head_split, shard_sizes

    if ulysses == 1:
        return planned_ring_mb(n, world, layout, ((n, 1),), hq, hkv, b, d, elem) if world > 1 else 0.0
    split = head_split(hq, hkv, ulysses)
    m, mk = split.q_per_rank, len(split.kv_heads(0))
    groups = world // ulysses
    ring = planned_ring_mb(n, groups, layout, ((n, 1),), m, mk, b, d, elem) if groups > 1 else 0.0
    sizes = shard_sizes(n, world, layout, ulysses)
    most = 0.0
    for rank, mine in enumerate(sizes):
        first = rank // ulysses * ulysses
        others = sum(sizes[first:first + ulysses]) - mine  # the group's rows held by other members
        out_heads = (ulysses - 1) * mine * (m + 2 * mk) + others * m  # forward: Q, K, V out, the output back
        back = (ulysses - 1) * mine * (3 * m + 2 * mk) + others * (m + 2 * mk)  # backward: Q, K, V, O, dO out; grads back
        most = max(most, (out_heads + back) * b * d * elem / 2**20)
    return most + ring


HEAD_PARALLEL = {"ulysses": lambda world: world, "hybrid": lambda world: 2}
"""Head-parallel modes of the attention benchmarks: ranks per head-parallel group for a world size."""


def measure_attention(impl: str, n: int, layout: str, b: int, h: int, d: int, repeats: int,
                      pattern: Optional[Dict] = None, what: str = "both") -> Dict:
    """Time causal attention on this rank's shard: ``impl`` is "sdpa" (one process), "ring", or a mode of
    :data:`HEAD_PARALLEL` ("ulysses": head parallelism over every rank; "hybrid": groups of 2, ring across).

    Returns the timed runs of the forward and of forward+backward (see
    :func:`timed`), the peak resident memory above the pre-input baseline,
    and the bytes this rank sent to other ranks during one forward+backward
    (counted during the warm-up call: point-to-point sends, and the pieces of
    all-to-all exchanges that leave the rank).
    """
    import torch.nn.functional as F

    import hf_ring
    from hf_ring.engine.checks import check_options
    from hf_ring.engine.layout import head_split
    from hf_ring.engine.ulysses import head_parallel

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    barrier = dist.barrier if world > 1 else None
    ulysses = HEAD_PARALLEL[impl](world) if impl in HEAD_PARALLEL else 1
    sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses, layout=layout) if ulysses > 1 else None

    def inputs(length):
        g = torch.Generator().manual_seed(0)
        rows = len(hf_ring.local_positions(length, rank, world, layout, ulysses))
        ts = [torch.randn(b, h, rows, d, generator=g) for _ in range(4)]
        return [t.requires_grad_(i < 3) for i, t in enumerate(ts)]

    def attn_fn(q, k, v, length):
        if impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if ulysses > 1:
            first = rank // ulysses * ulysses
            sizes = hf_ring.shard_sizes(length, world, layout, ulysses)[first:first + ulysses]
            spec = check_options(True, None, pattern, None, d, layout).at(seq_len=length)
            return head_parallel(q, k, v, sp.head_comm, sp.ring_comm, head_split(h, h, ulysses), sizes, spec)
        return hf_ring.ring_attention(q, k, v, layout=layout, seq_len=length, pattern=pattern)

    # Load kernels, threads and the allocator on a small problem so the memory
    # high-water mark below belongs to size n alone.
    wq, wk, wv, wdo = inputs(256)
    attn_fn(wq, wk, wv, 256).backward(wdo)
    base = rss_mb()
    q, k, v, do = inputs(n)

    def fwd():
        with torch.no_grad():
            attn_fn(q, k, v, n)

    sent: List[int] = []
    calls = []

    def fwd_bwd():
        attn_fn(q, k, v, n).backward(do)
        q.grad = k.grad = v.grad = None

    def counted_fwd_bwd():  # the first (warm-up) call counts the bytes sent
        calls.append(1)
        if world == 1 or len(calls) > 1:
            return fwd_bwd()
        p2p, a2a = dist.batch_isend_irecv, dist.all_to_all_single

        def counting_p2p(ops):
            sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return p2p(ops)

        def counting_a2a(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            me = dist.get_rank(group)
            row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
            sent.append(row * (tensor.shape[0] - input_split_sizes[me]))  # its own piece stays
            return a2a(output, tensor, output_split_sizes, input_split_sizes, group=group, **kw)

        dist.batch_isend_irecv, dist.all_to_all_single = counting_p2p, counting_a2a
        try:
            fwd_bwd()
        finally:
            dist.batch_isend_irecv, dist.all_to_all_single = p2p, a2a

    result: Dict = {}
    try:
        if what in ("both", "fwd"):
            result["fwd_runs"] = timed(fwd, repeats, barrier)
        if what in ("both", "fwd_bwd"):
            result["fwd_bwd_runs"] = timed(counted_fwd_bwd, repeats, barrier)
            result["sent_mb"] = sum(sent) / 2**20
        result["peak_mb"] = peak_rss_mb() - base
    finally:
        if sp is not None:
            hf_ring.clear_sequence_parallel()
    return result


def _entry(rank, world_size, init_file, fn, args, results, backend="gloo"):
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if world_size > 1:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=600))
    try:
        try:
            results.put((rank, fn(*args)))
        except BaseException:
            results.put((rank, _Failed(traceback.format_exc())))
            raise
    finally:
        if world_size > 1:
            import hf_ring

            hf_ring.shutdown()  # every rank's exit meets the others' (a bare destroy can abort a gloo rank at exit)


MMAP_VAR = "MALLOC_MMAP_THRESHOLD_"


def run_ranks(world_size: int, fn: Callable, *args, exact_peak: bool = True, backend: str = "gloo") -> List[Dict]:
    """Run ``fn(*args)`` in ``world_size`` fresh one-thread processes (a gloo group when > 1).

    ``backend="nccl"``: one GPU per rank (rank r on GPU r), an NCCL group.
    ``exact_peak``: glibc gets a fixed mmap threshold, so it returns large
    freed blocks at once and the resident-set high-water mark follows the
    live tensors. Every large allocation then costs fresh pages, which slows
    code that allocates many buffers (the ring's messages: ~10% at 8K on two
    ranks); runs that only time pass False and run with glibc's defaults, as
    a launched job does.
    """
    # One OpenMP thread from process start, as torchrun and accelerate launch set it, so every configuration
    # runs as a launched job does (torch.set_num_threads below limits torch's own pool only after import).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(r, world_size, init_file, fn, args, results, backend))
                 for r in range(world_size)]
        outer = os.environ.pop(MMAP_VAR, None)
        try:
            if exact_peak:
                os.environ[MMAP_VAR] = str(1 << 17)
            for p in procs:
                p.start()  # a spawned process takes the environment as it is now
        finally:
            os.environ.pop(MMAP_VAR, None)
            if outer is not None:
                os.environ[MMAP_VAR] = outer
        got = _collect(results, procs)
        for p in procs:
            p.join()
    return [got[r] for r in range(world_size)]


class _Failed(str):
    """A rank's traceback, sent in place of its result."""


def _collect(results, procs: List, timeout_s: float = 3600.0) -> Dict[int, Dict]:
    """Every rank's result; a rank that raised or died ends the run at once, with its traceback or exit code."""
    got: Dict[int, Dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(procs):
        try:
            rank, value = results.get(timeout=5)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"rank {dead[0][0]} died (exit code {dead[0][1]}) before its result" if dead
                                   else f"no result from every rank in {timeout_s:.0f} s")
            continue
        if isinstance(value, _Failed):
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        got[rank] = value
    return got


def format_table(rows: List[Dict], columns: List[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]  # no rows: headers
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(columns), sep] + [line(r) for r in cells])


def finish_figure(fig, path: str, title: Optional[str] = None) -> None:
    """Title a figure, lay it out and write it to ``path`` at the resolution every benchmark's figures share."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout the benchmarks run from, whose commit each file records."""


def command_line(bench: str, argv: Optional[List[str]]) -> str:
    """The command that runs benchmark ``bench`` with ``argv`` (None: this process's arguments, as argparse reads
    them), as a user types it."""
    return " ".join(["python -m bench", bench, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])


def save(out_dir: str, name: str, payload: Dict, plot: Optional[Callable[[str], None]] = None, *,
         command: str) -> None:
    """Write ``payload`` to ``out_dir/name.json`` (and its figure), stamped with the ``command`` that wrote it and
    the checkout's commit, so that every file in docs/bench says how to make it again."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path + ".part", "w") as f:  # a run stopped mid-write leaves the last whole file, not half of one
        json.dump({**payload, "command": command, "commit": commit(ROOT)}, f, indent=2)
    os.replace(path + ".part", path)
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            plot(os.path.join(out_dir, f"{name}.png"))
        except ImportError:
            print("matplotlib is not installed; skipped the PNG (pip install hf-ring[bench])")
