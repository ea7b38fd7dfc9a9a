"""A pool of gloo ranks started once and reused by many test cases.

Spawning a rank costs seconds (importing torch), so a test module starts one
pool per world size and sends it picklable functions to run on every rank.
Every wait is bounded: a hang fails the test instead of stalling the suite.
"""
from __future__ import annotations

import os
import queue
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

RESULT_TIMEOUT_S = float(os.environ.get("HF_RING_TEST_TIMEOUT", "180"))
COMM_TIMEOUT_S = os.environ.get("HF_RING_TEST_COMM_TIMEOUT", "30")
"""Per-wait bound inside the ranks; raise it on a machine busy with other work."""


OWN_DEPRECATIONS = (FutureWarning, DeprecationWarning)
"""Warning kinds that are errors when raised from hf_ring's frames or the tests', in the ranks as under pytest
(pyproject)."""
OWN_MODULES = ("hf_ring", "(test_|.*cases|sweep|models|helpers|reference|dist_pool|launched_step)")


def error_on_own_deprecations() -> None:
    import warnings

    for category in OWN_DEPRECATIONS:
        for module in OWN_MODULES:
            warnings.filterwarnings("error", category=category, module=module)


class RankError(RuntimeError):
    pass


def _worker(rank, world_size, init_file, sys_path, tasks, results):
    sys.path[:] = sys_path
    os.environ["HF_RING_TIMEOUT"] = COMM_TIMEOUT_S
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    error_on_own_deprecations()
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=float(COMM_TIMEOUT_S)),
    )
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException as err:  # report every failure, keep serving
            results.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._dir.name, "init")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, list(sys.path), self._tasks[r], self._results),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run_raw(self, fn, *args, **kwargs):
        """Run ``fn`` on every rank; returns ``[(ok, result_or_traceback)]`` by rank."""
        if self.broken:
            raise RankError("the rank pool is broken by an earlier failure")
        for t in self._tasks:
            t.put((fn, args, kwargs))
        got = {}
        while len(got) < self.world_size:
            try:
                rank, ok, res = self._results.get(timeout=RESULT_TIMEOUT_S)
            except queue.Empty:
                self.broken = True
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                raise RankError(f"ranks did not answer within {RESULT_TIMEOUT_S}s (dead ranks: {dead})")
            got[rank] = (ok, res)
        return [got[r] for r in range(self.world_size)]

    def run(self, fn, *args, **kwargs):
        """Run ``fn`` on every rank and return the results by rank; raise if any rank raised."""
        res = self.run_raw(fn, *args, **kwargs)
        errors = [f"rank {r}: {msg}" for r, (ok, msg) in enumerate(res) if not ok]
        if errors:
            # A rank that failed mid-exchange leaves the group out of step: start afresh next time.
            self.broken = True
            raise RankError("\n".join(errors))
        return [r for _, r in res]

    def close(self):
        for t in self._tasks:
            t.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._dir.cleanup()


def _once_worker(rank, world_size, init_file, sys_path, env, fn, args, results, release):
    sys.path[:] = sys_path
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A long group timeout: only hf_ring's own bound (HF_RING_TIMEOUT in env) may end a wait here.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=3600))
    try:
        results.put((rank, True, fn(*args)))
    except BaseException as err:
        results.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    # Stay alive (and connected) until every rank has answered, so a survivor's wait is
    # ended by the bound, not by its peers exiting.
    release.wait(RESULT_TIMEOUT_S)
    os._exit(0)  # the group may be broken: skip its teardown


def run_once(world_size: int, fn, *args, env=None, deadline_s: float = RESULT_TIMEOUT_S):
    """Run ``fn(*args)`` on ``world_size`` fresh gloo ranks (not a pool) and return ``{rank: (ok, result)}``.

    Ranks that die without answering (e.g. killed on purpose) are missing from
    the result; the second value is ``{rank: exit code}`` of those. Every wait
    is bounded by ``deadline_s``; all processes are gone when this returns.
    """
    ctx = mp.get_context("forkserver")
    # Fresh processes forked from one server that imported these once: a start costs
    # milliseconds instead of the seconds importing torch and transformers takes.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "hf_ring", __name__, fn.__module__])
    results, release = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_once_worker, daemon=True,
                        args=(r, world_size, init_file, list(sys.path), dict(env or {}), fn, args, results, release))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        got, end = {}, time.monotonic() + deadline_s
        try:
            while True:
                dead = {r for r, p in enumerate(procs) if p.exitcode is not None and r not in got}
                if len(got) + len(dead) == world_size:
                    break
                if time.monotonic() > end:
                    raise RankError(f"ranks {sorted(set(range(world_size)) - set(got) - dead)} did not answer "
                                    f"within {deadline_s}s")
                try:
                    rank, ok, res = results.get(timeout=0.2)
                    got[rank] = (ok, res)
                except queue.Empty:
                    pass
        finally:
            release.set()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
        return got, {r: p.exitcode for r, p in enumerate(procs) if r not in got}
