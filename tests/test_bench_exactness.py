"""``python -m bench exactness``: the errors the tests assert are the ones it writes, and only those."""
import json

import pytest

import helpers
from bench import exactness, tables


def test_close_keeps_the_largest_error_per_norm_only_while_recording():
    assert helpers.close(2e-6, 1e-5) and not helpers.close(2e-5, 1e-5) and not helpers.close(float("nan"), 1e-5)
    helpers.RECORDING.append({})
    try:
        helpers.close(3e-7, 1e-5)
        helpers.close(9e-7, 1e-5, "l2")
        helpers.close(1e-7, 1e-5)
        kept = helpers.RECORDING[-1]
    finally:
        helpers.RECORDING.pop()
    assert kept == {"max": 3e-7, "l2": 9e-7}


def test_rows_are_per_test_function_and_norm_with_the_largest_case():
    recorded = {"tests/a.py::test_x[1]": {"max": 2e-7}, "tests/a.py::test_x[2]": {"max": 5.04e-7, "l2": 1e-7},
                "tests/b.py::test_y": {"l2": 3e-8}}
    got = [(r["test"], r["norm"], r["cases"], r["worst"]) for r in exactness.rows(recorded)]
    assert got == [("tests/a.py::test_x", "max", 2, 5e-7), ("tests/a.py::test_x", "l2", 1, 1e-7),
                   ("tests/b.py::test_y", "l2", 1, 3e-8)]


def test_a_real_run_writes_what_the_test_asserted(tmp_path):
    """One process, a packed batch against each document alone in transformers' sdpa: its row is its own
    assertion's error (no other test of the file ran), stamped and keyed by the test."""
    test = "tests/test_packed_models.py::test_flattened_batch_with_varlen_offsets_in_one_process"
    exactness.main(["--tests", test, "--out", str(tmp_path)])
    payload = json.load(open(tmp_path / "exactness.json"))
    (row,) = payload["rows"]
    assert (row["test"], row["norm"], row["cases"]) == (test, "max", 1)
    assert 0 < row["worst"] <= 1e-5 and row["settings"] == {"test": test, "norm": "max"}
    assert not tables.unwritten({"exactness": payload})


def test_a_failing_test_writes_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="failed"):
        exactness.main(["--tests", "tests/test_bench_exactness.py::test_no_such_test", "--out", str(tmp_path)])
    assert not (tmp_path / "exactness.json").exists()
