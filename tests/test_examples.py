"""The examples run as a user would launch them."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ring_attention_example_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           os.path.join(ROOT, "examples", "ring_attention.py"), "--seq-len", "300", "--check",
           "--segments", "64", "256", "--rates", "1", "4"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_RING_TIMEOUT="60")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = [float(line.rsplit("=", 1)[1]) for line in done.stdout.splitlines() if "max |ring - one process|" in line]
    assert len(errors) == 2 and max(errors) < 1e-5, done.stdout
