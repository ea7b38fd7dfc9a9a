"""compat.json keeps one row per releases and Python: a run again replaces its own row only."""
import json

from bench import compat, tables


def _row(python, result):
    return {"torch": "2.11.0", "transformers": "5.17.0", "accelerate": "1.15.0", "python": python,
            "where": compat.WHERE, "one_process_logits": result, "command": "python -m bench compat",
            "commit": "abc"}


def test_a_run_again_replaces_its_own_row_only(tmp_path):
    compat.write(str(tmp_path), _row("3.12.1", 0.0))
    compat.write(str(tmp_path), _row("3.11.7", 1.0))
    compat.write(str(tmp_path), _row("3.11.7", 2.0))
    saved = json.load(open(tmp_path / "compat.json"))
    assert sorted((r["python"], r["one_process_logits"]) for r in saved["rows"]) == [("3.11.7", 2.0), ("3.12.1", 0.0)]
    assert tables.unwritten({"compat": saved}) == []


def test_a_row_without_its_command_is_flagged_and_replaced_when_asked(tmp_path):
    by_hand = {k: v for k, v in _row("3.10.13", 0.0).items() if k not in ("command", "commit")}
    compat.write(str(tmp_path), by_hand)
    saved = json.load(open(tmp_path / "compat.json"))
    assert tables.unwritten({"compat": saved}) == ["compat.json rows[0]: no command or commit"]
    compat.write(str(tmp_path), _row("3.12.1", 0.0))
    assert len(json.load(open(tmp_path / "compat.json"))["rows"]) == 2
    compat.write(str(tmp_path), _row("3.11.7", 0.0), replace_unrecorded=True)
    assert [r["python"] for r in json.load(open(tmp_path / "compat.json"))["rows"]] == ["3.11.7", "3.12.1"]


def test_the_gpu_machines_stack_is_a_row_of_the_matrix():
    assert {"torch": "2.11.0", "transformers": "5.17.0", "accelerate": "1.15.0", "python": "3.12"} in compat.MATRIX
