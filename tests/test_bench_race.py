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
