"""The README's benchmark tables come from the benchmarks' JSON, between markers."""
from bench.tables import render, rewrite


def test_tables_render_rows_and_replace_only_between_markers():
    payload = {"rows": [{"n": 8192, "impl": "ring", "world": 2, "layout": "zigzag", "fwd_bwd_s": 1.5,
                         "speedup_over_1_rank": 1.4}]}
    table = render("ring", payload)
    assert table.splitlines()[2] == "| 8192 | ring | 2 | zigzag | 1.5 | 1.4 |"
    text = "before\n<!-- bench:ring -->\nold\n<!-- /bench:ring -->\nafter\n"
    assert rewrite(text, {"ring": table}) == f"before\n<!-- bench:ring -->\n{table}\n<!-- /bench:ring -->\nafter\n"


def test_scale_table_shows_each_point_against_the_fit():
    payload = {"rows": [{"n": 2000, "world": 2, "attention": "dilated", "tiling": "loss", "step_s": 1.0,
                         "peak_mb": 110.0}],
               "fits": {"dilated tiling=loss": {"a_mb": 100.0, "b_mb_per_token": 0.01, "b_kib_per_token": 10.24,
                                                "max_rel_err": 0.0, "points": 2}}}
    table = render("scale", payload)
    assert "| 110.0 | 110 | +0.0% |" in table and "100.0 + 10.24 KiB" in table


def test_a_printed_table_with_no_rows_is_its_header():
    from bench.common import format_table

    assert format_table([], ["n", "label"]) == "| n | label |\n|---|-------|"
    assert format_table([{"n": 12345}], ["n"]).splitlines()[-1] == "| 12345 |"
