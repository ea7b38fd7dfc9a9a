"""ring_dilated with every cache transformers ships, in one process: SDPA's tokens and logits, or a clear refusal."""
import pytest
import torch

import hf_ring
from helpers import rel_err
from models import batch, load, saved_model_dir

pytestmark = pytest.mark.compat  # the subset run on every supported transformers release

# Offloaded caches need CUDA and the quantized cache a quantization backend: transformers itself refuses them here.
ON_CPU = ["dynamic", "static", "sliding_window", "hybrid", "hybrid_chunked"]
NEEDS_CUDA = ["offloaded", "offloaded_static", "offloaded_hybrid", "offloaded_hybrid_chunked"]


def _generate(model, ids, mask, impl, max_new_tokens=8):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         cache_implementation=impl, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("impl", ON_CPU)
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_cache_gives_sdpa_tokens_and_logits(kind, impl):
    path = saved_model_dir("llama") if kind == "llama" else saved_model_dir("mistral", sliding_window=5)
    ids = batch(3, 2, 12)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: the cache's positions and the padding both matter
    want_seq, want_logits = _generate(load(path, "sdpa"), ids, mask, impl)
    got_seq, got_logits = _generate(load(path, "ring_dilated"), ids, mask, impl)
    assert torch.equal(got_seq, want_seq)
    assert rel_err(got_logits, want_logits) <= 1e-5


@pytest.mark.parametrize("impl", NEEDS_CUDA + ["quantized"])
def test_caches_transformers_refuses_here_are_refused_alike(impl):
    """Where transformers cannot build a cache on this machine, ring_dilated fails the same way as sdpa."""
    path = saved_model_dir("llama")
    ids = batch(3, 1, 6)["input_ids"]
    errors = []
    for attn in ("sdpa", "ring_dilated"):
        with pytest.raises(Exception) as info:
            _generate(load(path, attn), ids, torch.ones_like(ids), impl, 2)
        errors.append(type(info.value))
    if not torch.cuda.is_available():
        assert errors[0] is errors[1]


def test_dilated_pattern_over_a_static_cache_is_refused():
    path = saved_model_dir("llama")
    model = load(path, "ring_dilated")
    hf_ring.configure(model, pattern={"segment_lengths": [4, 8], "dilation_rates": [1, 2]})
    ids = batch(3, 1, 6)["input_ids"]
    with pytest.raises(ValueError, match="pre-allocated"):
        _generate(model, ids, torch.ones_like(ids), "static", 2)


MLA_TYPES = ["deepseek_v3", "minicpm3", "kimi_linear"]
"""Multi-head latent attention at its released ratio of value to key width (16 against 24 when tiny), and Kimi
Linear's MLA layers beside its delta-rule layers."""


@pytest.mark.parametrize("impl", ["dynamic", "static"])
@pytest.mark.parametrize("model_type", MLA_TYPES)
def test_multi_head_latent_attention_over_a_cache_gives_sdpa_tokens_and_logits(model_type, impl):
    """Values narrower than the keys over transformers' dynamic and static caches: the fused CPU kernel needs one
    head size, so a block runs widened (it raised before); sdpa's tokens and logits."""
    import sweep

    ids = batch(3, 2, 12, vocab=sweep.VOCAB)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    runs = []
    for attn in ("sdpa", "ring_dilated"):
        model, why = sweep.build(model_type, attn, torch.float32, "hybrid")
        assert model is not None, why
        text = model.config.get_text_config(decoder=True)
        assert text.v_head_dim < text.qk_nope_head_dim + text.qk_rope_head_dim, text  # the released relation
        runs.append(_generate(model.eval(), ids, mask, impl))
    assert torch.equal(runs[1][0], runs[0][0])
    assert rel_err(runs[1][1], runs[0][1]) <= 1e-5, rel_err(runs[1][1], runs[0][1])
