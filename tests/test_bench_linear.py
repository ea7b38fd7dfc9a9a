"""``python -m bench linear``'s timing part end to end at toy sizes: one rank, real launches of the example."""
import json

from bench import linear


def test_timing_rows_compare_like_with_like(tmp_path):
    linear.main(["--parts", "timing", "--ranks", "1", "--timing-sizes", "64", "128", "--timing-steps", "1",
                 "--base-segment", "16", "--out", str(tmp_path)])
    rows = json.load(open(tmp_path / "linear.json"))["timing"]
    assert [(r["n"], r["base_segment"]) for r in rows] == [(64, 16), (128, 16)]
    for r in rows:
        assert r["step_over_dense"] == round(r["linear_step_s"] / r["dense_step_s"], 3)
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
    assert linear.merge(old, new) == [old[0], new[0], new[1]]
