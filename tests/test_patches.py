"""Model-family patches: registry, reversibility, and unchanged unsharded behaviour."""
import pytest
import torch
import torch.distributed as dist

import hf_ring
from hf_ring import patches
from models import batch, load, saved_model_dir


def test_registry_lists_supported_types():
    assert patches.supported() == ("llama", "mistral")
    with pytest.raises(ValueError, match="supported: llama, mistral"):
        patches.apply("gpt2")


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_apply_and_revert_are_exact_and_leave_unsharded_runs_alone(kind):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    path = saved_model_dir(kind, max_position_embeddings=16, rope_parameters=rope)
    model = load(path, "ring_dilated")
    rotary_cls = type(model.model.rotary_emb)
    original = rotary_cls.forward
    data = batch(0, 1, 40)
    with torch.no_grad():
        before = model(**data).logits
        patches.apply(model)
        assert patches.is_applied(model) and rotary_cls.forward is not original
        patched = model(**data).logits
        patches.revert(model)
    assert rotary_cls.forward is original and not patches.is_applied(kind)
    assert torch.equal(before, patched)


def _unsupported_model_sharded():
    from transformers import GPT2Config, GPT2LMHeadModel

    from cases import raises_on_rank

    hf_ring.setup_sequence_parallel(None, 2)
    try:
        cfg = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, n_positions=64)
        model = GPT2LMHeadModel(cfg).eval()
        model.set_attn_implementation("ring_dilated")
        data = hf_ring.shard_batch({"input_ids": torch.zeros(1, 10, dtype=torch.long)})
        return raises_on_rank(model, **data)
    finally:
        hf_ring.clear_sequence_parallel()


def _bad_sp_size():
    from cases import raises_on_rank

    return raises_on_rank(hf_ring.setup_sequence_parallel, None, 3)


def _layout_mismatch(path):
    from cases import raises_on_rank

    hf_ring.setup_sequence_parallel(None, 2, layout="zigzag")
    try:
        model = load(path, "ring_dilated")
        hf_ring.configure(model, layout="contiguous")
        return raises_on_rank(model, **hf_ring.shard_batch(batch(0, 1, 12)))
    finally:
        hf_ring.clear_sequence_parallel()


def test_sharded_run_of_unsupported_model_is_refused(pools):
    for res in pools(2).run(_unsupported_model_sharded):
        assert res[0] == "ValueError" and "'gpt2'" in res[1] and "llama, mistral" in res[1]


def test_sp_size_must_divide_world(pools):
    for res in pools(2).run(_bad_sp_size):
        assert res[0] == "ValueError" and "does not divide the 2 processes" in res[1]


def test_layout_of_config_and_sequence_parallel_must_agree(pools):
    for res in pools(2).run(_layout_mismatch, saved_model_dir("llama")):
        assert res[0] == "ValueError" and "layout" in res[1]


def test_single_process_setup_without_distributed():
    sp = hf_ring.setup_sequence_parallel(None)
    assert sp.sp_size == 1 and hf_ring.parallel.current() is None
    with pytest.raises(ValueError, match="needs several processes"):
        hf_ring.setup_sequence_parallel(None, 2)
    assert not dist.is_initialized()
