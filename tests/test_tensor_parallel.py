"""Tensor parallelism x sequence parallelism: a (dp, sp, tp) training step equals one process on the whole input.

The reference is transformers' own ``sdpa`` in one process on the unsharded
batch (dilated attention as a per-head LongNet mask, packed documents run one
by one), an implementation independent of hf_ring. Every tensor is compared
by ``||got - ref|| / ||ref||`` with no absolute floor.
"""

import pytest

import hf_ring
from helpers import close, dilated_sdpa_mask, norm_rel_err
from models import load, saved_model_dir
from tp_cases import _data, data_mesh_case, different_tp_batches_case, tp_refusal_case, tp_step_case, trainer_refusal_case

from hf_ring.integration.seams import TENSOR_PARALLEL_SINCE, since

pytestmark = pytest.mark.skipif(not since(TENSOR_PARALLEL_SINCE), reason=f"tensor parallelism of a loaded model needs transformers "
                                f">={TENSOR_PARALLEL_SINCE} (test_compat checks the refusal)")

TOL = 1e-5
DILATED = {"segment_lengths": [8, 16, 64], "dilation_rates": [1, 2, 4]}
"""Rate 4 over 4 query heads: tp rank 1 holds heads 2 and 3, whose offsets (2, 3) differ from local heads 0, 1."""
DOCUMENTS = [15, 25, 1, 9, 30]


def reference(path, seeds, b, n, *, pattern=None, documents=None):
    """Loss per seed (a dp replica's batch) and every gradient of their mean, sdpa in one process."""
    losses, grads = [], None
    for seed in seeds:
        model = load(path, "sdpa").train()
        data = _data(seed, b, n, documents)
        loss = _documents_loss(model, data, documents) if documents else _loss(model, data, pattern)
        loss.backward()
        losses.append(float(loss.detach()))
        g = {k: p.grad / len(seeds) for k, p in model.named_parameters()}
        grads = g if grads is None else {k: grads[k] + g[k] for k in g}
    return losses, grads


def _loss(model, data, pattern):
    if pattern is not None:
        branches = tuple(zip(pattern["segment_lengths"], pattern["dilation_rates"]))
        data = dict(data, attention_mask=dilated_sdpa_mask(data["input_ids"].shape[1], branches,
                                                           model.config.num_attention_heads))
    return model(**data, use_cache=False).loss


def _documents_loss(model, data, documents):
    """The packed row's loss: each document alone, weighted by its share of the row's targets."""
    ids, items, total, start = data["input_ids"], sum(n - 1 for n in documents), 0.0, 0
    for n in documents:
        doc = ids[:, start:start + n]
        if n > 1:
            total = total + model(input_ids=doc, labels=doc, use_cache=False).loss * (n - 1) / items
        start += n
    return total


def check(results, ref):
    """Every rank's loss (and every tp rank of its group alike) and rank 0's gradients against the reference."""
    losses, grads = ref
    errors = {}
    for res in results:
        want = losses[res["dp_rank"]]
        assert len(set(res["tp_losses"])) == 1, res["tp_losses"]  # the ranks of a tp group compute one loss
        errors[f"loss dp{res['dp_rank']}"] = abs(res["loss"] - want) / abs(want)
    got = results[0]["grads"]
    assert got.keys() == grads.keys()
    errors.update({k: norm_rel_err(got[k], grads[k]) for k in grads})
    worst = max(errors, key=errors.get)
    loss = max(v for k, v in errors.items() if k.startswith("loss"))
    print(f"worst relative error {errors[worst]:.2e} ({worst}); loss {loss:.2e}")
    assert close(errors[worst], TOL, "l2"), (worst, errors[worst])


@pytest.mark.parametrize("return_logits", [False, True])
def test_tp2_sp2_dense(pools, return_logits):
    """The loss sequence-tiled over the gathered vocabulary-sharded lm_head, or transformers' own head (logits)."""
    path = saved_model_dir("llama")
    results = pools(4).run(tp_step_case, path, 2, 2, 10, 2, 37, return_logits=return_logits)
    assert all("DTensor" in r["dtensor"] and r["sync_refused"] is None for r in results)
    assert all(r["tiled_loss"] != return_logits for r in results)
    check(results, reference(path, [10], 2, 37))


def test_tp2_sp2_tied_embeddings(pools):
    """lm_head shares the vocabulary-sharded embeddings, as before the split."""
    path = saved_model_dir("llama", tie_word_embeddings=True)
    check(pools(4).run(tp_step_case, path, 2, 2, 15, 1, 31), reference(path, [15], 1, 31))


def test_tp2_sp2_sliding_window(pools):
    path = saved_model_dir("mistral", sliding_window=6)
    check(pools(4).run(tp_step_case, path, 2, 2, 11, 1, 33), reference(path, [11], 1, 33))


def test_tp2_sp2_dilated(pools):
    """Fails if a tp rank counts its dilation offsets from its local head 0 instead of its global head."""
    path = saved_model_dir("llama")
    results = pools(4).run(tp_step_case, path, 2, 2, 12, 1, 45, pattern=DILATED)
    check(results, reference(path, [12], 1, 45, pattern=DILATED))


def test_tp2_sp2_packed_documents(pools):
    path = saved_model_dir("llama")
    results = pools(4).run(tp_step_case, path, 2, 2, 13, 1, sum(DOCUMENTS), documents=DOCUMENTS)
    check(results, reference(path, [13], 1, sum(DOCUMENTS), documents=DOCUMENTS))


def test_tp2_sp2_head_parallel_dilated(pools):
    """ulysses_size=2 splits each tp rank's 2 query heads (1 K/V head, repeated): both offsets add up."""
    path = saved_model_dir("llama")
    results = pools(4).run(tp_step_case, path, 2, 2, 14, 1, 45, pattern=DILATED, ulysses=2)
    check(results, reference(path, [14], 1, 45, pattern=DILATED))


@pytest.mark.parametrize("whole", [False, True])
def test_dp2_tp2_dilated_without_sequence_split(pools, whole):
    """sp_size 1: the tp offset reaches the attention with shard_batch and without it (whole sequences)."""
    path = saved_model_dir("llama")
    results = pools(4).run(tp_step_case, path, 1, 2, 16, 1, 45, pattern=DILATED, whole=whole)
    check(results, reference(path, [16, 17], 1, 45, pattern=DILATED))


def test_dp2_sp2_tp2_fsdp2(pools):
    """8 ranks: FSDP2 over the dp x sp ranks and TP over consecutive pairs, both from transformers' loading.

    The vocabulary is a multiple of tp x fsdp = 8: transformers 5.24 loads an uneven split of it into shards of
    the wrong size (its load report says MISMATCH and re-initialises them) and FSDP2's gather then hangs.
    """
    path = saved_model_dir("llama", vocab_size=128)
    results = pools(8).run(tp_step_case, path, 2, 2, 20, 1, 29, pattern=DILATED, fsdp=True)
    assert sorted(r["dp_rank"] for r in results) == [0] * 4 + [1] * 4
    assert all("A model sharded with FSDP2 reduces its gradients itself" in r["sync_refused"] for r in results)
    check(results, reference(path, [20, 21], 1, 29, pattern=DILATED))


def test_refusals(pools):
    """Every rank refuses, with the fix named, what tp cannot run."""
    path = saved_model_dir("llama")
    kv1 = saved_model_dir("llama", num_key_value_heads=1)  # MQA: one K/V head cannot be split over 2 tp ranks
    hq6 = saved_model_dir("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    cases = [
        ((path, None, 3), "tp_size=3 does not divide the 4 processes"),
        ((path, 3, 2), "sp_size=3 x tp_size=2 = 6 does not divide the 4 processes"),
        ((kv1, 2, 2), "tp_size=2 does not divide the model's 1 key/value heads"),
        ((hq6, 2, 2, 2), "ulysses_size=2 does not divide each of the tp_size=2 tensor-parallel ranks' 3 query heads"),
        ((path, 2, 2, 1, "none"), "tp_size=2, but the model is not tensor-parallel"),
        # transformers 5 shards over the whole world whatever device_mesh it is given
        ((path, 2, 2, 1, "transformers"), "the model is tensor-parallel over ranks [0, 1, 2, 3], but this setup's"),
    ]
    for args, message in cases:
        got = pools(4).run(tp_refusal_case, *args)
        assert all(g is not None and message in g for g in got), (message, got)
        assert "ValueError" in got[0]


def test_tp_ranks_with_different_batches_refused(pools):
    got = pools(4).run(different_tp_batches_case)
    assert all(g is not None and "the ranks of a tensor-parallel group passed different batches" in g for g in got), got


def test_one_process_refusals():
    with pytest.raises(ValueError, match="tp_size=2 needs several processes"):
        hf_ring.setup_sequence_parallel(None, tp_size=2)
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        hf_ring.setup_sequence_parallel(None, tp_size=0)
    with pytest.raises(ValueError, match="needs a setup with tp_size > 1"):
        hf_ring.tensor_parallel(load(saved_model_dir("llama"), "ring_dilated"))


def test_no_tp_plan_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=64, n_layer=1, n_head=4,
                                                                  vocab_size=97))
    sp = hf_ring.SequenceParallel(None, None, 0, 1, 0, 1, "zigzag", tp_size=2)
    with pytest.raises(ValueError, match="has no tensor-parallel plan that splits its attention heads"):
        hf_ring.tensor_parallel(model, sp)


def test_prepare_trainer_refusals(pools):
    """A Trainer would wrap a model sharded after loading in DDP: prepare_trainer(tp_size=2) wants it sharded at load.

    (A Trainer of a model that transformers sharded at load time for tensor parallelism builds accelerate's
    ParallelismConfig, which accelerate 1.15 refuses on CPU processes: that route needs GPUs.)
    """
    path = saved_model_dir("llama")
    got = pools(4).run(trainer_refusal_case, path, 2, 2)
    assert all(g is not None and "needs the model sharded at load time by transformers" in g for g in got), got
    got = pools(4).run(trainer_refusal_case, saved_model_dir("llama", num_key_value_heads=1), 2, 2)
    assert all(g is not None and "tp_size=2 does not divide the model's 1 key/value heads" in g for g in got), got
    got = pools(4).run(trainer_refusal_case, path, 2, None, pre_shard=True)  # tp_size: the model's own (none)
    assert all(g is not None and "but the sequence-parallel setup has tp_size=1; pass tp_size=2" in g for g in got), got


def test_trainer_data_mesh_feeds_tp_and_sp_ranks_one_batch(pools):
    """dp2 x tp2 (sp 1): ranks 0, 1 load one replica's rows and 2, 3 the other's; sp2 x tp2: all load the same."""
    got = pools(4).run(data_mesh_case, 1, 2)
    assert got[0]["dims"] == ("dp_replicate", "cp", "tp")
    assert got[0]["rows"] == got[1]["rows"] and got[2]["rows"] == got[3]["rows"]
    assert sorted(got[0]["rows"] + got[2]["rows"]) == list(range(8))
    got = pools(4).run(data_mesh_case, 2, 2)
    assert all(g["rows"] == list(range(8)) for g in got)

