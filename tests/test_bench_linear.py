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
