"""compat.json keeps one row per releases, Python and place: a run again replaces its own row only."""
import json

from bench import compat


def _row(where, result):
    return {"torch": "2.11.0", "transformers": "5.17.0", "accelerate": "1.15.0", "where": where,
            "one_process_logits": result}


def test_a_gpu_row_stays_beside_the_cpu_row_of_the_same_releases(tmp_path):
    compat.write(str(tmp_path), _row("NVIDIA H200", 0.0))
    compat.write(str(tmp_path), _row("CPU, gloo", 1.0))
    compat.write(str(tmp_path), _row("CPU, gloo", 2.0))  # the same place again: replaces its own row
    rows = json.load(open(tmp_path / "compat.json"))["rows"]
    assert sorted((r["where"], r["one_process_logits"]) for r in rows) == [("CPU, gloo", 2.0), ("NVIDIA H200", 0.0)]
