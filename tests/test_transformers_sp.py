"""Sequence-parallel training steps on 2 and 4 gloo ranks equal the single-process run."""
import pytest
import torch

import hf_ring
from model_cases import sp_logits_case, sp_train_case
from helpers import dilated_sdpa_mask, rel_err
from models import batch, load, saved_model_dir

pytestmark = pytest.mark.compat  # the subset run on every supported transformers release

TOL = 1e-5


def single_process(path, attn, seeds, b, n, pad="none", mask=None):
    """Loss, logits per batch and gradients averaged over the batches, in one process.

    ``mask`` replaces the batch's attention mask (e.g. a 4-D dilated mask, see helpers).
    """
    losses, logits, grads = [], [], None
    for seed in seeds:
        model = load(path, attn).train()
        data = batch(seed, b, n, pad=pad)
        if mask is not None:
            data["attention_mask"] = mask
        out = model(**data, use_cache=False)
        out.loss.backward()
        losses.append(float(out.loss.detach()))
        logits.append(out.logits.detach())
        g = {name: p.grad / len(seeds) for name, p in model.named_parameters()}
        grads = g if grads is None else {k: grads[k] + g[k] for k in g}
    return losses, logits, grads


def check(results, ref, tol=TOL):
    losses, logits, grads = ref
    for res in results:
        assert abs(res["loss"] - losses[res["dp_rank"]]) <= tol * abs(losses[res["dp_rank"]])
        assert rel_err(res["logits"], logits[res["dp_rank"]]) <= tol
    got = results[0]["grads"]
    worst = max(rel_err(got[k], grads[k]) for k in grads)
    assert worst <= tol, worst


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_sp2_step_equals_single_process_sdpa(pools, kind, layout):
    path = saved_model_dir(kind)
    results = pools(2).run(sp_train_case, path, 2, 10, 2, 37, None, layout)
    check(results, single_process(path, "sdpa", [10], 2, 37))


def test_dp2_sp2_step_equals_single_process_sdpa(pools):
    path = saved_model_dir("llama")
    results = pools(4).run(sp_train_case, path, 2, 20, 1, 29)
    assert sorted(r["dp_rank"] for r in results) == [0, 0, 1, 1]
    check(results, single_process(path, "sdpa", [20, 21], 1, 29))


def test_sp4_with_padding(pools):
    path = saved_model_dir("llama")
    results = pools(4).run(sp_train_case, path, 4, 30, 2, 41, None, "zigzag", "right")
    check(results, single_process(path, "sdpa", [30], 2, 41, pad="right"))


def test_sp2_mistral_sliding_window_across_shards(pools):
    path = saved_model_dir("mistral", sliding_window=6)
    results = pools(2).run(sp_train_case, path, 2, 40, 1, 33)
    check(results, single_process(path, "sdpa", [40], 1, 33))


def test_sp2_dilated_equals_sdpa_with_dilated_mask(pools):
    path = saved_model_dir("llama")
    pattern = {"segment_lengths": [8, 16, 64], "dilation_rates": [1, 2, 4]}
    results = pools(2).run(sp_train_case, path, 2, 50, 1, 45, pattern)
    # The independent run: transformers' sdpa given the LongNet multiplicities as a per-head 4-D mask.
    mask = dilated_sdpa_mask(45, ((8, 1), (16, 2), (64, 4)), load(path, "sdpa").config.num_attention_heads)
    check(results, single_process(path, "sdpa", [50], 1, 45, mask=mask))


def test_dynamic_rope_sharded_equals_unsharded(pools):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    path = saved_model_dir("llama", max_position_embeddings=16, rope_parameters=rope)
    n = 40  # beyond max_position_embeddings, so the frequencies depend on the length
    got = pools(2).run(sp_logits_case, path, n)
    with torch.no_grad():
        ref = load(path, "sdpa")(**batch(0, 1, n)).logits
    for logits in got:
        assert rel_err(logits, ref) <= TOL


def test_shard_batch_short_and_uneven_sequences():
    data = batch(1, 2, 3)
    out = hf_ring.shard_batch(data)
    assert out["ring_context"].seq_len == 3 and out["num_items_in_batch"] == 4
    assert torch.equal(out["shift_labels"][:, :2], data["labels"][:, 1:])
    assert (out["shift_labels"][:, 2] == -100).all()


@pytest.mark.parametrize(
    "data,exc,match",
    [
        ({"labels": torch.zeros(1, 4, dtype=torch.long)}, ValueError, "needs exactly one of 'input_ids'"),
        ({"input_ids": torch.zeros(4, dtype=torch.long)}, ValueError, "2-D"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 5, dtype=torch.long)},
         ValueError, "labels must have the shape"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "ring_context": None}, ValueError, "already sharded"),
        ([1, 2], TypeError, "mapping"),
    ],
)
def test_shard_batch_errors(data, exc, match):
    with pytest.raises(exc, match=match):
        hf_ring.shard_batch(data)


def test_a_custom_4d_mask_under_sequence_parallelism_is_refused_on_every_rank(pools):
    """A mask of every query against every key is not split: shard_batch refuses it naming the fix, and a sharded
    call handed one anyway raises on every rank before any K/V moves."""
    from model_cases import custom_mask_sharded_case

    got = pools(2).run(custom_mask_sharded_case, saved_model_dir("llama"))
    assert got[0] == got[1], got
    by_batch, by_model = got[0]
    assert by_batch[0] == "ValueError" and "4-D mask of every query against every key" in by_batch[1], by_batch
    assert by_model[0] == "ValueError" and "is not sharded by hf_ring" in by_model[1], by_model
