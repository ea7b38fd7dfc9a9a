"""Sharded inputs reach only ring_dilated models; a model on another attention beside them runs as transformers runs it."""
import pytest
import torch
import torch.distributed as dist

import hf_ring
from helpers import raises_on_rank
from models import batch, length_dependent_rope, load, saved_model_dir

N = 37  # past the dynamic RoPE's 16 positions: the ring model's shards need the global length


def _path():
    return saved_model_dir("llama", seed=7, **length_dependent_rope("llama"))


def other_attention_case(path, attn, ring_on_rank1):
    """Every rank gives sharded inputs to a model on ``attn``; or rank 1 gives them to a ring model instead."""
    hf_ring.setup_sequence_parallel(None, 2)
    try:
        use = "ring_dilated" if ring_on_rank1 and dist.get_rank() == 1 else attn
        model = load(path, use).train()
        return raises_on_rank(lambda: model(**hf_ring.shard_batch(batch(1, 2, N))))
    finally:
        hf_ring.clear_sequence_parallel()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("ring_on_rank1", [False, True])
def test_sharded_inputs_into_another_attention_raise_on_every_rank(pools, attn, ring_on_rank1):
    # With one rank on the ring, the other's error rides the ring's agreement exchange, the forward's first
    # collective when the RoPE does not depend on the length (see the test below for one that does).
    path = saved_model_dir("llama", seed=7) if ring_on_rank1 else _path()
    errors = pools(2).run(other_attention_case, path, attn, ring_on_rank1)
    for rank, err in enumerate(errors):
        assert err is not None and err[0] == "ValueError", (rank, err)
        assert f"attn_implementation='{attn}'" in err[1] and "set_attn_implementation('ring_dilated')" in err[1], err
    # the rank that ran the ring model raises the error of the rank that did not, not a vaguer one of its own
    assert "sequence-sharded inputs" in errors[1][1]


def test_another_attention_beside_a_ring_whose_rope_gathers_the_length_fails_both_at_once(pools):
    """The ring model's first exchange gathers the RoPE's global length; the other rank's model is in the agreement
    instead. Both exchanges have one size, so both ranks raise a named error at once instead of timing out."""
    errors = pools(2).run(other_attention_case, _path(), "sdpa", True)
    for rank, err in enumerate(errors):
        assert err is not None and err[0] == "ValueError", (rank, err)
        assert "the ranks reached different exchanges" in err[1] and "ran another model" in err[1], err


def _step(model, data):
    """Whatever a training step of ``model`` returns, detached, and its parameter gradients."""
    model.zero_grad(set_to_none=True)
    out = model(**data)
    tensors = [out.logits.detach()]
    if out.loss is not None:
        out.loss.backward()
        tensors.append(out.loss.detach())
    return tensors, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _identical(a, b):
    return len(a[0]) == len(b[0]) and len(a[1]) == len(b[1]) and all(
        torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))


def beside_case(path):
    """A teacher (sdpa, no labels), a reference model (eager, train mode, labels) and a reward model
    (sequence classification, sdpa) beside a sharded ring model: before the setup, and after it on rank 0 alone."""
    from transformers import AutoModelForSequenceClassification

    hf_ring.clear_sequence_parallel()
    data = batch(2, 2, N)
    labelled = dict(data, use_cache=False)
    torch.manual_seed(0)
    reward = AutoModelForSequenceClassification.from_pretrained(
        path, attn_implementation="sdpa", num_labels=1, pad_token_id=0, dtype=torch.float32).train()
    others = {"teacher": (load(path, "sdpa").eval(), {"input_ids": data["input_ids"]}),
              "reference": (load(path, "eager").train(), labelled),
              "reward": (reward, {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"]})}
    before = {name: _step(model, inputs) for name, (model, inputs) in others.items()}
    hf_ring.setup_sequence_parallel(None, 2)
    try:
        ring = load(path, "ring_dilated").train()
        out = ring(**hf_ring.shard_batch(data))
        out.loss.backward()
        if dist.get_rank() != 0:
            return None
        # rank 0 alone: a collective issued by any of these calls would never complete
        after = {name: _step(model, inputs) for name, (model, inputs) in others.items()}
        return {name: _identical(before[name], after[name]) for name in others} | {
            "reference returns logits": after["reference"][0][0].shape == (2, N, 97)}
    finally:
        hf_ring.clear_sequence_parallel()


def test_models_beside_the_sharded_one_run_as_transformers_runs_them(pools):
    found = pools(2).run(beside_case, _path())[0]
    assert found == {"teacher": True, "reference": True, "reward": True, "reference returns logits": True}, found


def _attention_of_its_own(module, hidden_states, *args, **kwargs):
    """An attention computed by a module's own code, never through transformers' interface (as a model the
    structure checks cannot know would): each rank mixes its own rows only."""
    return hidden_states.cumsum(1) / torch.arange(1, hidden_states.shape[1] + 1).view(1, -1, 1), None


def unmixed_case(path):
    import types

    hf_ring.setup_sequence_parallel(None, 2)
    try:
        model = load(path, "ring_dilated")
        for layer in model.model.layers:
            layer.self_attn.forward = types.MethodType(_attention_of_its_own, layer.self_attn)
        return raises_on_rank(lambda: model(**hf_ring.shard_batch(batch(1, 2, N))))
    finally:
        hf_ring.clear_sequence_parallel()


def test_a_sharded_forward_in_which_no_layer_reached_hf_ring_is_refused_on_every_rank(pools):
    errors = pools(2).run(unmixed_case, saved_model_dir("llama", seed=7))
    for err in errors:
        assert err is not None and err[0] == "ValueError", err
        assert "LlamaForCausalLM (model type 'llama')" in err[1] and "no sequence-mixing layer" in err[1], err
    assert errors[0] == errors[1]


def dropped_context_case():
    import sweep

    hf_ring.setup_sequence_parallel(None, 2)
    try:
        model, _ = sweep.build("nemotron", "ring_dilated")
        return raises_on_rank(lambda: model(**hf_ring.shard_batch(sweep.inputs("nemotron"))))
    finally:
        hf_ring.clear_sequence_parallel()


def test_a_model_whose_layers_drop_the_forwards_context_is_named_with_what_it_drops(pools):
    """Nemotron's decoder layers call their attention without the keyword arguments of model(...): the guard saw
    the sharded call arrive, so the refusal says so instead of asking for shard_batch."""
    errors = pools(2).run(dropped_context_case)
    for err in errors:
        assert err is not None and err[0] == "ValueError", err
        assert "(model type 'nemotron')" in err[1] and "do not hand the keyword arguments" in err[1], err
        assert "shard_batch" not in err[1], err


def _roberta_batch(given_positions: bool):
    """Two rows padded with RoBERTa's own padding id (1): one on the left, one on the right."""
    import sweep

    ids = sweep.inputs("roberta", batch=2, seed=3)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :9], mask[1, -13:] = 0, 0
    ids = ids.masked_fill(mask == 0, 1)
    data = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if given_positions:  # the positions a user may pass: the model then takes them as they are
        data["position_ids"] = torch.arange(ids.shape[1]).expand_as(ids) + 5
    return data


def _roberta_step(model, data):
    out = model(**data)
    out.loss.backward()
    return out.loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()
                               if p.grad is not None}


def roberta_case(given_positions):
    import sweep

    hf_ring.setup_sequence_parallel(None, 2)
    try:
        model, _ = sweep.build("roberta", "ring_dilated", torch.float64)
        loss, grads = _roberta_step(model, hf_ring.shard_batch(_roberta_batch(given_positions)))
        hf_ring.sync_gradients(model)
        dist.all_reduce(loss)
        return loss, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    finally:
        hf_ring.clear_sequence_parallel()


@pytest.mark.parametrize("given_positions", [False, True])
def test_positions_a_model_counts_from_its_own_padding_are_counted_on_the_whole_row(pools, given_positions):
    """RoBERTa numbers its tokens from padding_idx + 1, skipping its padding: each shard is handed what the model
    would count on the whole (left- or right-padded) row, or the positions the batch gave, as one process does."""
    import sweep
    from helpers import close, gradient_errors, rel_err

    model, _ = sweep.build("roberta", "eager", torch.float64)
    want_loss, want = _roberta_step(model, _roberta_batch(given_positions))
    loss, got = pools(2).run(roberta_case, given_positions)[0]
    errs = {"loss": rel_err(loss, want_loss), **gradient_errors(got, want)}
    worst = max(errs, key=errs.get)
    assert set(got) == set(want) and close(errs[worst], 1e-5), (worst, errs[worst])
