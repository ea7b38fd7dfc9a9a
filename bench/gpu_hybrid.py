"""``python -m bench gpu --hybrid``: the recurrent kernels GPU users run, under hf_ring's state passing, on one GPU.

Sections, each written as ``gpu_hybrid_<section>.json``:

- ``kernels``: per hybrid type, the package each kernel its layers call
  resolved to when transformers imported the modeling module
  (flash-linear-attention ``fla``, ``causal_conv1d``, ``mamba_ssm``, a hub
  kernel, or transformers' own torch path).
- ``exact``: one training step (a left- and a right-padded row) of each hybrid
  type the tests build tiny (so run it from a checkout), float32, on 2 ranks
  sharing the GPU against one process on the same kernels: the worst
  relative error per tensor over the loss and every parameter gradient.
- ``speed``: a training step of ``bench hybrid``'s Qwen3.5-like model at
  ``--sizes`` tokens (32K and 64K), 2 ranks sharing the GPU against one
  process, the same kernels: the median step at the slowest rank, the
  ratio, each rank's peak memory above its model.

Two ranks on one GPU talk over gloo (NCCL refuses a second rank on a device; gloo carries GPU tensors through host
copies), so their step measures what splitting costs on the same kernels, not a speed-up: each rank computes half
the rows while the other waits for the device.

GPU machines are often offline: flash-linear-attention (pure Python; Triton comes with a CUDA build of torch) is
installed, when it is not importable, from the wheels in ``--wheels`` into a directory of its own
(``--download`` fills ``--wheels`` where a package index is reachable). causal-conv1d and mamba-ssm compile CUDA
code: they are used where installed, and transformers takes its torch path for them elsewhere (``kernels`` shows
which).

``--fake`` runs this code on the CPU at small sizes: the packages in ``HF_RING_KERNEL_PACKAGES`` with their Triton
and CUDA launches replaced by the tests' torch stand-ins (``tests/kernel_standins.py``), as the CI runs them.
"""
from __future__ import annotations

# hf_ring, transformers' modeling modules and the tests' helpers are imported inside each process's function, after
# the kernel packages are made importable (and stood in for under --fake): transformers resolves a kernel name once,
# when it imports the modeling module.
import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .common import command_line, format_table, ratio_range, rel_err, run_ranks, save, sync
from .configs import MODEL, hybrid_config

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
WHEELS = ROOT / ".ci-cache" / "wheels"
INSTALLED = ROOT / ".ci-cache" / "gpu-kernel-packages"
PACKAGES = ("fla-core==0.6.0", "einops>=0.8")
"""What ``--download`` fetches and a GPU run installs from ``--wheels``: pure-Python wheels (no compiler needed)."""
FLA_TYPES = ("qwen3_5_text", "kimi_linear")
"""The exactness check's types under ``--fake``: the gated delta rule and KDA on fla (every hybrid type on a GPU)."""
SIZES = [32768, 65536]
TOLERANCE = 1e-5
"""Worst relative error per tensor allowed between 2 ranks and one process, float32 on the same kernels."""

TABLES = {
    "gpu_hybrid_kernels": (("model_type", "model type"), ("kernel", "kernel"), ("package", "runs on")),
    "gpu_hybrid_exact": (("model_type", "model type"), ("packages", "packages called"),
                         ("worst_rel_err", "worst relative error"), ("worst_tensor", "in"),
                         ("within", "within tolerance"), ("tolerance", "tolerance")),
    "gpu_hybrid_speed": (("n", "n"), ("dtype", "dtype"), ("one_step_s", "1 process step s"),
                         ("two_step_s", "2 ranks step s"), ("two_over_one", "2 ranks / 1"),
                         ("two_over_one_range", "range"), ("one_peak_mb", "1 process peak MiB"),
                         ("two_peak_mb", "2 ranks peak MiB per rank")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def _load_tests() -> None:
    """This checkout's test helpers importable (the tiny models, batches and stand-ins the exactness check uses)."""
    if not (TESTS / "sweep.py").exists():
        raise SystemExit(f"bench gpu --hybrid builds the tests' tiny models from {TESTS}, which is not there: run it "
                         "from a checkout of hf_ring installed with pip install --no-deps -e .")
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))


def _prepare(packages_dir: Optional[str], fake: bool) -> None:
    """In a fresh process, before transformers imports a modeling module (it resolves each kernel name then): the
    kernel packages importable, and under ``fake`` their launches replaced by the tests' torch stand-ins."""
    if packages_dir and packages_dir not in sys.path:
        sys.path.insert(0, packages_dir)
    if fake:
        _load_tests()
        import kernel_standins

        kernel_standins.install()


def download(wheels: Path) -> None:
    """Fetch :data:`PACKAGES`' wheels into ``wheels`` (where a package index is reachable), for an offline GPU."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                    "--dest", str(wheels), *PACKAGES], check=True)


def ensure_fla(wheels: Path, target: Path) -> Optional[str]:
    """A directory to import flash-linear-attention from (None: it is importable already), installed from the wheels
    in ``wheels`` without an index; exits naming the command when there are none."""
    if importlib.util.find_spec("fla") is not None:
        return None
    if (target / "fla").is_dir():
        return str(target)
    if not any(wheels.glob("fla_core-*.whl")):
        raise SystemExit(f"flash-linear-attention is not installed and {wheels} holds no fla_core wheel: run "
                         f"python -m bench gpu --hybrid --download --wheels {wheels} where an index is reachable, "
                         "and bring that directory along")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--find-links",
                    str(wheels), "--target", str(target), *PACKAGES], check=True)
    return str(target)


def kernels_in_use(packages_dir: Optional[str], fake: bool, types: List[str]) -> List[Dict]:
    """Per type and kernel name its hybrid family hooks, the package transformers resolved it to (fn of
    :func:`run_ranks`, in a fresh process)."""
    _prepare(packages_dir, fake)
    from hf_ring.integration.seams import kernel_implementation
    from hf_ring.patches import hybrids

    rows = []
    for model_type in types:
        found = hybrids.family(model_type)
        module = None if found is None else found.modeling_module()
        if module is None:
            rows.append({"model_type": model_type, "kernel": "-", "package": "not a hooked family here"})
            continue
        for name, _ in found.kernels:
            if name.startswith("."):  # a module of the layer (an nn.Conv1d, a row shift): torch's own
                rows.append({"model_type": model_type, "kernel": name[1:], "package": "torch (a module)"})
                continue
            owner, attr = hybrids.kernel_owner(module, name)
            fn = kernel_implementation(getattr(owner, attr))  # what transformers' kernel-name wrapper calls
            package = (getattr(fn, "__module__", None) or "?").split(".")[0]
            rows.append({"model_type": model_type, "kernel": name,
                         "package": "transformers (torch path)" if package == "transformers" else package})
    return rows


def _called_packages(model, step) -> List[str]:
    """The kernel packages whose functions ``step()`` calls, by the modules of the functions it enters."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            top = name.split(".")[0]
            if top in ("fla", "causal_conv1d", "mamba_ssm", "kernels"):
                seen.add(top)
        return None

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def exact_steps(packages_dir: Optional[str], fake: bool, device: str, types: List[str]) -> Dict[str, Dict]:
    """Per type, the loss and every gradient of one float32 step, on this process's rows of the padded batch (fn
    of :func:`run_ranks`: one process, or ranks sharing the device with the sequence split); a type that does not
    build or run gives its error."""
    _prepare(packages_dir, fake)
    _load_tests()
    import torch.distributed as dist

    import hf_ring
    import hybrid_cases
    import sweep
    from hf_ring.engine import comm

    split = dist.is_initialized() and dist.get_world_size() > 1
    found: Dict[str, Dict] = {}
    for model_type in types:
        model, why = sweep.build(model_type, "ring_dilated" if split else "sdpa", torch.float32, "hybrid")
        if model is None:
            found[model_type] = {"error": why}
            continue
        model = model.to(device).eval()  # eval: no dropout, and a Mamba2 layer's unfused path (the hooks')
        data = {k: v.to(device) for k, v in hybrid_cases.padded_batch().items()}
        sp = hf_ring.setup_sequence_parallel(None) if split else None
        try:
            if split:
                data = hf_ring.shard_batch(data)
            out: Dict = {}

            def step():
                out["loss"] = model(**data).loss
                out["loss"].backward()

            packages = _called_packages(model, step)
            loss = out["loss"].detach()
            if split:
                hf_ring.sync_gradients(model)
                comm.all_reduce(loss, sp.sp_group, "the benchmark's loss")
            # numpy arrays: a tensor sent to the parent is shared through a descriptor this process may close first
            found[model_type] = {"loss": loss.cpu().numpy(), "packages": packages,
                                 "grads": {n: p.grad.cpu().numpy() for n, p in model.named_parameters()
                                           if p.grad is not None}}
        except Exception as err:  # noqa: BLE001 -- the row says what failed; the other types still run
            found[model_type] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        finally:
            if split:
                hf_ring.clear_sequence_parallel()
    return found


def exact_rows(one: Dict[str, Dict], two: List[Dict[str, Dict]]) -> List[Dict]:
    """Per type, the 2 ranks' worst relative error per tensor against one process (rank 0's gradients, which
    ``sync_gradients`` made every rank's)."""
    rows = []
    for model_type, want in one.items():
        got = two[0][model_type]
        error = want.get("error") or got.get("error")
        if error is None and set(got["grads"]) != set(want["grads"]):
            error = f"gradients of other parameters: {sorted(set(got['grads']) ^ set(want['grads']))[:4]}"
        if error is not None:
            rows.append({"model_type": model_type, "packages": "-", "worst_rel_err": None, "worst_tensor": error,
                         "within": False, "tolerance": TOLERANCE})
            continue
        errs = {"loss": rel_err(got["loss"], want["loss"])}
        errs.update({name: rel_err(got["grads"][name], g) for name, g in want["grads"].items()})
        worst = max(errs, key=errs.get)
        rows.append({"model_type": model_type, "packages": ", ".join(got["packages"]) or "torch paths only",
                     "worst_rel_err": errs[worst], "worst_tensor": worst, "within": errs[worst] <= TOLERANCE,
                     "tolerance": TOLERANCE})
    return rows


def timed_steps(packages_dir: Optional[str], fake: bool, device: str, n: int, repeats: int, dtype: str) -> Dict:
    """A step of the Qwen3.5-like model at ``n`` tokens, ``repeats`` times after a warm-up: this rank's seconds per
    step and peak memory above the model (fn of :func:`run_ranks`)."""
    _prepare(packages_dir, fake)
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_ring
    from hf_ring.engine import comm

    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    config = hybrid_config(max_position_embeddings=1 << 20)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated" if world > 1 else "sdpa",
                                             dtype=getattr(torch, dtype)).to(device).train()
    ids = torch.randint(0, MODEL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
    data = {"input_ids": ids.to(device), "labels": ids.to(device)}
    sp = hf_ring.setup_sequence_parallel(None) if world > 1 else None
    try:
        if sp is not None:
            data = hf_ring.shard_batch(data)

        def step():
            model(**data).loss.backward()
            model.zero_grad(set_to_none=True)
            sync(device)

        step()  # kernels compiled and autotuned, the allocator warmed
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
        times = []
        for _ in range(repeats):
            if sp is not None:
                comm.all_reduce(torch.zeros(1), None, "the benchmark's step barrier")
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.startswith("cuda") else None
        return {"times": times, "peak_mb": peak}
    finally:
        if sp is not None:
            hf_ring.clear_sequence_parallel()


def speed_rows(packages_dir: Optional[str], fake: bool, device: str, sizes: List[int], repeats: int,
               dtype: str) -> List[Dict]:
    rows = []
    for n in sizes:
        one = run_ranks(1, timed_steps, packages_dir, fake, device, n, repeats, dtype, exact_peak=False)[0]
        two = run_ranks(2, timed_steps, packages_dir, fake, device, n, repeats, dtype, exact_peak=False)
        slowest = [max(ts) for ts in zip(*(r["times"] for r in two))]  # a step ends when its slowest rank does
        one_s, two_s = statistics.median(one["times"]), statistics.median(slowest)
        peaks = [r["peak_mb"] for r in two if r["peak_mb"] is not None]
        rows.append({"n": n, "dtype": dtype, "one_step_s": one_s, "two_step_s": two_s, "two_over_one": two_s / one_s,
                     "two_over_one_range": ratio_range(slowest, one["times"]), "one_peak_mb": one["peak_mb"],
                     "two_peak_mb": max(peaks) if peaks else None})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench gpu --hybrid", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hybrid", action="store_true", help="(the command's name: python -m bench gpu --hybrid)")
    ap.add_argument("--fake", action="store_true", help="no GPU: the CPU at small sizes, the kernel packages' "
                    "launches replaced by the tests' torch stand-ins")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help=f"speed sizes (default {SIZES})")
    ap.add_argument("--types", nargs="+", default=None, help="the exactness check's model types (default: every "
                    f"hybrid type of the tests; {' '.join(FLA_TYPES)} under --fake)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default=None, help="the speed section's dtype (default bfloat16; float32 under --fake)")
    ap.add_argument("--sections", nargs="+", default=["kernels", "exact", "speed"])
    ap.add_argument("--wheels", default=str(WHEELS), help="wheels to install flash-linear-attention from, offline")
    ap.add_argument("--download", action="store_true", help="only fetch the wheels into --wheels, then stop")
    ap.add_argument("--out", default="bench_results")
    args = ap.parse_args(argv)
    if args.download:
        download(Path(args.wheels))
        return
    command = command_line("gpu", argv)
    if not args.fake and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or pass --fake to run this code on the CPU")
    fake = args.fake
    device = "cpu" if fake else "cuda"
    packages_dir = os.environ.get("HF_RING_KERNEL_PACKAGES") if fake else ensure_fla(Path(args.wheels), INSTALLED)
    _load_tests()
    import hybrid_models

    types = args.types or (list(FLA_TYPES) if fake else hybrid_models.hybrid_types())
    config = {"device": "CPU (--fake)" if fake else torch.cuda.get_device_name(), "torch": torch.__version__,
              "fake": fake, "kernel_packages": packages_dir or "installed"}
    if "kernels" in args.sections:
        rows = run_ranks(1, kernels_in_use, packages_dir, fake, types, exact_peak=False)[0]
        print(format_table(rows, list(rows[0])), flush=True)
        save(args.out, "gpu_hybrid_kernels", {"config": config, "rows": rows}, command=command)
    if "exact" in args.sections:
        one = run_ranks(1, exact_steps, packages_dir, fake, device, types, exact_peak=False)[0]
        two = run_ranks(2, exact_steps, packages_dir, fake, device, types, exact_peak=False)
        rows = exact_rows(one, two)
        print(format_table(rows, list(rows[0])), flush=True)
        save(args.out, "gpu_hybrid_exact", {"config": config, "rows": rows}, command=command)
    if "speed" in args.sections:
        dtype = args.dtype or ("float32" if fake else "bfloat16")
        rows = speed_rows(packages_dir, fake, device, args.sizes or ([256] if fake else SIZES),
                          1 if fake else args.repeats, dtype)
        print(format_table(rows, list(rows[0])), flush=True)
        save(args.out, "gpu_hybrid_speed", {"config": {**config, "model": "bench hybrid's Qwen3.5-like", "dtype":
                                                       dtype}, "rows": rows}, command=command)
