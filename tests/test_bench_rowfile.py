"""Benchmark files that runs add rows to: keyed by settings, stamped, nothing merged by hand."""
import json

import pytest

from bench import quality, rowfile, scale, tables


def _file(tmp_path, command="python -m bench f", **kw):
    writes = {"rows": ("n", "x") + rowfile.RECORDED, "other": ("n",) + rowfile.RECORDED}
    keys = {"rows": (("opt",), ("n",)), "other": ((), ("n",))}
    return rowfile.RowFile(str(tmp_path), "f", writes, {"opt": 1}, command, "abc", keys=keys, **kw)


def test_a_row_replaces_the_row_of_its_settings_and_joins_after_the_others(tmp_path):
    sink = _file(tmp_path)
    sink.keep("rows", {"n": 1, "x": 1})
    sink.keep("rows", {"n": 2, "x": 2})
    _file(tmp_path, "python -m bench f --n 1").keep("rows", {"n": 1, "x": 3})
    saved = json.load(open(tmp_path / "f.json"))
    assert [(r["n"], r["x"]) for r in saved["rows"]] == [(1, 3), (2, 2)]
    assert saved["rows"][0]["settings"] == {"opt": 1, "n": 1} and saved["rows"][0]["command"] == "python -m bench f --n 1"
    assert saved["rows"][0]["commit"] == "abc"
    assert saved["runs"] == [{"command": "python -m bench f", "commit": "abc", "options": {"opt": 1}},
                             {"command": "python -m bench f --n 1", "commit": "abc", "options": {"opt": 1}}]


def test_a_run_leaves_the_runs_once_no_row_of_it_is_left(tmp_path):
    old = {"n": 0, "x": 0, "settings": {"opt": 1, "n": 0}, "command": "zeroth", "commit": "abc"}  # its run unstamped
    json.dump({"runs": [{"opt": 0}], "rows": [{"n": -1, "x": 0}, old], "other": []}, open(tmp_path / "f.json", "w"))
    _file(tmp_path, "first").keep("rows", {"n": 1, "x": 1})
    _file(tmp_path, "first").keep("rows", {"n": 2, "x": 1})  # the same command again: one entry
    saved = json.load(open(tmp_path / "f.json"))
    assert [r.get("command") for r in saved["runs"]] == [None, "first"]  # rows from before runs were stamped
    _file(tmp_path, "second", replace_unrecorded=True).keep("rows", {"n": 1, "x": 2})
    runs = json.load(open(tmp_path / "f.json"))["runs"]
    assert [r.get("command") for r in runs] == [None, "first", "second"]  # the row of "zeroth" is still there
    _file(tmp_path, "third").keep("rows", {"n": 0, "x": 3})
    _file(tmp_path, "third").keep("rows", {"n": 2, "x": 3})
    assert [r["command"] for r in json.load(open(tmp_path / "f.json"))["runs"]] == ["second", "third"]


def test_keys_beside_merge_or_replace_and_derived_keys_are_made_from_all_rows(tmp_path):
    derive = lambda payload: {"total": sum(r["x"] for r in payload["rows"])}  # noqa: E731
    sink = _file(tmp_path, beside=("model", "parts", "total"), derive=derive)
    sink.keep("rows", {"n": 1, "x": 1}, beside={"parts": {"a": 1}, "model": "m1"})
    sink.keep("rows", {"n": 2, "x": 5}, beside={"parts": {"b": 2}, "model": "m2"})
    saved = json.load(open(tmp_path / "f.json"))
    assert saved["parts"] == {"a": 1, "b": 2} and saved["model"] == "m2" and saved["total"] == 6


def test_a_key_added_by_hand_is_dropped_and_unrecorded_rows_only_when_asked(tmp_path):
    legacy = {"rows": [{"n": 0, "x": 0}], "other": [{"n": 0}], "note": "merged by hand"}
    json.dump(legacy, open(tmp_path / "f.json", "w"))
    _file(tmp_path).keep("rows", {"n": 1, "x": 1})
    saved = json.load(open(tmp_path / "f.json"))
    assert "note" not in saved and [r["n"] for r in saved["rows"]] == [0, 1]
    sink = _file(tmp_path, replace_unrecorded=True)
    sink.keep("rows", {"n": 2, "x": 2})
    saved = json.load(open(tmp_path / "f.json"))
    assert [r["n"] for r in saved["rows"]] == [1, 2] and saved["other"] == [{"n": 0}]  # a list it did not write


def test_a_list_the_file_does_not_have_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no list of rows 'row'"):
        _file(tmp_path).keep("row", {"n": 1})
    with pytest.raises(ValueError, match=r"keys name the lists \['rows'\], its rows are \['other', 'rows'\]"):
        rowfile.RowFile(str(tmp_path), "f", {"rows": (), "other": ()}, {}, "c", "abc", keys={"rows": ((), ())})


def test_scale_runs_at_different_lengths_gather_in_one_file_with_one_fit(tmp_path, monkeypatch):
    def run_ranks(world, fn, cfg):
        got = {"step_s": 1.0, "peak_mb": 100.0 + cfg["n"] / world / 1000, "peak_above_base_mb": 1.0,
               "base_mb": 100.0}
        if cfg["breakdown"]:
            got["breakdown"] = {"peak_tracked_mb": 1.0, "by_label": [{"label": "x", "mb": 1.0, "tensors": 1}]}
        return [got] * world

    monkeypatch.setattr(scale, "run_ranks", run_ranks)
    out = ["--out", str(tmp_path), "--ranks", "2"]
    scale.main(out + ["--sizes", "4000", "--tiling", "off"])
    scale.main(out + ["--sizes", "2000", "8000"])
    scale.main(out + ["--sizes", "8000"])  # again: its row replaces the first one's
    saved = json.load(open(tmp_path / "scale.json"))
    assert [(r["tiling"], r["n"]) for r in saved["rows"]] == [("loss+mlp+norm", 2000), ("loss+mlp+norm", 8000),
                                                              ("off", 4000)]
    assert saved["rows"][1]["command"].endswith("--sizes 8000")
    assert [r["command"].split("--sizes ")[1] for r in saved["runs"]] == ["4000 --tiling off", "2000 8000", "8000"]
    assert set(saved["fits"]) == {"dilated tiling=loss+mlp+norm"} and saved["fits"]["dilated tiling=loss+mlp+norm"]["points"] == 2
    assert set(saved["breakdowns"]) == {"dilated tiling=off n=4000 p=2", "dilated tiling=loss+mlp+norm n=8000 p=2"}
    assert saved["model"]["hidden_size"] == 256 and tables.unwritten({"scale": saved}) == []
    scale.main(out + ["--sizes", "4000", "--tiling", "off", "--breakdown", "none"])  # its breakdown goes with it
    assert set(json.load(open(tmp_path / "scale.json"))["breakdowns"]) == {"dilated tiling=loss+mlp+norm n=8000 p=2"}


def test_quality_rows_of_two_commands_gather_and_a_timing_row_records_its_spread(tmp_path, monkeypatch):
    def launch(script, ranks, args):
        n = int(args[args.index("--seq-len") + 1])
        dilated = "--dilated" in args
        return {"pattern": {"segment_lengths": [n], "dilation_rates": [1]} if dilated else None, "steps": 3,
                "accuracy_after": 1.0, "accuracy_by_depth": {"0.0": 1.0}, "peak_rss_mb_per_rank": [1.0, 2.0],
                "step_s_at_full_length": 0.5 if dilated else 1.0}

    monkeypatch.setattr(quality, "launch", launch)
    out = ["--out", str(tmp_path), "--convert-steps", "--timing-repeats", "2"]
    quality.main(out + ["--sizes", "64", "--seeds", "0", "1"])
    quality.main(out + ["--sizes", "128"])
    quality.main(out + ["--sizes", "64", "--seeds", "1", "--timing-only"])
    saved = json.load(open(tmp_path / "quality.json"))
    assert [(r["n"], r["attention"], r["seed"]) for r in saved["rows"]] == [
        (64, "dense", 0), (64, "dilated", 0), (64, "dense", 1), (64, "dilated", 1), (128, "dense", 0),
        (128, "dilated", 0)]
    assert [r["n"] for r in saved["timing"]] == [64, 128] and saved["timing"][0]["command"].endswith("--timing-only")
    assert saved["timing"][0]["step_over_dense_range"] == "0.500–0.500" and saved["timing"][0]["repeats"] == 2
    assert tables.unwritten({"quality": saved}) == []


def test_quality_refuses_conversion_steps_its_table_has_no_column_for_or_never_evaluates(capsys):
    with pytest.raises(SystemExit):
        quality.main(["--convert-steps", "10", "30"])
    assert "invalid choice: 30" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quality.main(["--convert-steps", "20", "10"])
    assert "every other must be a multiple of it; got [20, 10]" in capsys.readouterr().err
