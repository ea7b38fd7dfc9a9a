"""The race against DeepSpeed's Ulysses runs both sides as documented and compares their losses to one process."""
import pytest

pytest.importorskip("deepspeed")

from bench import race  # noqa: E402


def test_race_runs_both_sides_and_scores_them_against_one_process(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    rows = {r["batch"]: r for r in race.run([256], ["dense", "packed"], ["alst", "ring"], 1)}
    assert rows["dense"]["ring_loss_rel_err"] <= 1e-5 and rows["packed"]["ring_loss_rel_err"] <= 1e-5
    assert rows["dense"]["alst_loss_rel_err"] <= 1e-5  # the peer is set up right: exact on a plain sequence
    assert rows["packed"]["alst_loss_rel_err"] > 1e-4  # its sdpa attends across packed documents
    assert rows["dense"]["alst_step_s"] > 0 and rows["dense"]["ring_over_alst"] > 0
    low, high = map(float, rows["dense"]["ring_over_alst_range"].split("–"))  # one round: its one ratio
    assert low == high > 0


def test_profile_parts_name_where_each_operator_goes():
    assert race.profile_part("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention kernels"
    assert race.profile_part("aten::mm") == "matmuls"
    assert race.profile_part("aten::silu_backward") == "element-wise"
    assert race.profile_part("aten::copy_") == "copies and fills"
    for op in ("c10d::recv_", "deepspeed::dim_zero_all_to_all", "RingAttentionFunctionBackward",
               "_HeadParallelAttention", "GeneratedBackwardFor_deepspeed_dim_zero_all_to_all_default"):
        assert race.profile_part(op) == "communication and waits", op
    assert race.profile_part("aten::view") == race.profile_part("autograd::engine::evaluate_function: MmBackward0") == "rest"


def test_breakdown_profiles_a_step_per_side():
    (row,) = race.breakdown([128], ["head"], steps=2)
    assert row["steps"] == 2
    assert row["attention kernels"] > 0 and row["communication and waits"] > 0 and row["matmuls"] > 0
    assert row["total"] == pytest.approx(sum(row[p] for p in race.PROFILE_PARTS), abs=0.2)


def test_race_rows_of_two_commands_gather_in_one_file_keyed_by_their_settings(tmp_path, monkeypatch):
    """8K and 16K can run as two commands: each row is stamped and replaces only the row of its own settings."""
    import json

    from bench import model, tables

    def run_ranks(world, fn, *args, **kwargs):
        if fn is race.reference_loss:
            return [2.0]
        name, batch, n, repeats = args
        step = {"alst": 2.0, "ring": 1.0, "head": 1.5}[name] * n / 1000
        return [{"first_loss": 2.0, "times": [step] * repeats, "extra_mb": n / 100}] * world

    monkeypatch.setattr(race, "run_ranks", run_ranks)
    json.dump({"config": {"by": "hand"}, "model": {}, "rows": [{"n": 1, "batch": "dense"}]},
              open(tmp_path / "race.json", "w"))
    out = ["--peers", "--out", str(tmp_path), "--batches", "dense", "packed", "--rounds", "2", "--repeats", "1"]
    model.main(out + ["--sizes", "1000", "--replace-unrecorded"])
    model.main(out + ["--sizes", "2000"])
    model.main(out + ["--sizes", "1000", "--batches", "dense"])
    saved = json.load(open(tmp_path / "race.json"))
    assert [(r["n"], r["batch"]) for r in saved["rows"]] == [(1000, "dense"), (1000, "packed"), (2000, "dense"),
                                                            (2000, "packed")]
    assert saved["rows"][0]["command"].endswith("--batches dense") and saved["rows"][1]["command"].endswith("1000 --replace-unrecorded")
    assert saved["rows"][0]["settings"] == {"sides": ["alst", "ring", "head"], "n": 1000, "batch": "dense", "ranks": 2}
    assert saved["rows"][2]["ring_over_alst"] == 0.5 and saved["rows"][2]["ring_over_alst_range"] == "0.500–0.500"
    assert len(saved["runs"]) == 3 and saved["model"] == race.RACE_MODEL and "config" not in saved
    assert tables.unwritten({"race": saved}) == []


def test_profile_rows_join_race_profile_keyed_by_length_and_side(tmp_path, monkeypatch):
    import json

    from bench import model, tables

    monkeypatch.setattr(race, "run_ranks", lambda world, fn, *a, **k: [dict.fromkeys(race.PROFILE_PARTS, 1.0)] * world)
    out = ["--peers", "--profile", "--out", str(tmp_path), "--sides", "ring", "head"]
    model.main(out + ["--sizes", "1000", "2000"])
    model.main(out + ["--sizes", "2000", "--repeats", "3"])
    saved = json.load(open(tmp_path / "race_profile.json"))
    assert [(r["n"], r["side"], r["steps"]) for r in saved["rows"]] == [(1000, "ring", 5), (1000, "head", 5),
                                                                       (2000, "ring", 3), (2000, "head", 3)]
    assert saved["rows"][0]["total"] == 6.0 and tables.unwritten({"race_profile": saved}) == []
