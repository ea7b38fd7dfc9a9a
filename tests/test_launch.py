"""Launches as users make them: torchrun with or without a backend named, faults on one rank, clean exits."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from models import length_dependent_rope, saved_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "launched_step.py")
TOL = 1e-5
FAULT_TIMEOUT_S = 20
SLACK_S = 15.0


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", HF_RING_TIMEOUT=str(FAULT_TIMEOUT_S), **extra)


def _results(out: str):
    """What each rank wrote, by rank."""
    found = []
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name)) as f:
            found.append(json.load(f))
    return sorted(found, key=lambda r: r["rank"])


def _torchrun(*args, timeout=300):
    """Two ranks under torchrun; returns the finished process and what the ranks wrote."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
               "--out", out, *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
        return done, _results(out)


def _model():
    return saved_model_dir("llama", seed=5, **length_dependent_rope("llama"))


@pytest.mark.parametrize("backend", ["none", "gloo", "cpu:gloo"])
def test_torchrun_step_equals_one_process(backend):
    """No backend named gives an 'undefined' group backend on a CPU build: the ring must not wait as if on NCCL."""
    done, results = _torchrun("--backend", backend, "--model", _model())
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["rank"] for r in results] == [0, 1], results
    for r in results:
        assert r["loss_err"] <= TOL and r["grad_err"] <= TOL, r
    # transformers' own model beside the sharded one: unchanged by the setup, and no collective on rank 0 alone
    assert results[0]["beside_identical"] is True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _by_hand(out, *args, timeout_s=FAULT_TIMEOUT_S):
    """Two ranks started as torchrun starts them (env://), but with no agent that stops the survivor."""
    port = _free_port()
    procs, started = [], time.monotonic()
    for rank in range(2):
        env = dict(_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                        WORLD_SIZE="2"), HF_RING_TIMEOUT=str(timeout_s))
        procs.append(subprocess.Popen([sys.executable, SCRIPT, "--out", out, *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT))
    ends = []
    for p in procs:
        _, err = p.communicate(timeout=300)
        ends.append((p.returncode, err, time.monotonic() - started))
    return ends


@pytest.mark.parametrize("backend", ["none", "cpu:gloo"])
@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_fault_on_one_rank_is_reported_within_the_bound(tmp_path, backend, fault):
    (code0, err0, wall0), (code1, err1, wall1) = _by_hand(str(tmp_path), "--backend", backend, "--model", _model(),
                                                          "--fault", fault)
    assert code1 != 0
    if fault == "raise":
        assert "rank 1 fails on purpose" in err1
    assert code0 == 1, err0[-3000:]
    [result] = _results(str(tmp_path))
    if fault == "kill":
        assert result["error"] == "CommTimeoutError" and "HF_RING_TIMEOUT" in result["message"], result
        assert result["after_s"] <= FAULT_TIMEOUT_S + SLACK_S, result
    else:  # rank 1's exit tells rank 0, waiting in the batch check, why it left
        assert result["error"] == "RankLeftError", result
        assert result["message"].startswith("rank 1 ended after an error it did not catch (RuntimeError: rank 1 "
                                            "fails on purpose"), result
        assert result["after_s"] <= SLACK_S, result
    # Neither the failing rank nor the survivor waits at exit for a peer that will not come.
    assert max(wall0, wall1) <= FAULT_TIMEOUT_S + 2 * SLACK_S, (wall0, wall1)
    assert "Traceback" in err0 and "terminate called" not in err0 + err1


LEAVE_TIMEOUT_S = 120


def test_a_rank_that_ends_early_is_known_to_the_others_at_once(tmp_path):
    """Rank 1's script ends right after the setup while rank 0 checks a batch: rank 0 learns it from rank 1's exit
    (one protocol for exits and checks) long before HF_RING_TIMEOUT, and the launch ends."""
    started = time.monotonic()
    (code0, err0, wall0), (code1, err1, wall1) = _by_hand(str(tmp_path), "--model", _model(), "--leave",
                                                          timeout_s=LEAVE_TIMEOUT_S)
    assert max(wall0, wall1) < 60 and time.monotonic() - started < 60, (wall0, wall1)
    [result] = _results(str(tmp_path))
    assert result["rank"] == 0 and result["error"] == "RankLeftError" and result["after_s"] < 30, result
    assert result["message"].startswith("rank 1 ended cleanly (its script finished), while rank 0 waited for it in "
                                        "the batch check of shard_batch"), result
    assert code0 == 1 and err0.count("Traceback (most recent call last)") == 1, err0[-3000:]
    assert code1 == 0, err1[-3000:]
    assert "hf_ring.shutdown: rank 0 was still in the batch check of shard_batch" in err1, err1[-3000:]
    assert "terminate called" not in err0 + err1


@pytest.mark.parametrize("bad", ["one", "both"])
def test_a_bad_batch_prints_one_traceback_per_rank_naming_the_ranks(tmp_path, bad):
    """The local error and its relayed copy are one exception, not two chained ones; the message names the ranks
    that failed, the same on every rank."""
    ends = _by_hand(str(tmp_path), "--model", _model(), "--bad-labels", bad)
    who = "rank 1" if bad == "one" else "ranks 0 and 1"
    for rank, (code, err, wall) in enumerate(ends):
        assert code == 1, err[-3000:]
        assert err.count("Traceback (most recent call last)") == 1, err
        assert "During handling of the above exception" not in err and "direct cause" not in err, err
        lines = [line.split("]: ", 1)[-1] for line in err.splitlines()]  # torch prefixes "[rankN]: "
        last = [line for line in lines if line.startswith("ValueError")][-1]
        assert last.startswith(f"ValueError: {who}: "), (rank, last)
        assert "labels" in last, last
    for result in _results(str(tmp_path)):
        assert result["error"] == "ValueError" and result["message"].startswith(f"{who}: "), result


@pytest.mark.parametrize("accelerator", ["cpu", "default"])
def test_an_accelerator_that_sees_one_process_is_refused(accelerator):
    """Without GPUs, accelerate builds a one-process state unless told to use the CPU, while torchrun's group spans
    both processes: a Trainer would neither average gradients nor split data, so the setup refuses it."""
    done, results = _torchrun("--light", "--accelerator", accelerator, timeout=120)
    if accelerator == "cpu":
        assert done.returncode == 0 and len(results) == 2, done.stderr[-3000:]
    else:
        assert done.returncode != 0 and not results
        # (each rank raises it by itself; torchrun may stop the second before it prints)
        assert "the accelerator sees 1 process(es) but torch.distributed runs 2" in done.stderr, done.stderr[-3000:]
        assert "use_cpu=True" in done.stderr


ENDINGS = ("none", "destroy", "end_training", "shutdown")
"""How a user's script ends (launched_step.py's ``--ending``): nothing, ``dist.destroy_process_group()``,
``accelerator.end_training()``, ``hf_ring.shutdown()``. One launch each here; ``python -m bench endings`` launches
each 20 times (docs/bench/endings.json)."""


def test_launches_exit_cleanly_however_the_script_ends():
    """gloo processes that end with their group alive, or whose peer has torn its connections down first, often
    abort ("terminate called without an active exception"); after hf_ring's setup every launch must exit 0 however
    the script ends, and whether its last exchange was the ring's or a recurrent layer's in its backward (a
    hybrid, and its image-text form)."""
    import hybrid_models
    from vlm import HYBRIDS

    forms = [("--light",), ("--hybrid", "--model", hybrid_models.saved("qwen3_5_text"), "--vlm",
                            HYBRIDS["qwen3_5"].build())]
    failed = []
    for ending in ENDINGS:
        for form in forms:
            done, results = _torchrun(*form, "--ending", ending, timeout=120)
            if done.returncode != 0 or len(results) != 2:
                failed.append((ending, form[0], done.returncode, done.stderr[-1500:]))
    assert not failed, failed


def test_a_whole_group_destroy_meets_every_rank_first_while_a_setup_stands(pools):
    """``dist.destroy_process_group()`` (and accelerate's ``end_training``, which calls it) is hf_ring's while a
    sequence-parallel setup stands, listed among its changes (the exit exchange, then torch's destroy: the
    launches above end that way), and torch's own again once the setup is cleared."""
    from setup_cases import destroy_case

    for seen in pools(2).run(destroy_case):
        assert seen["replaced"] and seen["restored"], seen
        assert len(seen["listed"]) == 1 and "as hf_ring.shutdown does" in seen["listed"][0], seen


@pytest.mark.parametrize("config,want", [
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),  # init_process_group() with no backend, CUDA build
    ("cpu:gloo", {"cpu": "gloo"}),  # the same on a CPU build, where get_backend() says 'undefined'
    ("cpu:gloo,cuda:gloo", {"cpu": "gloo", "cuda": "gloo"}),  # "gloo" named
    ("cuda:nccl", {"cuda": "nccl"}),
    ("nccl", {"cuda": "nccl"}),
    ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
])
def test_the_backend_that_carries_each_device(config, want):
    from hf_ring.engine.comm import parse_carriers

    assert parse_carriers(config) == want
