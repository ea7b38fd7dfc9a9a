"""The race against DeepSpeed's Ulysses runs both sides as documented and compares their losses to one process."""
import pytest

pytest.importorskip("deepspeed")

from hf_ring.bench import race  # noqa: E402


def test_race_runs_both_sides_and_scores_them_against_one_process(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    rows = {r["batch"]: r for r in race.run([256], ["dense", "packed"], ["alst", "ring"], 1)}
    assert rows["dense"]["ring_loss_rel_err"] <= 1e-5 and rows["packed"]["ring_loss_rel_err"] <= 1e-5
    assert rows["dense"]["alst_loss_rel_err"] <= 1e-5  # the peer is set up right: exact on a plain sequence
    assert rows["packed"]["alst_loss_rel_err"] > 1e-4  # its sdpa attends across packed documents
    assert rows["dense"]["alst_step_s"] > 0 and rows["dense"]["ring_over_alst"] > 0
