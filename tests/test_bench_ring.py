"""``python -m bench ring --wire``: the planned traffic in the docs is what the schedules plan today."""
import json
import os

from bench import ring


def test_the_committed_wire_plan_is_what_the_schedules_plan():
    """ring_wire.json is arithmetic over the engine's schedules, with no processes: a change to the schedules that
    moves a byte leaves it stale unless the file is made again."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "bench", "ring_wire.json")) as f:
        payload = json.load(f)
    assert ring.wire_rows() == payload["rows"], "ring_wire.json is stale: python -m bench ring --wire --out docs/bench"
