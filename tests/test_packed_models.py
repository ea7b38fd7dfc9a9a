"""Packed rows (DataCollatorWithFlattening) through a model: every document as if it ran alone."""
import pytest
import torch
from transformers import DataCollatorWithFlattening

import hf_ring
from model_cases import packed_train_case
from helpers import close, dilated_sdpa_mask, rel_err, scalar_rel_err
from models import load, saved_model_dir

TOL = 1e-5
LENGTHS = [15, 25, 1, 9, 30]  # a one-token document too


def features(seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 97, (n,), generator=g).tolist()} for n in lengths]


def separately(path, feats):
    """Loss, logits and gradients of running each document alone with sdpa, weighted as the packed loss weighs them."""
    return _alone_with(load(path, "sdpa").train(), feats)


def check(loss, logits, grads, ref):
    ref_loss, ref_logits, ref_grads = ref
    assert close(scalar_rel_err(loss, ref_loss), TOL)
    assert close(rel_err(logits, ref_logits), TOL)
    worst = max(rel_err(grads[k], ref_grads[k]) for k in ref_grads)
    assert close(worst, TOL), worst


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_flattened_batch_in_one_process_equals_documents_alone(kind):
    path = saved_model_dir(kind) if kind == "llama" else saved_model_dir("mistral", sliding_window=6)
    feats = features(1)
    model = load(path, "ring_dilated").train()
    batch = DataCollatorWithFlattening()(feats)
    assert "attention_mask" not in batch  # documents are marked by position_ids alone
    out = model(**batch, use_cache=False)
    out.loss.backward()
    check(float(out.loss.detach()), out.logits.detach()[0], {k: p.grad for k, p in model.named_parameters()},
          separately(path, feats))


def test_flattened_batch_with_varlen_offsets_in_one_process():
    path = saved_model_dir("llama")
    feats = features(2)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(feats)
    model = load(path, "ring_dilated").train()
    out = model(**batch, use_cache=False)
    out.loss.backward()
    check(float(out.loss.detach()), out.logits.detach()[0], {k: p.grad for k, p in model.named_parameters()},
          separately(path, feats))


@pytest.mark.parametrize("world", [2, 3])
def test_flattened_batch_sharded_equals_documents_alone(pools, world):
    path = saved_model_dir("llama")
    feats = features(3)
    ref = separately(path, feats)
    for res in pools(world).run(packed_train_case, path, feats):
        check(res["loss"], res["logits"][0], res["grads"], ref)


def test_flattened_batch_sharded_dilated_equals_documents_alone(pools):
    """Dilated segments start at each document's start: the same as each document run alone, dilated."""
    path = saved_model_dir("llama")
    pattern = {"segment_lengths": [4, 8, 32], "dilation_rates": [1, 2, 4]}
    feats = features(4)
    branches = tuple(zip(pattern["segment_lengths"], pattern["dilation_rates"]))
    # Independent of hf_ring: transformers' sdpa given the LongNet multiplicities of each document as a log-m mask.
    ref = _alone_with(load(path, "sdpa").train(), feats, lambda n: dilated_sdpa_mask(n, branches, 4))
    for res in pools(2).run(packed_train_case, path, feats, pattern):
        check(res["loss"], res["logits"][0], res["grads"], ref)


SKEWED = [70, 3, 5, 2, 6, 4, 3, 7, 2, 5, 3]
"""One long document, then many short ones: zigzag gives the ranks uneven work; ``balanced`` cuts the long one."""


@pytest.mark.parametrize("world,ulysses", [(2, 1), (4, 1), (4, 2)], ids=["ring-2", "ring-4", "ring-and-heads-4"])
def test_balanced_layout_of_a_skewed_packing_equals_documents_alone(pools, world, ulysses):
    """``layout="balanced"``: the rows follow the plan chosen from the documents (not zigzag's), and loss, logits
    and every gradient equal each document run alone."""
    path = saved_model_dir("llama")
    feats = features(5, SKEWED)
    ref = separately(path, feats)
    results = pools(world).run(packed_train_case, path, feats, layout="balanced", ulysses_size=ulysses)
    for res in results:
        check(res["loss"], res["logits"][0], res["grads"], ref)
    n = sum(SKEWED)
    held = [r["rows"] for r in results]
    assert sorted(sum(held, [])) == list(range(n))
    assert held != [hf_ring.local_positions(n, r, world, "zigzag", ulysses).tolist() for r in range(world)]


def test_balanced_layout_of_a_windowed_model_weighs_its_window(pools):
    """A sliding window of 6 (Mistral): the plan weighs documents by the window's keys (another split than causal
    pairs give), and the step equals each document alone with the window."""
    from hf_ring.engine.balance import plan_documents
    from hf_ring.integration.config import attention_work

    path = saved_model_dir("mistral", sliding_window=6)
    lengths = [40, 3, 5, 2, 6, 4, 3, 7, 2, 5, 3, 20]  # causal pairs cut the 40 and the 20; the window's keys do not
    feats = features(6, lengths)
    ref = separately(path, feats)
    results = pools(2).run(packed_train_case, path, feats, layout="balanced")
    for res in results:
        check(res["loss"], res["logits"][0], res["grads"], ref)
    starts = tuple(sum(lengths[:i]) for i in range(len(lengths)))
    work = attention_work(load(path, "ring_dilated").config)
    plan = plan_documents(sum(lengths), starts, 2, work)
    assert [r["rows"] for r in results] == [[row for a, b in runs for row in range(a, b)] for runs in plan.runs]
    assert plan != plan_documents(sum(lengths), starts, 2)


def test_balanced_layout_with_a_dilated_pattern_equals_documents_alone(pools):
    path = saved_model_dir("llama")
    pattern = {"segment_lengths": [4, 8, 32], "dilation_rates": [1, 2, 4]}
    feats = features(7, SKEWED)
    branches = tuple(zip(pattern["segment_lengths"], pattern["dilation_rates"]))
    ref = _alone_with(load(path, "sdpa").train(), feats, lambda n: dilated_sdpa_mask(n, branches, 4))
    for res in pools(2).run(packed_train_case, path, feats, pattern, layout="balanced"):
        check(res["loss"], res["logits"][0], res["grads"], ref)


def test_balanced_layout_of_documents_shorter_than_the_ranks_pieces(pools):
    """A one-row document and two of 3 rows over 4 ranks: the plan cuts a document into more pieces than it has
    rows, so a rank holds one row or none (its placeholder row), and the step still equals the documents alone."""
    path = saved_model_dir("llama")
    lengths = [1, 3, 3]
    feats = features(8, lengths)
    results = pools(4).run(packed_train_case, path, feats, layout="balanced")
    for res in results:
        check(res["loss"], res["logits"][0], res["grads"], separately(path, feats))
    assert min(len(r["rows"]) for r in results) <= 1


def _alone_with(model, feats, mask_for=None):
    items = sum(len(f["input_ids"]) - 1 for f in feats)
    total, logits = 0.0, []
    for f in feats:
        ids = torch.tensor([f["input_ids"]])
        mask = None if mask_for is None else mask_for(ids.shape[1])
        out = model(input_ids=ids, labels=ids, attention_mask=mask, use_cache=False)
        count = ids.shape[1] - 1
        if count:
            (out.loss * count / items).backward()
            total += float(out.loss.detach()) * count / items
        logits.append(out.logits.detach()[0])
    return total, torch.cat(logits), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_shard_batch_keeps_labels_inside_documents():
    ids = torch.arange(10)[None]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])
    out = hf_ring.shard_batch({"input_ids": ids, "labels": ids.clone(), "position_ids": pos})
    shifted = out["shift_labels"][0].tolist()
    assert shifted == [1, 2, -100, 4, -100, 6, 7, 8, 9, -100]  # no target crosses a border
    assert out["num_items_in_batch"] == 7
    assert out["ring_context"].documents == ((0, 3, 5),)


def test_shard_batch_varlen_offsets_must_match_positions():
    ids = torch.arange(6)[None]
    batch = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
             "cu_seq_lens_q": torch.tensor([0, 2, 6]), "cu_seq_lens_k": torch.tensor([0, 2, 6])}
    with pytest.raises(ValueError, match="mark different documents"):
        hf_ring.shard_batch(batch)
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 3, 6])
    out = hf_ring.shard_batch(batch)
    assert out["ring_context"].documents == ((0, 3),) and "cu_seq_lens_q" not in out


def test_padding_mask_means_no_packing():
    """As in transformers: with an attention mask, restarting position_ids are padding semantics, not documents."""
    ids = torch.arange(6)[None]
    out = hf_ring.shard_batch({"input_ids": ids, "attention_mask": torch.ones(1, 6, dtype=torch.long),
                               "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])})
    assert out["ring_context"].documents is None
