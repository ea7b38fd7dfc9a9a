"""``python -m bench linear``'s timing part end to end at toy sizes: one rank, real launches of the example."""
import json
import os

import pytest
import torch

from bench import linear, rowfile


def test_timing_rows_compare_like_with_like(tmp_path):
    linear.main(["--parts", "timing", "--ranks", "1", "--timing-sizes", "64", "128", "--timing-steps", "1",
                 "--base-segment", "16", "--out", str(tmp_path)])
    rows = json.load(open(tmp_path / "linear.json"))["timing"]
    assert [(r["n"], r["base_segment"]) for r in rows] == [(64, 16), (128, 16)]
    for r in rows:
        assert r["step_over_dense"] == round(r["linear_step_s"] / r["dense_step_s"], 3)
        low, high = map(float, r["step_over_dense_range"].split("–"))
        assert r["repeats"] == 1 and low == high == pytest.approx(r["step_over_dense"], abs=1e-3)
    assert rows[1]["linear_growth"] == round(rows[1]["linear_step_s"] / rows[0]["linear_step_s"], 2)
    assert "dense_growth" in rows[1] and "dense_growth" not in rows[0]


def test_a_repeated_run_replaces_its_own_rows_only(tmp_path, monkeypatch):
    """Runs made at different times gather in one file: the same settings replace their row, others join.
    (The timing part's launches are replaced by rows that say which call made them.)"""
    calls = iter(range(100))
    monkeypatch.setattr(linear, "timing", lambda script, sizes, ranks, steps, repeats, base, work: [
        {"n": n, "ranks": ranks, "base_segment": base, "call": next(calls), "dense_step_s": 2.0, "linear_step_s": 1.0,
         "step_over_dense": 0.5, "dense_peak_mb": 1.0, "linear_peak_mb": 1.0} for n in sizes])
    args = ["--parts", "timing", "--ranks", "1", "--timing-steps", "1", "--base-segment", "16", "--out", str(tmp_path)]
    linear.main(args + ["--timing-sizes", "64", "128"])
    first = json.load(open(tmp_path / "linear.json"))["timing"]
    linear.main(args + ["--timing-sizes", "128"])
    linear.main(args[:-2] + ["--base-segment", "32", "--out", str(tmp_path), "--timing-sizes", "64"])
    rows = json.load(open(tmp_path / "linear.json"))["timing"]
    assert [(r["n"], r["base_segment"]) for r in rows] == [(64, 16), (128, 16), (64, 32)]
    assert rows[0] == first[0] and rows[1] != first[1]  # 128 at base 16 was run again
    assert rows[2]["command"].startswith("python -m bench linear --parts timing") and rows[2]["commit"]
    assert rows[1]["settings"] == {"ranks": 1, "timing_steps": 1, "timing_repeats": 1, "base_segment": 16, "n": 128}


def test_rows_from_before_settings_were_recorded_are_kept():
    old = [{"n": 64, "seed": 0}, {"n": 64, "seed": 1, "settings": {"n": 64, "seed": 1}}]
    new = [{"n": 64, "seed": 1, "settings": {"n": 64, "seed": 1}, "x": 2}, {"n": 64, "seed": 2, "settings": {"n": 64, "seed": 2}}]
    assert rowfile.merge(old, new) == [old[0], new[0], new[1]]


def test_recipes_write_every_seed_with_its_command_and_only_fields_the_writer_knows(tmp_path):
    recipe = "--seq-len 64 --steps 2 --dilated linear --base-segment 16 --eval-batches 1 --depth-prompts 1"
    args = ["--parts", "recipes", "--ranks", "1", "--recipe", recipe, "--parallel", "2", "--out", str(tmp_path)]
    linear.main(args + ["--seeds", "0", "1"])
    rows = sorted(json.load(open(tmp_path / "linear_recipes.json"))["rows"], key=lambda r: r["seed"])  # as they ended
    assert [(r["seed"], r["n"], r["steps"], r["part"], r["attention"]) for r in rows] == [
        (0, 64, 2, "from scratch", "linear"), (1, 64, 2, "from scratch", "linear")]
    fields = set(linear.WRITES["linear_recipes"]["rows"])
    assert all(set(r) <= fields for r in rows)
    assert rows[0]["settings"] == {"ranks": 1, "recipe": recipe, "seed": 0}
    assert "--recipe" in rows[0]["command"] and rows[0]["commit"] and rows[0]["device"]
    linear.main(args + ["--seeds", "1"])  # seed 1 again: its row is replaced, seed 0's kept
    again = sorted(json.load(open(tmp_path / "linear_recipes.json"))["rows"], key=lambda r: r["seed"])
    assert [r["seed"] for r in again] == [0, 1] and again[0] == rows[0] and again[1] != rows[1]


def test_recipes_from_the_demo_train_it_once_and_read_each_run_back_at_its_length(tmp_path, monkeypatch):
    launched = []

    def launch(script, ranks, args):
        launched.append(args)
        n = int(args[args.index("--seq-len") + 1])
        lr = float(args[args.index("--lr") + 1]) if "--lr" in args else 5e-3
        return {"seq_len": n, "pattern": None, "layers": 2, "steps": 3, "accuracy_before": 0.5,
                "accuracy_after": 1.0, "accuracy_by_depth": {"0.0": 1.0, "0.5": 0.5}, "dilated": None, "lr": lr,
                "batch_size": 4, "warmup_len": 32}

    monkeypatch.setattr(linear, "launch", launch)
    linear.main(["--parts", "recipes", "--ranks", "1", "--seeds", "0", "1", "--out", str(tmp_path),
                 "--recipe", "--model DEMO --seq-len 128 --lr 0.002"])
    rows = json.load(open(tmp_path / "linear_recipes.json"))["rows"]
    demo = launched[0][launched[0].index("--output") + 1]
    assert launched[0][launched[0].index("--seq-len") + 1] == str(linear.DEMO_LEN)
    assert sum(a[a.index("--output") + 1] == demo for a in launched) == 1  # trained once, for both seeds
    trained = [a for a in launched[1:] if "--steps" not in a]
    evaluated = [a for a in launched[1:] if "--steps" in a]  # each run read back at the demo's length, no training
    assert len(trained) == len(evaluated) == 2 and all(a[a.index("--model") + 1] == demo for a in trained)
    assert [(a[a.index("--model") + 1], a[a.index("--seq-len") + 1]) for a in evaluated] == [
        (a[a.index("--output") + 1], str(linear.DEMO_LEN)) for a in trained]
    assert [(r["part"], r["lr"], r["at_4096"], r["accuracy_over_depths"]) for r in rows] == [
        (f"extension {linear.DEMO_LEN} → 128", 0.002, 1.0, 0.75)] * 2


def test_recipes_refuse_what_the_benchmark_sets_itself(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--seq-len"):
        linear.check_recipes(["--steps 2"])
    with pytest.raises(ValueError, match="leave --seed out"):
        linear.check_recipes(["--seq-len 64 --seed 3"])
    # refused before any other part launches anything
    monkeypatch.setattr(linear, "launch", lambda *a: pytest.fail("launched before the recipes were checked"))
    with pytest.raises(ValueError, match="leave --output out"):
        linear.main(["--parts", "retrieval", "recipes", "--recipe", "--seq-len 64 --output x", "--out", str(tmp_path)])


def test_a_sweep_cut_short_keeps_the_runs_it_finished(tmp_path, monkeypatch):
    """A lent machine's time can run out mid-sweep: every run that ended is in the file by then."""
    def launch(script, ranks, args):
        seed = int(args[args.index("--seed") + 1])
        if seed == 2:
            raise RuntimeError("the machine went away")
        return {"seq_len": 64, "pattern": None, "layers": 2, "steps": 3, "accuracy_before": 0.0,
                "accuracy_after": 1.0, "accuracy_by_depth": {"0.0": 1.0}, "dilated": None, "lr": 5e-3,
                "batch_size": 4, "warmup_len": 32}

    monkeypatch.setattr(linear, "launch", launch)
    with pytest.raises(RuntimeError, match="went away"):
        linear.main(["--parts", "recipes", "--ranks", "1", "--seeds", "0", "1", "2", "--out", str(tmp_path),
                     "--recipe", "--seq-len 64"])
    saved = json.load(open(tmp_path / "linear_recipes.json"))
    assert [r["seed"] for r in saved["rows"]] == [0, 1] and len(saved["runs"]) == 1


def test_a_row_with_a_field_no_benchmark_writes_is_flagged():
    from bench import tables

    stamps = {"command": "python -m bench linear", "commit": "abc"}
    good = {"rows": [dict(stamps, n=64, seed=0, accuracy=1.0)], "timing": [], "extension": []}
    assert tables.unwritten({"linear": good}) == []
    bad = {"rows": [dict(stamps, n=64, seed=0, note="merged from two runs")]}
    assert tables.unwritten({"linear": bad}) == ["linear.json rows[0]: note"]
    unstamped = {"rows": [{"n": 64, "seed": 0, "accuracy": 1.0, "commit": "abc"}]}
    assert tables.unwritten({"linear": unstamped}) == ["linear.json rows[0]: no command"]
    beside = dict(good, runs=[], command="python -m bench linear", commit="abc", config={"device": "by hand"})
    assert tables.unwritten({"linear": beside}) == ["linear.json: config"]


def test_a_key_added_by_hand_beside_the_rows_does_not_outlive_a_run(tmp_path):
    json.dump({"runs": [], "rows": [], "config": {"device": "by hand"}}, open(tmp_path / "linear_recipes.json", "w"))
    sink = linear.Sink(str(tmp_path), {"ranks": 1}, "python -m bench linear", "abc")
    sink.keep("recipes", {"recipe": "--seq-len 64", "seed": 0, "accuracy": 1.0})
    saved = json.load(open(tmp_path / "linear_recipes.json"))
    assert "config" not in saved and [r["seed"] for r in saved["rows"]] == [0]


def test_retrieval_rows_are_kept_apart_by_the_learning_rate_the_preset_ran_at(tmp_path, monkeypatch):
    """A preset whose learning rate changes makes new rows beside the old ones, never in their place."""
    lr = {"now": 5e-3}

    def launch(script, ranks, args):
        return {"heads": 16, "pattern": None, "steps": 3, "lr": lr["now"], "accuracy_after": 1.0,
                "accuracy_by_depth": {"0.0": 1.0}, "wall_s": 1.0, "peak_rss_mb_per_rank": [1.0]}

    monkeypatch.setattr(linear, "launch", launch)
    args = ["--parts", "retrieval", "--ranks", "1", "--sizes", "64", "--seeds", "0", "--out", str(tmp_path)]
    linear.main(args)
    lr["now"] = 2e-3
    linear.main(args)
    linear.main(args)
    rows = json.load(open(tmp_path / "linear.json"))["rows"]
    assert [r["lr"] for r in rows] == [5e-3, 2e-3] and rows[1]["settings"]["lr"] == 2e-3


def test_retrieval_passes_a_learning_rate_on_and_keeps_its_rows_apart(tmp_path, monkeypatch):
    def launch(script, ranks, args):
        lr = float(args[args.index("--lr") + 1]) if "--lr" in args else 2e-3
        return {"heads": 16, "pattern": None, "steps": 3, "lr": lr, "accuracy_after": 1.0,
                "accuracy_by_depth": {"0.0": 1.0}, "wall_s": 1.0, "peak_rss_mb_per_rank": [1.0]}

    monkeypatch.setattr(linear, "launch", launch)
    args = ["--parts", "retrieval", "--ranks", "1", "--sizes", "64", "--seeds", "0", "--out", str(tmp_path)]
    linear.main(args)
    linear.main(args + ["--lr", "0.005"])
    assert [r["lr"] for r in json.load(open(tmp_path / "linear.json"))["rows"]] == [2e-3, 5e-3]


def test_two_sweeps_writing_one_file_at_once_keep_each_others_rows(tmp_path, monkeypatch):
    import threading
    import time

    saved = rowfile.save

    def slow_save(*args, **kwargs):  # widens the window between reading the file and writing it back
        time.sleep(0.2)
        saved(*args, **kwargs)

    monkeypatch.setattr(rowfile, "save", slow_save)
    row = {"part": "from scratch", "n": 64, "seed": 0, "recipe": "--seq-len 64"}
    sinks = [linear.Sink(str(tmp_path), {"ranks": r}, f"sweep {r}", "abc") for r in (1, 2)]
    threads = [threading.Thread(target=sink.keep, args=("recipes", dict(row))) for sink in sinks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    saved_rows = json.load(open(tmp_path / "linear_recipes.json"))
    assert sorted(r["command"] for r in saved_rows["rows"]) == ["sweep 1", "sweep 2"]
    assert len(saved_rows["runs"]) == 2


def test_the_extension_runs_each_seed_from_one_demo_and_keys_its_rows_by_seed(tmp_path, monkeypatch):
    """A seed rate of the extension comes from one command: the demo is trained once, every seed fine-tunes it."""
    launched = []

    def launch(script, ranks, args):
        launched.append(args)
        out = args[args.index("--output") + 1]
        if "--model" in args and "--eval-every" in args:  # an extension run: its history, as the example writes it
            os.makedirs(out, exist_ok=True)
            torch.save({"history": [{"step": 0, "accuracy": 0.25}, {"step": 2, "accuracy": 1.0}]},
                       os.path.join(out, "trainer_state.pt"))
        if "--seed" not in args:  # the run read back at the demo's length
            return {"accuracy_after": 0.96}
        seed = int(args[args.index("--seed") + 1])
        return {"seq_len": 128, "pattern": None, "steps": 2, "accuracy_after": 1.0 - seed / 10,
                "accuracy_by_depth": {"0.0": 1.0, "0.5": 1.0 - seed / 5}, "wall_s": 1.0,
                "step_s_at_full_length": 0.5}

    monkeypatch.setattr(linear, "launch", launch)
    args = ["--parts", "extension", "--ranks", "1", "--extend-from", "64", "--extend-to", "128",
            "--extend-steps", "2", "--extend-modes", "linear", "--out", str(tmp_path)]
    linear.main(args + ["--seeds", "0", "1"])
    linear.main(args + ["--seeds", "1", "2"])  # seed 1 again: its row replaced, seed 2 joins
    rows = json.load(open(tmp_path / "linear.json"))["extension"]
    assert [(r["seed"], r["after_over_depths"], r["before"], r["curve"]) for r in rows] == [
        (0, 1.0, 0.25, "1.00"), (1, 0.9, 0.25, "1.00"), (2, 0.8, 0.25, "1.00")]
    assert all(r["after_at_from"] == 0.96 and r["settings"]["seed"] == r["seed"] for r in rows)
    demos = [a for a in launched if "--model" not in a]
    assert len(demos) == 2 and all(a[a.index("--seed") + 1] == "0" for a in demos)  # one demo per command
    tuned = [a for a in launched if "--eval-every" in a]
    assert [a[a.index("--seed") + 1] for a in tuned] == ["0", "1", "1", "2"]
    assert all(a[a.index("--model") + 1] == demos[0][demos[0].index("--output") + 1] for a in tuned[:2])


def test_runs_side_by_side_give_each_row_as_it_ends_and_a_failure_after_the_runs_under_way():
    import threading

    second_started = threading.Event()

    def one(job):
        if job == "slow":
            assert second_started.wait(10)  # both run at once
            return {"job": job}
        second_started.set()
        if job == "fails":
            raise RuntimeError("out of memory")
        return {"job": job}

    got = []
    with pytest.raises(RuntimeError, match="out of memory"):
        for row in linear.side_by_side(["slow", "fails", "never"], one, parallel=2):
            got.append(row["job"])
    assert got == ["slow"]  # the run under way gave its row; the one not started never ran
    assert [r["job"] for r in linear.side_by_side(["a", "b", "c"], lambda j: {"job": j}, 1)] == ["a", "b", "c"]


def test_a_part_run_again_can_replace_the_rows_no_command_wrote(tmp_path, monkeypatch):
    """Rows the benchmark did not write stay unless the run says otherwise; then the part holds only what it
    wrote, and the other parts keep theirs. A row gathered by hand with the example's command is one of those."""
    legacy = {"runs": [], "rows": [{"n": 64, "seed": 0}], "extension": [],
              "timing": [{"n": 64, "base_segment": 16, "dense_step_s": 9.0, "linear_step_s": 1.0},
                         {"n": 32, "base_segment": 16, "dense_step_s": 9.0, "linear_step_s": 1.0,
                          "command": "finetune.py --seq-len 32"}]}
    json.dump(legacy, open(tmp_path / "linear.json", "w"))
    monkeypatch.setattr(linear, "timing", lambda script, sizes, ranks, steps, repeats, base, work: [
        {"n": n, "ranks": ranks, "base_segment": base, "dense_step_s": 2.0, "linear_step_s": 1.0} for n in sizes])
    args = ["--parts", "timing", "--ranks", "1", "--base-segment", "16", "--out", str(tmp_path), "--timing-sizes"]
    linear.main(args + ["64"])
    kept = json.load(open(tmp_path / "linear.json"))
    assert [r.get("settings") is None for r in kept["timing"]] == [True, True, False]
    linear.main(args + ["64", "128", "--replace-unrecorded"])
    replaced = json.load(open(tmp_path / "linear.json"))
    assert [(r["n"], r["dense_step_s"]) for r in replaced["timing"]] == [(64, 2.0), (128, 2.0)]
    assert all("settings" in r for r in replaced["timing"]) and replaced["rows"] == legacy["rows"]
