"""The examples run as a user would launch them."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.compat  # the subset run on every supported transformers release

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ring_attention_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", "ring_attention.py"), "--seq-len", "300", "--check",
           "--segments", "64", "256", "--rates", "1", "4"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_RING_TIMEOUT="60")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    # Per tensor, relative to the one-process result (whose exactness test_dilated_attention checks
    # against the float64 reference on one rank).
    found = re.findall(r"rank (\d): max \|ring - one process\| / max \|one process\| for out, dq, dk, dv = "
                       r"([-+.\de]+), ([-+.\de]+), ([-+.\de]+), ([-+.\de]+)", done.stdout)
    assert sorted(int(f[0]) for f in found) == [0, 1], done.stdout
    errors = [float(x) for f in found for x in f[1:]]
    assert max(errors) <= 1e-5, done.stdout


def _generate(nproc, prompt_file):
    script = os.path.join(ROOT, "examples", "generate.py")
    args = ["--prompt-file", prompt_file, "--max-new-tokens", "8"]
    cmd = ([sys.executable, script] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script])
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_RING_TIMEOUT="60")
    done = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    summary = [i for i, line in enumerate(lines) if "KV cache per rank" in line]
    assert len(summary) == 1, done.stdout
    return lines[summary[0] - 1], lines[summary[0]]


def test_generate_example_same_text_on_one_and_two_ranks(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 40)
    text1, summary1 = _generate(1, str(book))
    text2, summary2 = _generate(2, str(book))
    assert text1 == text2 and len(text1) > 0
    assert "2961 prompt tokens on 2 rank(s)" in summary2 and "prefill" in summary2 and "decode" in summary2
    one = float(summary1.split("KV cache per rank: ")[1].split(" MiB")[0])
    two = [float(x.split(" MiB")[0]) for x in summary2.split("KV cache per rank: ")[1].split(", ")]
    assert len(two) == 2 and all(abs(x - one / 2) <= 0.01 * one for x in two)  # each rank holds half the cache
