"""The memory planner's arithmetic, checked against hand-computed bytes."""
import json
import os

from bench import plan

P = plan.LLAMA_8B["params"]


def _rows(**kw):
    args = dict(gpus=8, tokens=131072, gpu_gb=80.0, scale_json=None)
    args.update(kw)
    return {r["engine"]: r for r in plan.run(**args)}


def test_sharded_state_is_sixteen_bytes_per_parameter_over_the_ranks():
    rows = _rows()
    for name in ("FSDP2", "DeepSpeed ZeRO-3", "TP x SP + FSDP2"):
        r = rows[name]
        assert abs(r["weights_gb"] + r["grads_gb"] + r["optimizer_gb"] - 16 * P / 8 / 1e9) < 0.2, name
    ddp = rows["DDP"]
    assert abs(ddp["weights_gb"] + ddp["grads_gb"] + ddp["optimizer_gb"] - 16 * P / 1e9) < 0.2
    assert ddp["fits"] == "no" and rows["FSDP2"]["fits"] == "yes"


def test_activations_follow_the_tokens_each_rank_holds():
    rows = _rows()
    row_gb = plan.LLAMA_8B["hidden"] * 2 / 1e9
    assert abs(rows["FSDP2"]["checkpoints_gb"] - 32 * row_gb * 131072 / 8) < 0.1
    # tp 2 x sp 4: each rank holds a quarter of the sequence, whole rows.
    assert abs(rows["TP x SP + FSDP2"]["checkpoints_gb"] - 2 * rows["FSDP2"]["checkpoints_gb"]) < 0.1
    longer = _rows(tokens=4 * 131072)["FSDP2"]
    assert abs(longer["checkpoints_gb"] - 4 * rows["FSDP2"]["checkpoints_gb"]) < 0.1
    assert longer["total_offloaded_gb"] < longer["total_gb"]


def test_the_committed_plan_is_made_from_the_committed_scale_fit():
    """plan.json is arithmetic over scale.json's fit: a scale.json made again without plan.json would leave the
    plan's rows (and the docs' figures from them) stale."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "bench", "plan.json")) as f:
        payload = json.load(f)
    c = payload["config"]
    rows = plan.run(c["gpus"], c["tokens"], c["gpu_gb"], os.path.join(root, c["scale_json"]))
    assert rows == payload["rows"], "plan.json is stale: python -m bench plan --out docs/bench"
