"""``python -m bench gpu --fake``: the GPU benchmark's code runs here, its checks hold, its tables render."""
import importlib.util
import json
import os
import subprocess

import pytest

from bench import common, gpu, gpu_hybrid, tables


def test_gpu_benchmark_runs_without_a_gpu(tmp_path):
    gpu.main(["--fake", "--out", str(tmp_path)])
    got = {name: json.load(open(os.path.join(tmp_path, f"{name}.json")))
           for name in ("gpu_routes", "gpu_exact", "gpu_speed", "gpu_model", "gpu_nccl")}
    routes = got["gpu_routes"]["rows"]
    assert len(routes) == len(gpu.route_check.block_cases())
    assert all(r["checked"] == "yes" and r["kernel"] == r["expected"] for r in routes), routes
    exact = got["gpu_exact"]["rows"]
    assert {r["block"] for r in exact} == set(gpu.EXACT_CASES) and all(r["within"] for r in exact), exact
    impls = {r["impl"] for r in got["gpu_speed"]["rows"]}
    assert impls == {"sdpa (flash)", "ring_attention", "ring_attention dilated"}
    timed = got["gpu_speed"]["rows"] + [r for r in got["gpu_model"]["rows"] if r["checkpointing"] == "off"]
    for r in timed:  # each ratio states its spread over the rounds, and the median's ratio lies within it
        ratio, spread = ((r["fwd_bwd_over_sdpa"], r["fwd_bwd_over_sdpa_range"]) if "impl" in r
                         else (r["ring_over_sdpa"], r["ring_over_sdpa_range"]))
        low, high = map(float, spread.split("–"))
        assert r["rounds"] >= 1 and low - 1e-3 <= ratio <= high + 1e-3, r
    nccl = got["gpu_nccl"]["rows"]
    assert nccl[0]["max_rel_err_fp32"] <= 1e-5 and nccl[-1]["killed_peer"] == "CommTimeoutError"
    assert nccl[-1]["raised_after_s"] < nccl[-1]["timeout_s"] + 5
    for name, payload in got.items():
        # the file says how to make it again: the command as typed, on this checkout's commit
        assert payload["command"] == f"python -m bench gpu --fake --out {tmp_path}", payload["command"]
        assert payload["commit"] == common.commit(common.ROOT) != "unknown"
        table = tables.render(name, payload)
        assert len(table.splitlines()) == 2 + len(payload["rows"])


def test_a_copy_of_the_tree_without_git_still_writes_its_files(tmp_path, monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    monkeypatch.setattr(common.subprocess, "run", no_git)
    common.save(str(tmp_path), "x", {"rows": []}, command="python -m bench x")
    assert json.load(open(tmp_path / "x.json")) == {"rows": [], "command": "python -m bench x", "commit": "unknown"}


def test_a_copy_of_the_tree_says_which_commit_it_was_copied_from(tmp_path, monkeypatch):
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    assert common.commit(str(tmp_path)) == "unknown"  # git runs, but tmp_path is no checkout
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert common.commit(common.ROOT) == "abc1234"  # over the git of the machine it was copied to
    common.save(str(tmp_path), "x", {"rows": []}, command="python -m bench x")
    assert json.load(open(tmp_path / "x.json"))["commit"] == "abc1234"
    assert sorted(os.listdir(tmp_path)) == ["x.json"]  # written whole, nothing left beside it


def test_the_runs_own_results_do_not_mark_the_code_changed(tmp_path, monkeypatch):
    """A sweep's second command finds the first one's JSON rewritten: its rows still ran the committed code."""
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    git = lambda *args: subprocess.run(["git", "-c", "user.name=x", "-c", "user.email=x@x", *args], cwd=tmp_path,  # noqa: E731
                                       check=True, capture_output=True, text=True).stdout.strip()
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    (tmp_path / "docs" / "bench" / "x.json").write_text("{}")
    (tmp_path / "code.py").write_text("a = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "x")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "docs" / "bench" / "x.json").write_text('{"rows": []}')
    assert common.commit(str(tmp_path)) == head
    (tmp_path / "code.py").write_text("a = 2\n")
    assert common.commit(str(tmp_path)) == head + "+changes"


def test_rounds_time_the_implementations_side_by_side():
    calls = []
    times = gpu._rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3, "cpu")
    assert calls == ["a", "b"] * 4  # a warm-up of each, then each round one call of each
    assert [len(t) for t in times.values()] == [3, 3]
    assert common.ratio_range([2.0, 3.0, 1.0], [1.0, 2.0, 1.0]) == "1.000–2.000"


@pytest.mark.skipif(not os.environ.get("HF_RING_KERNEL_PACKAGES"), reason="HF_RING_KERNEL_PACKAGES names no "
                    "directory of kernel packages (README: 'The GPU kernel packages on a CPU')")
def test_gpu_hybrid_benchmark_runs_without_a_gpu(tmp_path):
    """``--hybrid --fake``: the kernel packages' entry points (their launches in torch), 2 ranks against one
    process, every section written and rendered."""
    gpu.main(["--hybrid", "--fake", "--out", str(tmp_path)])
    got = {name: json.load(open(os.path.join(tmp_path, f"{name}.json")))
           for name in ("gpu_hybrid_kernels", "gpu_hybrid_exact", "gpu_hybrid_speed")}
    kernels = {(r["model_type"], r["kernel"]): r["package"] for r in got["gpu_hybrid_kernels"]["rows"]}
    assert kernels == {("qwen3_5_text", "causal_conv1d_fn"): "causal_conv1d",
                       ("qwen3_5_text", "torch_chunk_gated_delta_rule"): "fla",
                       ("kimi_linear", "causal_conv1d_fn"): "causal_conv1d",
                       ("kimi_linear", "chunk_kimi_delta_attention"): "fla"}, kernels
    exact = got["gpu_hybrid_exact"]["rows"]
    assert [r["model_type"] for r in exact] == list(gpu_hybrid.FLA_TYPES)
    # the packages' functions ran (through the kernels package's function layers, where it is installed, as
    # transformers 5.25 requires), and 2 ranks give one process's step
    called = "causal_conv1d, fla" + (", kernels" if importlib.util.find_spec("kernels") is not None else "")
    for r in exact:
        assert r["packages"] == called and r["within"] and r["worst_rel_err"] <= 1e-5, r
    [speed] = got["gpu_hybrid_speed"]["rows"]
    low, high = map(float, speed["two_over_one_range"].split("–"))
    assert speed["n"] == 256 and low - 1e-3 <= speed["two_over_one"] <= high + 1e-3, speed
    for name, payload in got.items():
        assert payload["command"] == f"python -m bench gpu --hybrid --fake --out {tmp_path}", payload["command"]
        assert len(tables.render(name, payload).splitlines()) == 2 + len(payload["rows"])


def test_gpu_hybrid_without_fla_or_its_wheel_says_how_to_bring_it(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_hybrid.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="--download --wheels"):
        gpu_hybrid.ensure_fla(tmp_path / "wheels", tmp_path / "packages")
    (tmp_path / "packages" / "fla").mkdir(parents=True)  # installed by an earlier run: used as it is
    assert gpu_hybrid.ensure_fla(tmp_path / "wheels", tmp_path / "packages") == str(tmp_path / "packages")
