"""Hybrids on the kernel packages GPU users run, under hf_ring's hooks, on a CPU: exact over 2 and 4 ranks.

With flash-linear-attention or causal-conv1d installed, transformers calls their functions where a modeling file
calls its torch path (it resolves each kernel name when it imports the modeling module). Those packages run here as
published, their Python entry points checking, casting and dispatching as they do on a GPU; only their launches of
Triton or CUDA code are torch code of the same contract (tests/kernel_standins.py). The packages live in the
directory ``HF_RING_KERNEL_PACKAGES`` names (.ci/run fills it; README says how), outside the test environment,
since every other test runs transformers' torch paths; each run is a fresh process (tests/kernel_ranks.py).
"""
import json
import os
import subprocess
import sys

import pytest

import kernel_ranks
from helpers import close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES_DIR = os.environ.get("HF_RING_KERNEL_PACKAGES")
pytestmark = pytest.mark.skipif(not PACKAGES_DIR, reason="HF_RING_KERNEL_PACKAGES names no directory of kernel "
                                "packages (README: 'The GPU kernel packages on a CPU')")
TOL = 1e-5

RUNS = {
    # The gated delta rule's families on flash-linear-attention, in float64 (its stand-in keeps float64 states for
    # float64 inputs, so what is measured is the hooks): their convolutions on the torch path.
    "fla": (("fla",), "float64", ("qwen3_5_text", "qwen3_next", "olmo_hybrid")),
    # fla's chunk_kda asserts a float32 initial state (the hooks' float64 transitions are refused): float32.
    "fla_kda": (("fla",), "float32", ("kimi_linear",)),
    # causal-conv1d's extension takes float32, float16 or bfloat16 only: LFM2 (convolutions only) in float32.
    "causal_conv1d": (("causal_conv1d",), "float32", ("lfm2",)),
    # mamba-ssm's scans with causal-conv1d's convolution (float32: both extensions take no float64).
    "mamba_ssm": (("causal_conv1d", "mamba_ssm"), "float32", ("nemotron_h", "jamba")),
}
"""Per run: the packages transformers finds, the models' dtype, the model types."""


KEPT_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "OMP_NUM_THREADS", "HF_HOME", "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME")
"""What a launch keeps of this process's environment: not what earlier tests left in it (a rank's RANK or
WORLD_SIZE, accelerate's settings), which the launched ranks would read."""


def _launch(name: str, out: str) -> dict:
    packages, dtype, types = RUNS[name]
    env = {k: os.environ[k] for k in KEPT_ENV if k in os.environ}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (PACKAGES_DIR, os.environ.get("PYTHONPATH")) if p),
               TRITON_CACHE_DIR=os.path.join(os.path.dirname(out), f"triton-{name}"))
    cmd = [sys.executable, os.path.join(ROOT, "tests", "kernel_ranks.py"), "--out", out, "--types", *types,
           "--packages", *packages, "--dtype", dtype]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[:4000] + "\n...\n" + done.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kernels")
    return {name: _launch(name, str(tmp / f"{name}.json")) for name in RUNS}


def _cases():
    return [(name, t, world) for name, (_, _, types) in RUNS.items() for t in types for world in (2, 4)]


@pytest.mark.parametrize("run,model_type,world", _cases())
def test_a_hybrid_on_the_kernel_packages_over_ranks_equals_one_process(reports, run, model_type, world):
    """Loss and every gradient on 2 and 4 ranks against one process on the same packages (a packed row's against its
    documents run one by one), and ``hf_ring.generate``'s
    tokens against ``model.generate``'s; every rank launched the package's kernels, and a linear-time package's scan
    ran whole over each of its runs (not in pieces)."""
    report = reports[run]
    assert sorted(report["packages"]) == sorted(RUNS[run][0]), report["packages"]
    entry = report["types"][model_type]
    assert entry["one_process_calls"], "one process never launched the package's kernels"
    got = entry[str(world)]
    assert close(got["worst"], TOL), got["worst"]
    assert close(got["packed_worst"], TOL), got["packed_worst"]  # the packed row against its documents one by one
    for rank, calls in enumerate(got["calls"]):
        assert calls, f"rank {rank} never launched the package's kernels"
    for rank, tokens in enumerate(got["tokens"]):
        assert tokens == entry["tokens"], (rank, tokens, entry["tokens"])
    assert all(got["generate_calls"]) and entry["generate_calls"], "generation never launched the package's kernels"
    if run != "causal_conv1d":  # the ranks ran with scan_rows=SCAN_ROWS: the torch path is cut into such pieces
        rows = [call[1] for calls in got["calls"] for call in calls if "conv1d" not in call[0]]
        assert max(rows) > kernel_ranks.SCAN_ROWS, rows
