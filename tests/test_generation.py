"""hf_ring.generate on 1, 2 and 3 gloo ranks gives the tokens single-process sdpa generate gives."""
import pytest
import torch

import hf_ring
from generation_cases import ListStreamer, lora_generate_case, sdpa_sharded_case, sp_cache_forward_case, sp_diverging_generate_case, sp_generate_case, unseeded_sampling_case, with_lora
from helpers import raises_on_rank
from helpers import dilated_sdpa_mask, rel_err
from models import load, saved_model_dir

pytestmark = pytest.mark.compat  # the subset run on every supported transformers release

NEW = 20
GREEDY = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
PATTERN = hf_ring.DilatedPattern([8, 16, 64], [1, 2, 4])


def mistral_path():
    return saved_model_dir("mistral", sliding_window=8)  # smaller than every prompt here


def prompts(seed, b, n, left_pad=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    if left_pad:
        mask[0, :left_pad] = 0
        ids[0, :left_pad] = 0
    return ids, (mask if left_pad else None)


def sdpa_generate(path, ids, mask, **kw):
    return load(path, "sdpa").generate(ids, attention_mask=mask, **kw)


def assert_balanced(lengths, n, world):
    """Cache rows on this rank after the prefill (n tokens) and after each step (one more each)."""
    for i, rows in enumerate(lengths):
        assert rows <= -(-(n + i) // world) + 1, (i, rows, lengths)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_one_process_equals_sdpa(kind):
    path = saved_model_dir("llama") if kind == "llama" else mistral_path()
    ids, mask = prompts(1, 2, 37, left_pad=5)
    ref = sdpa_generate(path, ids, mask, **GREEDY)
    model = load(path, "ring_dilated")
    assert torch.equal(hf_ring.generate(model, ids, attention_mask=mask, **GREEDY), ref)
    # transformers' own generate with its own cache gives the same tokens too
    assert torch.equal(model.generate(ids, attention_mask=mask, **GREEDY), ref)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_equals_single_process_sdpa(pools, world, kind):
    path = saved_model_dir("llama") if kind == "llama" else mistral_path()
    for n, layout in ((37 + world, "zigzag"), (50 - world, "contiguous")):  # uneven prompt lengths
        ids, _ = prompts(n, 1, n)
        ref = sdpa_generate(path, ids, None, **GREEDY)
        assert len(set(ref[0, n:].tolist())) > 2  # the test means something only if the tokens vary
        for res in pools(world).run(sp_generate_case, path, ids, layout=layout, **GREEDY):
            assert torch.equal(res["sequences"], ref)
            assert len(res["lengths"]) == ref.shape[1] - n  # the prefill and one step per further token
            assert_balanced(res["lengths"], n, world)


@pytest.mark.parametrize("world", [2, 3])
def test_left_padded_batch(pools, world):
    path = saved_model_dir("llama")
    ids, mask = prompts(7, 3, 45, left_pad=11)
    ref = sdpa_generate(path, ids, mask, **GREEDY)
    for res in pools(world).run(sp_generate_case, path, ids, mask, **GREEDY):
        assert torch.equal(res["sequences"], ref)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft reads it
def test_lora_model_equals_single_process_sdpa(pools):
    """A PEFT model's generate runs its base model's forward: the prefill and every step are split all the same."""
    pytest.importorskip("peft")
    path = saved_model_dir("llama")
    ids, mask = prompts(5, 2, 41, left_pad=6)
    ref = with_lora(load(path, "sdpa")).generate(input_ids=ids, attention_mask=mask, **GREEDY)
    assert not torch.equal(ref, load(path, "sdpa").generate(ids, attention_mask=mask, **GREEDY))  # the adapters count
    for res in pools(2).run(lora_generate_case, path, ids, mask, **GREEDY):
        assert torch.equal(res, ref)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft reads it
def test_prompt_learning_model_is_refused():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(load(saved_model_dir("llama"), "ring_dilated"),
                                peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    with pytest.raises(ValueError, match="prompt-learning PEFT model"):
        hf_ring.generate(model, prompts(1, 1, 9)[0], max_new_tokens=2)


def test_mistral_window_smaller_than_prompt_and_padding(pools):
    path = mistral_path()
    ids, mask = prompts(8, 2, 40, left_pad=6)
    ref = sdpa_generate(path, ids, mask, **GREEDY)
    for res in pools(3).run(sp_generate_case, path, ids, mask, **GREEDY):
        assert torch.equal(res["sequences"], ref)


def full_forward_logits(path, seq, n, pattern):
    """Logits of the whole generated sequence in one forward, at the positions that chose each new token.

    Computed by transformers' sdpa with the LongNet multiplicities as a 4-D mask: independent of hf_ring.
    """
    model = load(path, "sdpa")
    branches = tuple(zip(pattern.segment_lengths, pattern.dilation_rates))
    mask = dilated_sdpa_mask(seq.shape[1], branches, model.config.num_attention_heads)
    with torch.no_grad():
        return model(input_ids=seq, attention_mask=mask, use_cache=False).logits[:, n - 1:-1]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_dilated_decode_equals_full_forward_rows(pools, world):
    path = saved_model_dir("llama")
    n = 70  # past the first segments, so steps cross segment boundaries of every branch
    ids, _ = prompts(9, 2, n)
    kw = dict(GREEDY, return_dict_in_generate=True, output_logits=True)
    if world == 1:
        model = load(path, "ring_dilated")
        hf_ring.configure(model, pattern=PATTERN)
        out = hf_ring.generate(model, ids, **kw)
        results = [{"sequences": out.sequences, "logits": torch.stack(out.logits, 1)}]
    else:
        results = pools(world).run(sp_generate_case, path, ids, pattern=PATTERN, **kw)
    ref = full_forward_logits(path, results[0]["sequences"], n, PATTERN)
    for res in results:
        assert torch.equal(res["sequences"], results[0]["sequences"])
        assert rel_err(res["logits"], ref) <= 1e-5


def test_sampling_with_one_seed_matches_across_ranks_and_sdpa(pools):
    from transformers import set_seed

    path = saved_model_dir("llama")
    ids, _ = prompts(10, 2, 33)
    kw = dict(max_new_tokens=NEW, do_sample=True, top_k=30, temperature=1.5, pad_token_id=0)
    set_seed(1234)
    ref = sdpa_generate(path, ids, None, **kw)
    for res in pools(2).run(sp_generate_case, path, ids, seed=1234, **kw):
        assert torch.equal(res["sequences"], ref)


def test_eos_and_streamer_on_rank_zero(pools):
    path = saved_model_dir("llama")
    ids, _ = prompts(11, 1, 31)
    greedy = sdpa_generate(path, ids, None, **GREEDY)
    eos = int(greedy[0, 31 + 4])  # the 5th new token
    kw = dict(GREEDY, eos_token_id=eos)
    ref = sdpa_generate(path, ids, None, **kw)
    assert ref.shape[1] < greedy.shape[1]  # generation did stop early
    results = pools(3).run(sp_generate_case, path, ids, stream=True, **kw)
    for rank, res in enumerate(results):
        assert torch.equal(res["sequences"], ref)
        chunks, ended = res["stream"]
        if rank == 0:
            assert ended and chunks[0] == ids.tolist() and [c[0] for c in chunks[1:]] == ref[0, 31:].tolist()
        else:
            assert chunks == [] and not ended


def test_continuing_a_returned_cache(pools):
    path = saved_model_dir("llama")
    ids, mask = prompts(12, 2, 35, left_pad=4)
    ref = sdpa_generate(path, ids, mask, **GREEDY)
    kw = dict(GREEDY, max_new_tokens=8, return_dict_in_generate=True)
    for res in pools(2).run(sp_generate_case, path, ids, mask, continue_with=NEW - 8, **kw):
        assert torch.equal(res["sequences"], ref)
        assert_balanced(res["lengths"], 35, 2)


def test_streamer_in_one_process():
    path = saved_model_dir("llama")
    ids, _ = prompts(13, 1, 20)
    streamer = ListStreamer()
    out = hf_ring.generate(load(path, "ring_dilated"), ids, streamer=streamer, **GREEDY)
    assert streamer.ended and [c[0] for c in streamer.chunks[1:]] == out[0, 20:].tolist()


# --- bad input -------------------------------------------------------------------------------------------


def test_batch_sizes_differ_across_ranks(pools):
    path = saved_model_dir("llama")
    a, _ = prompts(14, 1, 30)
    b, _ = prompts(14, 2, 30)
    for err in pools(2).run(raises_on_rank, sp_generate_case, path, None, ids_by_rank=[a, b], **GREEDY):
        assert err is not None and err[0] == "ValueError" and "batch sizes [1, 2]" in err[1]


def test_prompts_differ_across_ranks(pools):
    path = saved_model_dir("llama")
    a, _ = prompts(15, 1, 30)
    b, _ = prompts(16, 1, 30)
    for err in pools(2).run(raises_on_rank, sp_generate_case, path, None, ids_by_rank=[a, b], **GREEDY):
        assert err is not None and err[0] == "ValueError" and "different prompts" in err[1]


def test_sampling_needs_one_seed(pools):
    path = saved_model_dir("llama")
    ids, _ = prompts(17, 1, 30)
    for err in pools(2).run(raises_on_rank, unseeded_sampling_case, path, ids):
        assert err is not None and err[0] == "ValueError" and "set_seed" in err[1]


@pytest.mark.parametrize("cache_from,match", [
    ((0, 3, "zigzag"), "rank 0 of 3"),
    ((1, 2, "contiguous"), "layout 'contiguous'"),
])
def test_cache_from_another_layout(pools, cache_from, match):
    path = saved_model_dir("llama")
    ids, _ = prompts(18, 1, 30)
    for err in pools(2).run(raises_on_rank, sp_generate_case, path, ids, cache_from=cache_from, **GREEDY):
        assert err is not None and err[0] == "ValueError" and match in err[1]


def test_sdpa_model_under_sequence_parallelism(pools):
    path = saved_model_dir("llama")
    ids, _ = prompts(19, 1, 30)
    for err in pools(2).run(raises_on_rank, sdpa_sharded_case, path, ids, **GREEDY):
        assert err is not None and "attn_implementation='ring_dilated'" in err[1]


def test_transformers_cache_under_sequence_parallelism_is_refused(pools):
    for err in pools(2).run(raises_on_rank, sp_cache_forward_case, saved_model_dir("llama")):
        assert err is not None and err[0] == "NotImplementedError" and "hf_ring.generate" in err[1]


def test_prompt_beyond_max_positions():
    path = saved_model_dir("llama", max_position_embeddings=64)
    model = load(path, "ring_dilated")
    ids, _ = prompts(20, 1, 60)
    with pytest.raises(ValueError, match="max_position_embeddings=64.*allow_beyond_max_positions=True"):
        hf_ring.generate(model, ids, **GREEDY)
    out = hf_ring.generate(model, ids, allow_beyond_max_positions=True, **GREEDY)
    assert out.shape == (1, 60 + NEW)
    hf_ring.generate(model, ids[:, :40], **GREEDY)  # 40 + 20 fits


def test_dynamic_rope_may_run_past_max_positions():
    path = saved_model_dir("llama", max_position_embeddings=64,
                           rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    ids, _ = prompts(21, 1, 60)
    assert hf_ring.generate(load(path, "ring_dilated"), ids, **GREEDY).shape == (1, 80)


@pytest.mark.parametrize("kw,exc,match", [
    ({"use_cache": False}, ValueError, "use_cache=False"),
    ({"num_beams": 2}, ValueError, "beam search"),
    ({"past_key_values": "cache"}, TypeError, "ShardedCache"),
])
def test_bad_generate_arguments(kw, exc, match):
    model = load(saved_model_dir("llama"), "ring_dilated")
    ids, _ = prompts(22, 1, 10)
    with pytest.raises(exc, match=match):
        hf_ring.generate(model, ids, **dict(GREEDY, **kw))


@pytest.mark.parametrize("ids,mask,exc,match", [
    (torch.zeros(4, dtype=torch.long), None, TypeError, "input_ids must be an integer tensor"),
    (torch.zeros(1, 4), None, TypeError, "input_ids must be an integer tensor"),
    (torch.zeros(1, 0, dtype=torch.long), None, ValueError, "input_ids is empty"),
    (torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 3), ValueError, "attention_mask must have the shape"),
])
def test_bad_input_ids(ids, mask, exc, match):
    model = load(saved_model_dir("llama"), "ring_dilated")
    with pytest.raises(exc, match=match):
        hf_ring.generate(model, ids, attention_mask=mask, **GREEDY)


@pytest.mark.parametrize("bad,exc,match", [
    ({"num_beams": 2}, "ValueError", "beam search"),
    ({"use_cache": False}, "ValueError", "use_cache=False"),
    ({"inputs_embeds": torch.zeros(1, 2, 64)}, "ValueError", "inputs_embeds"),
])
def test_bad_argument_on_one_rank_raises_the_same_error_on_every_rank(pools, bad, exc, match):
    from generation_cases import one_rank_bad_argument_case

    ids, _ = prompts(9, 1, 12)
    results = pools(2).run(one_rank_bad_argument_case, saved_model_dir("llama"), ids, bad)
    assert results[0] == results[1], results
    assert results[0][0] == exc and match in results[0][1] and results[0][1].startswith("rank 1:")


@pytest.mark.parametrize("new", [2, NEW])
def test_ranks_that_pick_different_tokens_raise_on_every_rank_unless_logits_are_broadcast(pools, new):
    path = saved_model_dir("llama")
    ids, _ = prompts(11, 1, 40)
    kw = dict(GREEDY, max_new_tokens=new)
    # new=2: the second token is the first each rank picks itself, and the last: only the final check sees it.
    for res in pools(2).run(sp_diverging_generate_case, path, ids, **kw):
        assert res[0] == "RanksDivergedError" and "broadcast_logits=True" in res[1], res
    ref = sdpa_generate(path, ids, None, **kw)
    for res in pools(2).run(sp_diverging_generate_case, path, ids, broadcast_logits=True, **kw):
        assert torch.equal(res, ref)
