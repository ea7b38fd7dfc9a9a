"""Every input form a model forward takes, with the sequence split: a fuzzed matrix against one process.

Hypothesis draws the batch size, a length from 1 to 3p+1 (ranks may hold no row), left/right/no
padding or packed documents (one-token documents and documents across shard borders included),
labels with ignored spans, ``input_ids`` or ``inputs_embeds``, and dense, sliding-window or dilated
attention; 2 and 3 gloo ranks train one step and must give one process's loss and every gradient
(1e-5 relative per tensor), or the same clear error on every rank for a batch that is refused.
"""
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_ring
from helpers import rel_err
from models import load, saved_model_dir

TOL = 1e-5
EXAMPLES = int(os.environ.get("HF_RING_FUZZ_EXAMPLES", "18"))
"""Examples per world size; CI's run draws the same ones every time, a larger number draws fresh ones."""
PATTERN = {"segment_lengths": [2, 4, 8], "dilation_rates": [1, 2, 4]}
MODELS = {"dense": ("llama", {}), "window": ("mistral", {"sliding_window": 3}), "dilated": ("llama", {})}


def model_paths():
    """Saved once, in the test process (a rank of a gloo world leaves saving to rank 0)."""
    return {name: saved_model_dir(kind, **overrides) for name, (kind, overrides) in MODELS.items()}


def _model(ex, attn: str):
    model = load(ex["paths"][ex["attention"]], attn).train()
    if ex["attention"] == "dilated":
        hf_ring.configure(model, pattern=PATTERN)
    return model


def make_batch(ex):
    """The global batch of one drawn example (built the same way in every process)."""
    g = torch.Generator().manual_seed(ex["seed"])
    b, n = ex["b"], ex["n"]
    ids = torch.randint(3, 97, (b, n), generator=g)
    labels = ids.clone()
    lo, length = ex["ignored"]
    labels[:, lo:lo + length] = -100
    batch = {"labels": labels}
    if ex["form"] == "embeds":
        batch["inputs_embeds"] = torch.randn(b, n, 64, generator=g)
    else:
        batch["input_ids"] = ids
    if ex["layout"] in ("left", "right"):
        mask = torch.ones(b, n, dtype=torch.long)
        pad = min(ex["pad"], n - 1)  # the last row is padded, keeping at least one token
        if pad:
            mask[-1, :pad] = 0 if ex["layout"] == "left" else 1
            mask[-1, n - pad:] = 1 if ex["layout"] == "left" else 0
        labels[mask == 0] = -100
        batch["attention_mask"] = mask
    elif ex["layout"] == "packed":  # documents of the drawn lengths, in turn, from a different one per row
        rows = []
        for r in range(b):
            row, i = [], r
            while len(row) < n:
                row += list(range(ex["docs"][i % len(ex["docs"])]))
                i += 1
            rows.append(row[:n])
        batch["position_ids"] = torch.tensor(rows)
        labels[batch["position_ids"] == 0] = -100  # as DataCollatorWithFlattening: no label across a border
    if ex.get("bad"):
        batch["input_ids"] = ids  # beside inputs_embeds: refused
    return batch


def _step(model, batch):
    out = model(**dict(batch, use_cache=False))  # transformers finds packed documents only without a cache
    out.loss.backward()
    return out.loss.detach().clone()


def sharded_step(ex):
    """This rank's loss and (on rank 0) the summed gradients of one sharded step, or the error it raised.

    Nothing escapes: a failure is returned, so the pool stays usable while hypothesis shrinks an example.
    """
    import traceback

    try:
        return _sharded_step(ex)
    except Exception:  # reported to the test, which fails on it
        return {"crash": traceback.format_exc()}


def _sharded_step(ex):
    from helpers import raises_on_rank

    sp = hf_ring.setup_sequence_parallel(None)
    try:
        model = _model(ex, "ring_dilated")
        batch = make_batch(ex)
        got = {}

        def run():
            got["loss"] = _step(model, hf_ring.shard_batch(batch))

        error = raises_on_rank(run)
        if error is not None:
            return {"error": error}
        hf_ring.sync_gradients(model)
        loss = got["loss"]
        dist.all_reduce(loss, group=sp.sp_group)
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return {"loss": float(loss), "grads": grads if dist.get_rank() == 0 else None}
    finally:
        hf_ring.clear_sequence_parallel()


def reference_step(ex):
    """One process in float64: transformers' sdpa (dense, window; packed rows are its own documents) or, for the
    dilated pattern, ring_dilated (checked against the float64 reference on its own elsewhere)."""
    model = _model(ex, "ring_dilated" if ex["attention"] == "dilated" else "sdpa").double()
    batch = {k: v.double() if v.is_floating_point() else v for k, v in make_batch(ex).items()}
    loss = _step(model, batch)
    return {"loss": float(loss), "grads": {k: p.grad for k, p in model.named_parameters() if p.grad is not None}}


@st.composite
def examples(draw, world):
    n = draw(st.integers(1, 3 * world + 1))
    layout = draw(st.sampled_from(["none", "left", "right", "packed"]))
    ex = {
        "seed": draw(st.integers(0, 10_000)), "b": draw(st.integers(1, 2)), "n": n, "layout": layout,
        "pad": draw(st.integers(1, 4)), "docs": draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)),
        "ignored": (draw(st.integers(0, n)), draw(st.integers(0, 3))),
        "form": draw(st.sampled_from(["ids", "embeds"])),
        "attention": draw(st.sampled_from(["dense", "window", "dilated"])),
        "bad": draw(st.sampled_from([False] * 9 + [True])),
    }
    if ex["bad"]:
        ex["form"] = "embeds"
    return ex


def _check(results, ex):
    if ex["bad"]:
        for r in results:
            assert r.get("error") and r["error"][0] == "ValueError" and "exactly one of" in r["error"][1], r
        return
    assert not any("crash" in r for r in results), [r.get("crash") for r in results]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, (ex, errors)
    ref = reference_step(ex)
    scale = max(abs(ref["loss"]), 1e-30)
    for r in results:
        if ref["loss"] != ref["loss"]:  # every label ignored: transformers gives NaN, and so must the split run
            assert r["loss"] != r["loss"], (ex, r["loss"])
        else:
            assert abs(r["loss"] - ref["loss"]) <= TOL * scale, (ex, r["loss"], ref["loss"])
    got = results[0]["grads"]
    assert set(got) == set(ref["grads"]), (ex, set(got) ^ set(ref["grads"]))
    errs = {}
    for k, g in ref["grads"].items():
        if torch.isnan(g).any():
            continue
        terms = _attention_scale(k, ref["grads"])
        errs[k] = rel_err(got[k], g) if terms is None else float((got[k].double() - g).abs().max()) / terms
    assert not errs or max(errs.values()) <= TOL, (ex, errs)


def _attention_scale(name, grads):
    """The size of the terms whose cancellation makes a q/k projection's gradient zero, where it is.

    When every query with a label sees one key, or keys with equal values, the gradient of the scores
    is ``P * (dO·v - rowsum(dO * O))``, a difference of equal numbers: zero in exact arithmetic, fp32
    rounding of that size in any implementation. Those terms are of the size of the same layer's
    attention gradients; the error is measured against them only where the float64 reference is zero
    to within fp32 rounding of them (see helpers.cancelling_scale for the kernel-level version).
    """
    if "self_attn." not in name:
        return None
    layer = name.split("self_attn.")[0] + "self_attn."
    terms = max(float(g.abs().max()) for k, g in grads.items() if k.startswith(layer))
    return terms if float(grads[name].abs().max()) < 1e-6 * terms else None


@pytest.mark.parametrize("world", [2, 3])
def test_input_forms_match_one_process(pools, world):
    pool, paths = pools(world), model_paths()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES == 18, database=None,
              suppress_health_check=list(HealthCheck))
    @given(examples(world))
    def check(ex):
        ex = dict(ex, paths=paths)
        _check(pool.run(sharded_step, ex), ex)

    check()


def _rows_of(n):
    data = hf_ring.shard_batch({"input_ids": torch.arange(n)[None] + 3, "labels": torch.arange(n)[None] + 3,
                                "token_type_ids": torch.zeros(1, n, dtype=torch.long)})
    return {k: tuple(v.shape) for k, v in data.items() if isinstance(v, torch.Tensor)}


def _sharded_logits(path, n):
    sp = hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        with torch.no_grad():
            out = model(**hf_ring.shard_batch({"input_ids": torch.arange(n)[None] + 3}))
        return hf_ring.gather_sequence(out.logits, n)
    finally:
        hf_ring.clear_sequence_parallel()


def test_a_rank_with_no_rows_runs_a_placeholder_row(pools):
    """Length 1 on 3 ranks: two ranks hold nothing and run one placeholder row; gathered logits are one process's."""
    path = saved_model_dir("llama")
    shapes = pools(3).run(_shapes_case)
    assert [s["input_ids"] for s in shapes] == [(1, 1), (1, 1), (1, 1)]
    assert all(s["token_type_ids"] == (1, 1) for s in shapes)
    ref = load(path, "sdpa")(input_ids=torch.arange(1)[None] + 3).logits
    for got in pools(3).run(_sharded_logits, path, 1):
        assert rel_err(got, ref) <= TOL


def _shapes_case():
    hf_ring.setup_sequence_parallel(None)
    try:
        return _rows_of(1)
    finally:
        hf_ring.clear_sequence_parallel()


def test_unknown_per_token_tensor_is_refused():
    batch = {"input_ids": torch.ones(1, 6, dtype=torch.long), "my_mask": torch.ones(1, 6)}
    with pytest.raises(ValueError, match="does not know whether 'my_mask'"):
        hf_ring.shard_batch(batch)
