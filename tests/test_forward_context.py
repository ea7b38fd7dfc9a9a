"""Per-forward facts: one agreement per forward, unsharded forwards refused everywhere, options honoured."""
import pytest
import torch

import hf_ring
import hf_ring.entry.backend
import reference as R
from attention_cases import make_qkv
from model_cases import counted_collectives_case, different_batches_case, mixed_dtype_case, unsharded_forward_case
from helpers import rel_err
from models import saved_model_dir


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_agreement_per_forward_not_per_layer(pools, checkpointing):
    layers = 6
    path = saved_model_dir("llama", num_hidden_layers=layers)
    for res in pools(2).run(counted_collectives_case, path, 40, layers, checkpointing):
        # The ring moves K/V point to point; the only collective is the agreement, once for all six layers,
        # and neither the backward nor the recomputation of checkpointed layers agrees again.
        assert res["forward"] == ["all_gather"], res["forward"]
        assert res["step"] == ["all_gather"], res["step"]
        assert res["agreed"] == 1


def test_unsharded_forward_under_sp_raises_on_every_rank(pools):
    path = saved_model_dir("llama")
    for res in pools(2).run(unsharded_forward_case, path, 24):
        assert res is not None and res[0] == "ValueError", res
        assert "rank(s) [0, 1]" in res[1] and "hf_ring.shard_batch" in res[1]


def test_one_rank_unsharded_raises_the_same_error_on_every_rank(pools):
    path = saved_model_dir("llama")
    results = pools(2).run(unsharded_forward_case, path, 24, (0,))
    assert results[0][0] == results[1][0] == "ValueError", results
    for _, message in results:  # rank 0 is in shard_batch's check, rank 1 in the forward's agreement
        assert "different exchanges" in message and "hf_ring.shard_batch" in message


def test_ranks_sharding_different_batches_raise(pools):
    path = saved_model_dir("llama")
    results = pools(2).run(different_batches_case, path, 24)
    assert results[0] == results[1] and "different batches" in results[0][1], results


def test_dtype_disagreement_is_caught_before_any_exchange(pools):
    results = pools(2).run(mixed_dtype_case, 20)
    assert results[0] == results[1], results
    assert results[0][0] == "ValueError" and "dtype" in results[0][1] and "float16" in results[0][1]


class _Attn(torch.nn.Module):
    is_causal = True

    def __init__(self, config):
        super().__init__()
        self.config = config


@pytest.mark.parametrize("is_causal", [False, True])
def test_is_causal_keyword_wins_over_the_module_attribute(is_causal):
    """transformers' own backends honour an ``is_causal`` keyword before ``module.is_causal``."""
    from models import tiny_config

    q, k, v, _ = make_qkv(1, 2, 4, 2, 19, 16)
    module = _Attn(tiny_config())
    out, _ = hf_ring.entry.backend.ring_dilated_attention(module, q, k, v, None, scaling=0.25, is_causal=is_causal)
    ref = R.dense_attention(q, k, v, causal=is_causal, scale=0.25)
    assert rel_err(out.transpose(1, 2), ref) <= 1e-5


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_4d_mask_of_the_callers_own_is_computed_as_sdpa_computes_it(kind):
    """A 4-D mask given to the model reaches the attention as it is: in one process, what it says is attended (here
    a row's own key and the first, whatever causality says), boolean or additive, broadcast over batch and heads."""
    from models import tiny_config

    q, k, v, _ = make_qkv(1, 2, 2, 2, 6, 8)
    allowed = torch.eye(6, dtype=torch.bool)
    allowed[:, 0] = True
    mask = allowed[None, None] if kind == "bool" else torch.zeros(1, 1, 6, 6).masked_fill(~allowed, float("-inf"))
    out, _ = hf_ring.entry.backend.ring_dilated_attention(_Attn(tiny_config()), q, k, v, mask, scaling=0.3)
    bias = torch.zeros(6, 6, dtype=torch.float64).masked_fill(~allowed, float("-inf"))[None, None]
    assert rel_err(out.transpose(1, 2), R.attention(q, k, v, bias=bias, scale=0.3)) <= 1e-5


@pytest.mark.parametrize("name", ["head_mask", "attention_chunk_size", "block_sequence_ids"])
def test_unimplemented_attention_arguments_are_refused_not_dropped(name):
    from models import tiny_config

    q, k, v, _ = make_qkv(1, 1, 2, 2, 6, 8)
    with pytest.raises(NotImplementedError, match=name):
        hf_ring.entry.backend.ring_dilated_attention(_Attn(tiny_config()), q, k, v, None, **{name: torch.ones(2)})


def test_mixed_dtypes_under_autocast_run_in_autocast_dtype():
    """Under CPU bf16 autocast the rotary embedding returns fp32 q/k beside a bf16 v: run as sdpa does."""
    from models import batch, load

    path = saved_model_dir("llama")
    data = batch(2, 1, 24)
    outs = {}
    for attn in ("sdpa", "ring_dilated"):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            outs[attn] = load(path, attn)(**data).logits.float()
    assert rel_err(outs["ring_dilated"], outs["sdpa"]) <= 2e-2


def test_mixed_dtypes_without_autocast_are_refused():
    from models import tiny_config

    q, k, v, _ = make_qkv(1, 1, 2, 2, 6, 8)
    with pytest.raises(TypeError, match="share one dtype"):
        hf_ring.entry.backend.ring_dilated_attention(_Attn(tiny_config()), q, k, v.to(torch.bfloat16), None)


def test_bad_batch_on_one_rank_raises_the_same_error_on_every_rank(pools):
    from model_cases import one_rank_bad_batch_case

    results = pools(3).run(one_rank_bad_batch_case, 12)
    assert results[0] == results[1] == results[2], results
    assert results[0][0] == "ValueError" and results[0][1].startswith("rank 2: labels must have the shape")


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, 0.0])
def test_unusable_scale_is_refused(scale):
    q, k, v, _ = make_qkv(1, 1, 2, 2, 6, 8)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        hf_ring.ring_attention(q, k, v, scale=scale)


@pytest.mark.parametrize("rows", [0, -3, 2.5, True])
def test_bad_message_rows_are_refused(rows):
    q, k, v, _ = make_qkv(1, 1, 2, 2, 6, 8)
    with pytest.raises(ValueError, match="message_rows must be a positive int"):
        hf_ring.ring_attention(q, k, v, message_rows=rows)


def test_ranks_with_different_message_sizes_fail_alike(pools):
    from attention_cases import options_case

    res = pools(2).run(options_case, [{"message_rows": 2}, {}])
    assert res[0] == res[1] and res[0][0] == "ValueError" and "different message_rows" in res[0][1], res
