"""``python -m bench demo``: what it reads from the example's output, and how its rows gather in one file."""
import json
import os

import pytest

from bench import demo, tables


def test_recalled_counts_the_answers_that_name_their_passkey():
    printed = ("loading\nprompt 0: passkey  7, model says 7\nprompt 1: passkey 12, model says 21\n"
               "prompt 2: passkey  3, model says a non-key token\nprompt 3: passkey 30, model says 30\n"
               "50% of 4 passkeys recalled from 4096-token prompts (chance 3%), 1.0 s\n")
    assert demo.recalled(printed) == (2, 4)
    with pytest.raises(RuntimeError, match="printed no answers"):
        demo.recalled("Traceback (most recent call last):\n")


def _fake_runs(monkeypatch, accuracy):
    """The example's launches replaced: each writes the files the real one does, with ``accuracy[seed]``."""
    def launch(script, ranks, args):
        out, seed = args[args.index("--output") + 1], int(args[args.index("--seed") + 1])
        assert script == demo.FINETUNE and args[:2] == ["--sp-size", str(ranks)]
        open(os.path.join(out, "accuracy.png"), "wb").write(b"seed %d" % seed)
        return {"steps": 120, "seq_len": 4096, "accuracy_before": 0.0, "accuracy_after": accuracy[seed],
                "accuracy_by_depth": {"0.0": accuracy[seed], "0.5": 1.0}, "chance": 1 / 32, "final_loss": 0.01,
                "wall_s": 100.0}
    monkeypatch.setattr(demo, "launch", launch)
    monkeypatch.setattr(demo, "generate_passkeys",
                        lambda checkpoint: "prompt 0: passkey  1, model says 1\nprompt 1: passkey  2, model says 3\n")


def test_each_seed_joins_the_file_and_a_seed_run_again_replaces_its_own_row(tmp_path, monkeypatch):
    _fake_runs(monkeypatch, {0: 1.0, 1: 0.5, 2: 0.75})
    demo.main(["--seeds", "1", "0", "--out", str(tmp_path)])
    payload = json.load(open(tmp_path / "demo.json"))
    assert [(r["seed"], r["accuracy_after"], r["recalled"], r["prompts"]) for r in payload["rows"]] == [
        (1, 0.5, 1, 2), (0, 1.0, 1, 2)]
    assert payload["figure_seed"] == 1 and open(tmp_path / "demo.png", "rb").read() == b"seed 1"
    row = payload["rows"][0]
    assert row["by_depth"] == "0.50 / 1.00" and row["settings"] == {"ranks": 2, "seed": 1, "device": row["device"]}
    assert row["command"] == f"python -m bench demo --seeds 1 0 --out {tmp_path}" and row["commit"]
    assert row["commands_s"] == pytest.approx(row["finetune_s"] + row["generate_s"], abs=0.11)
    assert all(set(r) <= set(demo.WRITES["demo"]["rows"]) for r in payload["rows"])
    _fake_runs(monkeypatch, {0: 1.0, 1: 0.25, 2: 0.75})
    demo.main(["--seeds", "1", "2", "--out", str(tmp_path)])
    payload = json.load(open(tmp_path / "demo.json"))
    assert [(r["seed"], r["accuracy_after"]) for r in payload["rows"]] == [(1, 0.25), (0, 1.0), (2, 0.75)]
    assert len(payload["runs"]) == 2 and not tables.unwritten({"demo": payload})


def test_bad_seeds_and_ranks_are_refused_before_any_launch(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "launch", lambda *a: pytest.fail("launched"))
    for argv, says in ((["--seeds", "0", "0"], "lists a seed twice"), (["--ranks", "0"], "--ranks must be")):
        with pytest.raises(SystemExit):
            demo.main(argv + ["--out", str(tmp_path)])
        assert says in capsys.readouterr().err
