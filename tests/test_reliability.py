"""Every wait is bounded, a dead rank makes every survivor raise, and gradients are synchronised exactly."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import hf_ring
import hf_ring.engine.comm as comm
from attention_cases import make_qkv
from helpers import raises_on_rank
from dist_pool import run_once

FAULT_TIMEOUT_S = 5.0
# A survivor may first finish the compute it had queued; a loaded machine slows that down.
SLACK_S = 30.0


# --- HF_RING_TIMEOUT -------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "0", "-3", "abc", "1e400", "5s"])
def test_unusable_timeouts_are_refused(monkeypatch, raw):
    monkeypatch.setenv("HF_RING_TIMEOUT", raw)
    with pytest.raises(ValueError, match="HF_RING_TIMEOUT"):
        comm.comm_timeout()


@pytest.mark.parametrize("raw,want", [("", 600.0), ("2.5", 2.5), (" 30 ", 30.0), ("1e-3", 1e-3)])
def test_usable_timeouts(monkeypatch, raw, want):
    monkeypatch.setenv("HF_RING_TIMEOUT", raw)
    assert comm.comm_timeout() == want


def bad_timeout_case(what):
    """Call an hf_ring entry point with HF_RING_TIMEOUT=nan on every rank (set after the setup, except for "setup")."""
    saved = os.environ["HF_RING_TIMEOUT"]
    sp = None if what in ("ring", "setup") else hf_ring.setup_sequence_parallel(None)
    os.environ["HF_RING_TIMEOUT"] = "nan"
    try:
        if what == "ring":
            q = torch.randn(1, 2, 4, 8)
            return raises_on_rank(hf_ring.ring_attention, q, q, q)
        if what == "setup":
            return raises_on_rank(hf_ring.setup_sequence_parallel, None)
        model = torch.nn.Linear(2, 2)
        model.weight.grad = torch.ones(2, 2)
        if what == "sync":
            return raises_on_rank(hf_ring.sync_gradients, model, sp)
        return raises_on_rank(hf_ring.gather_sequence, torch.zeros(1, 2, 3), 4, 1, sp)
    finally:
        os.environ["HF_RING_TIMEOUT"] = saved
        hf_ring.clear_sequence_parallel()


@pytest.mark.parametrize("what", ["ring", "setup", "sync", "gather"])
def test_bad_timeout_is_refused_on_every_rank_before_any_wait(pools, what):
    for err in pools(2).run(bad_timeout_case, what):
        assert err is not None and err[0] == "ValueError" and "HF_RING_TIMEOUT='nan'" in err[1]


# --- the host-side watchdog used for NCCL (no GPU needed: a stand-in for its Work object) ---------------


class FakeWork:
    """Completes after ``polls`` queries of ``is_completed``; like NCCL's, its ``wait()`` never blocks the host."""

    def __init__(self, polls, error=None):
        self.polls, self.error, self.waited = polls, error, False

    def is_completed(self):
        self.polls -= 1
        return self.polls < 0

    def wait(self, timeout=None):
        self.waited = True
        if self.error:
            raise RuntimeError(self.error)
        return True


def test_watchdog_waits_for_completion_then_joins_the_stream():
    work = FakeWork(polls=5)
    comm.wait(work, "a test collective", 5.0, "nccl")
    assert work.waited and work.polls < 0


def test_watchdog_raises_at_the_deadline():
    work = FakeWork(polls=10**9)
    t0 = time.monotonic()
    with pytest.raises(comm.CommTimeoutError, match="a test collective .* within 0.3 s .*HF_RING_TIMEOUT"):
        comm.wait(work, "a test collective", 0.3, "nccl")
    assert 0.3 <= time.monotonic() - t0 < 5.0 and not work.waited


def test_watchdog_reports_a_recorded_backend_error():
    with pytest.raises(comm.CommTimeoutError, match="NCCL error: remote process exited"):
        comm.wait(FakeWork(polls=0, error="NCCL error: remote process exited"), "a test collective", 5.0, "nccl")


def test_a_finished_gloo_collective_waits_until_gloo_lets_go_of_its_tensors(monkeypatch):
    """gloo's worker thread drops a work's tensors just after marking it done; a collective returns only after that
    (a reference a thread drops while the interpreter exits aborts the process). A view held by another thread for
    50 ms stands in for the worker's reference."""
    import threading

    t = torch.ones(8)
    before = t._use_count()
    held = [t.view(2, 4)]  # the work's reference
    handed = comm._Handed([t])
    threading.Timer(0.05, held.clear).start()
    started = time.monotonic()
    assert handed.released("gloo")
    assert t._use_count() == before and time.monotonic() - started >= 0.04
    # other backends keep their own references as they see fit: nothing to wait for; a reference never dropped
    # is waited for only up to the bound
    held.append(t.view(2, 4))
    handed = comm._Handed([t])
    started = time.monotonic()
    handed.released("nccl")
    assert time.monotonic() - started < 0.01
    monkeypatch.setattr(comm, "_RELEASE_S", 0.05)
    assert not handed.released("gloo")
    assert 0.05 <= time.monotonic() - started < 1.0


HELD_S = 30.0
"""How long a collective's tensors may stay held past the bound before the test calls them kept: a starved worker
thread on a busy machine lets go late, a reference that keeps the work standing never does."""


def collectives_case(rounds: int = 40) -> int:
    """Every kind of collective hf_ring makes, ``rounds`` times: how often one returned while gloo still held one
    of its tensors, or waited for gloo to let go until its bound passed and gloo still held them long after (a
    reference of its own kept the work standing: every step would stall for the bound)."""
    world = dist.get_world_size()
    comm_ = comm.RingComm(None)
    late = 0
    released = comm._Handed.released

    def counted(self, backend):
        nonlocal late
        ok = released(self, backend)
        if not ok and late:
            late += 1
        elif not ok:  # the bound passed: a late worker thread lets go within HELD_S, a kept work object never
            deadline = time.monotonic() + HELD_S
            while any(t._use_count() >= n for t, n in zip(self.tensors, self.counts)):
                if time.monotonic() >= deadline:
                    late += 1
                    break
                time.sleep(0.01)
        return ok

    comm._Handed.released = counted  # a spy in this rank's process: it counts the bounds that passed
    try:
        for i in range(rounds):
            t = torch.full((4, 3), float(i + dist.get_rank()))
            out = torch.empty_like(t)
            before = t._use_count(), out._use_count()
            comm_.all_reduce(t, "a test all-reduce")
            gathered = comm_.all_gather(t, "a test all-gather")
            comm_.broadcast(t, 0, "a test broadcast")
            comm_.all_to_all(out, t, [4 // world] * world, [4 // world] * world, "a test all-to-all")
            late += (t._use_count(), out._use_count()) != before
            pending = comm_.post_all_to_all(out, t, [4 // world] * world, [4 // world] * world, "a test all-to-all")
            [received] = pending.wait()
            late += (t._use_count(), out._use_count()) != before
            del gathered, received, pending
            if late:  # one is enough, and each kept one costs HELD_S
                break
    finally:
        comm._Handed.released = released
    return late


def test_every_collective_returns_with_its_tensors_released(pools):
    assert pools(2).run(collectives_case) == [0, 0]


# --- sync_gradients against an independent computation ---------------------------------------------------


def _grad_value(shape, dtype, rank, salt):
    """A rank's gradient: small integers, so every sum and the division by dp are exact in floating point."""
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n) * (rank + 3) + salt) % 17 - 8).to(dtype).reshape(shape)


SHAPES = {"a": ((3, 4), torch.float32), "b": ((5,), torch.float64), "c": ((700,), torch.float32),
          "d": ((2,), torch.float32), "e": ((2,), torch.float32), "frozen": ((2,), torch.float32)}


def sync_case(sp_size, bucket_bytes):
    """Gradients after ``sync_gradients``, and how many all-reduces it issued.

    ``d`` has a gradient on global rank 0 only, ``e`` on no rank, ``frozen`` does not require one.
    """
    rank = dist.get_rank()
    hf_ring.setup_sequence_parallel(None, sp_size)
    model = torch.nn.Module()
    for i, (name, (shape, dtype)) in enumerate(SHAPES.items()):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=name != "frozen")
        setattr(model, name, p)
        if name in ("a", "b", "c") or (name == "d" and rank == 0):
            p.grad = _grad_value(shape, dtype, rank, i)
    calls, real = [], comm.all_reduce

    def counting(tensor, group, what, **kw):
        calls.append((what, tensor.numel()))
        return real(tensor, group, what, **kw)

    comm.all_reduce = counting  # a spy: it counts the collectives and passes them on
    try:
        hf_ring.sync_gradients(model, bucket_bytes=bucket_bytes)
    finally:
        comm.all_reduce = real
        hf_ring.clear_sequence_parallel()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return {"grads": grads, "calls": calls}


def expected_grads(world, dp):
    """Sum over the sp group, mean over dp groups: the sum over every rank divided by dp."""
    out = {}
    for i, (name, (shape, dtype)) in enumerate(SHAPES.items()):
        if name in ("a", "b", "c"):
            out[name] = sum(_grad_value(shape, dtype, r, i) for r in range(world)) / dp
        elif name == "d":
            out[name] = _grad_value(shape, dtype, 0, i) / dp
        else:
            out[name] = None
    return out


@pytest.mark.parametrize("world,sp_size,bucket_bytes,buckets", [
    (2, 2, 25 * 2**20, 2),  # one float32 and one float64 bucket
    (4, 2, 25 * 2**20, 2),
    (4, 2, 1024, 4),  # a (48 B) | c (2800 B, alone) | d, and b (float64)
    (4, 1, 1024, 4),  # data parallel only
])
def test_sync_gradients_sum_over_sp_mean_over_dp(pools, world, sp_size, bucket_bytes, buckets):
    dp = world // sp_size
    want = expected_grads(world, dp)
    for res in pools(world).run(sync_case, sp_size, bucket_bytes):
        for name, w in want.items():
            got = res["grads"][name]
            if w is None:
                assert got is None, name
            else:
                assert got.dtype == w.dtype and torch.equal(got, w), name  # integers: exact
        groups = (sp_size > 1) + (dp > 1)
        assert len(res["calls"]) == groups * (1 + buckets), res["calls"]  # presence flags, then one per bucket


# --- a rank that never joins: the bound ends the wait -----------------------------------------------------


def absent_peer_case(what):
    """Rank 1 sets up and then never joins; rank 0 calls ``what`` and reports how it ended."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from models import tiny_config

    hf_ring.setup_sequence_parallel(None, 2)
    if dist.get_rank() == 1:
        return None
    t0 = time.monotonic()
    if what == "sync":
        model = torch.nn.Linear(2, 2)
        model.weight.grad = torch.ones(2, 2)
        err = raises_on_rank(hf_ring.sync_gradients, model)
    elif what == "gather":
        err = raises_on_rank(hf_ring.gather_sequence, torch.zeros(1, 2, 3), 4)
    else:
        rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        emb = LlamaRotaryEmbedding(tiny_config(max_position_embeddings=16, rope_parameters=rope,
                                                attn_implementation="ring_dilated"))
        err = raises_on_rank(emb, torch.zeros(1, 4, 64), torch.arange(4).view(1, 4))
    return err, time.monotonic() - t0


@pytest.mark.parametrize("what", ["sync", "gather", "rope"])
def test_absent_peer_ends_in_comm_timeout(what):
    got, died = run_once(2, absent_peer_case, what, env={"HF_RING_TIMEOUT": str(FAULT_TIMEOUT_S)})
    assert not died and got[1] == (True, None), (got, died)
    ok, (err, elapsed) = got[0]
    assert ok and err is not None and err[0] == "CommTimeoutError" and "HF_RING_TIMEOUT" in err[1], err
    assert FAULT_TIMEOUT_S * 0.9 <= elapsed <= FAULT_TIMEOUT_S + SLACK_S, elapsed


# --- a rank killed mid-forward or mid-backward ------------------------------------------------------------


def ring_with_killed_rank(victim, phase, n):
    """Ring attention forward and backward; ``victim`` SIGKILLs itself at its second kernel call of ``phase``."""
    import hf_ring.engine.ring as ring

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == victim:
        name = "block_forward" if phase == "forward" else "block_backward"
        kernel, calls = getattr(ring, name), []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return kernel(*args, **kwargs)

        setattr(ring, name, dying)
    q, k, v, dout = make_qkv(0, 1, 2, 2, n, 16)
    pos = hf_ring.local_positions(n, rank, world, "zigzag")
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    t0 = time.monotonic()
    # Many small messages, so the ring is mid-flight when the victim dies.
    err = raises_on_rank(lambda: hf_ring.ring_attention(ql, kl, vl, message_rows=32).backward(dout[:, :, pos]))
    return err, time.monotonic() - t0


@pytest.mark.parametrize("world,victim", [(2, 1), (3, 1)])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_killed_rank_makes_every_survivor_raise(world, victim, phase):
    got, died = run_once(world, ring_with_killed_rank, victim, phase, 2048,
                         env={"HF_RING_TIMEOUT": str(FAULT_TIMEOUT_S)})
    assert died == {victim: -signal.SIGKILL}, (got, died)
    assert sorted(got) == [r for r in range(world) if r != victim]
    for rank, (ok, res) in got.items():
        assert ok, res
        err, elapsed = res
        assert err is not None, f"rank {rank} finished although rank {victim} died"
        assert err[0] == "CommTimeoutError" and "HF_RING_TIMEOUT" in err[1], (rank, err)
        assert elapsed <= FAULT_TIMEOUT_S + SLACK_S, (rank, elapsed)


def test_a_relayed_error_names_the_ranks_that_failed_the_same_way():
    """Pure: the rows every rank sees after the exchange, raised on each rank with one message naming the ranks."""
    from hf_ring.engine.relay import error_row, raise_first

    bad = ValueError("labels must have the shape (2, 37)")
    rows = [error_row(None), error_row(bad), error_row(bad), error_row(TypeError("another"))]
    with pytest.raises(ValueError) as seen:
        raise_first(rows, 0)  # rank 0 did not fail: it raises the first failure, naming every rank that had it
    assert str(seen.value).startswith("ranks 1 and 2: labels must") and "rank 3 failed with another error" in str(
        seen.value)
    assert seen.value.__cause__ is None and seen.value.__suppress_context__
    with pytest.raises(TypeError, match="^rank 3: another"):
        raise_first(rows, 3, TypeError("another"))  # a rank that failed raises its own, under its own rank
    raise_first([error_row(None)] * 3, 1)  # nobody failed: nothing raised


# --- ranks that share a GPU: gloo carries its tensors through host copies -----------------------------------


def through_host_case(case, *args, **kwargs):
    """``case`` with every gloo transfer made through host copies, as it is for GPU tensors (the CPU's stand in):
    its result, and how many transfers were copied."""
    real, copied = comm.through_host, [0]

    def every(backend, device):
        copied[0] += backend == "gloo"
        return backend == "gloo"

    comm.through_host = every  # a stand-in in this rank's process: CPU tensors take the GPU's route
    try:
        return case(*args, **kwargs), copied[0]
    finally:
        comm.through_host = real


def collective_values_case() -> dict:
    """What each kind of collective gives on this rank, for inputs that differ by rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    comm_ = comm.RingComm(None)
    t = torch.arange(4 * world * 3, dtype=torch.float32).reshape(4 * world, 3) * (rank + 1)
    out, posted = torch.zeros_like(t), torch.zeros_like(t)
    splits = [4] * world
    comm_.all_to_all(out, t, splits, splits, "a test all-to-all")
    [arrived] = comm_.post_all_to_all(posted, t, splits, splits, "a test all-to-all").wait()
    return {"all_reduce": comm_.all_reduce(t.clone(), "a test all-reduce"),
            "all_gather": comm_.all_gather(t, "a test all-gather"),
            "broadcast": comm_.broadcast(t.clone(), 1, "a test broadcast"),
            "all_to_all": out, "post_all_to_all": posted, "arrived": arrived}


@pytest.mark.parametrize("world,ulysses", [(2, None), (4, 2)])
def test_transfers_through_host_copies_give_the_same_bits(pools, world, ulysses):
    """Ranks sharing one GPU run over gloo, which takes GPU tensors only through host copies: the ring's exchanges,
    the all-to-alls of head-parallel attention and every collective give exactly what direct transfers give."""
    from attention_cases import head_parallel_case, ring_case

    case, kw = (ring_case, {"pad": 5}) if ulysses is None else (head_parallel_case, {"ulysses": ulysses, "pad": 5})
    direct = pools(world).run(case, 3, 2, 4, 2, 53, 8, **kw)
    hosted = pools(world).run(through_host_case, case, 3, 2, 4, 2, 53, 8, **kw)
    for want, (got, copied) in zip(direct, hosted):
        assert copied > 0
        for name in ("out", "dq", "dk", "dv"):
            assert torch.equal(got[name], want[name]), name
    assert [late for late, _ in pools(world).run(through_host_case, collectives_case, 5)] == [0] * world
    direct = pools(world).run(collective_values_case)
    for want, (got, copied) in zip(direct, pools(world).run(through_host_case, collective_values_case)):
        assert copied >= 5 and got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
