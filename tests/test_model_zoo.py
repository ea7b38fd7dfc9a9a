"""Every tested decoder family under ring_dilated equals transformers' eager attention.

Each family is built from a tiny config with what makes it differ from Llama
switched on: sliding windows smaller than the sequence, a RoPE whose
frequencies depend on the length (models.length_dependent_rope), attention sharpened so that Gemma 2's soft-capping and
gpt-oss's sinks change the result. Errors are relative per tensor:
max|got - ref| / max|ref|.
"""
import functools
import warnings

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_ring import patches
from helpers import close, scalar_rel_err
from helpers import rel_err as rel
from models import FAMILY_CONFIG, batch, length_dependent_rope, load, saved_model_dir
from zoo_cases import zero_if_none, zoo_generate_case, zoo_short_case, zoo_train_case

pytestmark = pytest.mark.compat  # the subset run on every supported transformers release

TOL = 1e-5
# The floor: both runs compute in float32 (the ring merges blocks by log-sum-exp where eager takes one softmax, so
# they round differently). Measured over the whole suite on three roundings (AVX-512 with one thread, scalar kernels
# ATEN_CPU_CAPABILITY=default, AVX2 with two threads), the worst tensor of these tests is 6.7e-6 (gemma3_text's
# two-rank step): a margin of 1.5x. The float64 cases (hybrids, post-training) sit far below it.
B, N, SEED = 2, 40, 3
PROMPT, NEW = 37, 8
GREEDY = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)

WINDOW = 8  # smaller than the sequence, so sliding layers differ from full ones
SOFTCAP = 4.0  # Gemma 2's attention scores reach several times this (see sharpen)
PROJ_GAIN, NORM_GAIN = 12.0, 2.5
SINK_SCALE = 4.0

QWEN_WINDOW = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)  # layer 0 full, 1 sliding
ZOO = {kind: dict(length_dependent_rope(kind), **extra) for kind, extra in {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": QWEN_WINDOW,
    "qwen3": QWEN_WINDOW,
    "qwen3_moe": dict(sliding_window=WINDOW),
    "gemma2": dict(sliding_window=WINDOW, attn_logit_softcapping=SOFTCAP),
    "gemma3_text": dict(sliding_window=WINDOW),
    "gpt_oss": dict(sliding_window=WINDOW),
    "phi3": dict(sliding_window=WINDOW),
    "olmo2": {},
}.items()}
assert set(ZOO) == set(FAMILY_CONFIG) == set(patches.FAMILIES)

def families_marked():
    return list(ZOO)


def sharpen(model):
    """Scale query/key so attention is far from uniform (scores of several units); give gpt-oss real sinks."""
    g = torch.Generator().manual_seed(11)
    for module in model.modules():
        if hasattr(module, "q_norm"):  # normalised queries/keys: only the norm's gain sets the scale
            for norm in (module.q_norm, module.k_norm):
                if type(norm).__name__.startswith("Gemma"):  # Gemma's RMSNorm multiplies by (1 + weight)
                    norm.weight.fill_(NORM_GAIN - 1.0)
                else:
                    norm.weight.mul_(NORM_GAIN)
        elif hasattr(module, "q_proj"):
            module.q_proj.weight.mul_(PROJ_GAIN)
            module.k_proj.weight.mul_(PROJ_GAIN)
        elif hasattr(module, "qkv_proj"):  # Phi-3: fused, queries and keys first
            heads = module.config.num_attention_heads + module.config.num_key_value_heads
            qk = heads * module.head_dim
            module.qkv_proj.weight[:qk].mul_(PROJ_GAIN)
        if hasattr(module, "sinks"):
            module.sinks.copy_(SINK_SCALE * torch.randn(module.sinks.shape, generator=g))


def model_dir(kind):
    return saved_model_dir(kind, edit=sharpen, **ZOO[kind])


@functools.lru_cache(maxsize=None)
def eager_step(kind):
    """Single-process eager reference: loss, logits and gradients of one step."""
    model = load(model_dir(kind), "eager").train()
    out = model(**batch(SEED, B, N), use_cache=False)
    out.loss.backward()
    return out.loss.item(), out.logits.detach(), {k: zero_if_none(p) for k, p in model.named_parameters()}


def logits(kind, attn, edit=None):
    model = load(model_dir(kind), attn)
    with torch.no_grad():
        if edit is not None:
            for module in model.modules():
                edit(module)
        return model(**batch(SEED, B, N), use_cache=False).logits


def no_softcap(module):
    if hasattr(module, "attn_logit_softcapping"):
        module.attn_logit_softcapping = None


def no_sinks(module):
    if hasattr(module, "sinks"):
        module.sinks.fill_(-1e4)  # exp(-1e4 - max) == 0: the sink takes no weight


@pytest.mark.parametrize("kind", list(ZOO))
def test_structure_and_attention_kwargs_match_the_family_table(kind):
    seen = {}

    def spy(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        seen.setdefault(module.layer_idx, set()).update(kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)

    AttentionInterface.register("zoo_spy", spy)
    model = load(model_dir(kind), "zoo_spy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tested family passes without the untested-family warning
        assert patches.check_supported(model) == kind
        assert patches.check_supported(model.config) == kind
    with torch.no_grad():
        model(**batch(SEED, 1, 12), use_cache=False)
    passed_through = {"position_ids", "use_cache", "output_router_logits"}  # model kwargs, not the layer's own
    assert len(seen) == 2 and all(k - passed_through == set(patches.FAMILIES[kind].attention_kwargs)
                                  for k in seen.values()), seen
    rotary = patches.rotary_modules(model)
    assert len(rotary) == 1 and type(rotary[0]).__name__ in patches.FAMILIES[kind].rotary
    # the configured RoPE reads the call's length (Gemma 3: on its full layers, one module for both types)
    types = patches.rope.rope_types(rotary[0])
    assert any(patches.rope.is_length_dependent(t) for t in types)
    assert kind != "gemma3_text" or sorted(types) == ["default", "dynamic"]


@pytest.mark.parametrize("kind", families_marked())
def test_single_process_logits_equal_eager(kind):
    ref = logits(kind, "eager")
    err = rel(logits(kind, "ring_dilated"), ref)
    print(f"{kind}: single process logits rel {err:.2e}")
    assert close(err, TOL), err


def test_softcap_and_sinks_change_the_eager_result():
    """Without this the Gemma 2 and gpt-oss comparisons could not fail."""
    for kind, edit in (("gemma2", no_softcap), ("gpt_oss", no_sinks)):
        ref = logits(kind, "eager")
        assert rel(logits(kind, "eager", edit), ref) > 1e-2, kind


@pytest.mark.parametrize("ulysses", [1, 2], ids=["ring", "ulysses"])
@pytest.mark.parametrize("kind", families_marked())
def test_two_ranks_step_equals_single_process_eager(pools, kind, ulysses):
    loss, ref_logits, ref_grads = eager_step(kind)
    results = pools(2).run(zoo_train_case, model_dir(kind), B, N, SEED, ulysses)
    errs = {"loss": max(scalar_rel_err(r["loss"], loss) for r in results),
            "logits": max(rel(r["logits"], ref_logits) for r in results),
            "grads": max(rel(results[0]["grads"][k], g) for k, g in ref_grads.items())}
    # the same run without the rotary patch differs: the RoPE here really depends on the length
    unpatched = max(rel(r["unpatched_logits"], ref_logits) for r in results)
    print(f"{kind}: 2 ranks {errs}, without the RoPE patch {unpatched:.2e}")
    assert unpatched > 1e-3, unpatched
    assert close(max(errs.values()), TOL), errs


@pytest.mark.parametrize("ulysses", [1, 2], ids=["ring", "hybrid2x2"])
@pytest.mark.parametrize("kind", families_marked())
def test_a_rank_without_rows_trains_every_family(pools, kind, ulysses):
    """3 tokens on 4 ranks: one rank holds none and runs a placeholder row; loss and gradients are one process's.

    The family's own weights, not the sharpened ones: at 3 tokens the sharpened scores make fp32 itself
    inexact (Gemma 3's eager and sdpa each differ from float64 by 1-2e-5 there)."""
    path = saved_model_dir(kind, **ZOO[kind])
    model = load(path, "eager").train()
    out = model(**batch(SEED, B, 3), use_cache=False)
    out.loss.backward()
    ref = {k: zero_if_none(p) for k, p in model.named_parameters()}
    results = pools(4).run(zoo_short_case, path, B, 3, SEED, ulysses)
    assert [r["placeholder"] for r in results].count(True) == 1 and all(r["rows"] >= 1 for r in results)
    errs = {"loss": max(scalar_rel_err(r["loss"], out.loss.item()) for r in results),
            **{k: rel(results[0]["grads"][k], g) for k, g in ref.items()}}
    assert close(max(errs.values()), TOL), errs


@pytest.mark.parametrize("kind", families_marked())
def test_two_ranks_generate_equals_single_process(pools, kind):
    ids = torch.randint(3, 97, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    ref = load(model_dir(kind), "eager").generate(ids, **GREEDY)
    assert len(set(ref[0, PROMPT:].tolist())) > 2  # the comparison means something only if the tokens vary
    # hf_ring.generate reads only a top-level rope_type, so Gemma 3's dynamic full layers need the override
    for got in pools(2).run(zoo_generate_case, model_dir(kind), ids, allow_beyond_max_positions=True, **GREEDY):
        assert torch.equal(got, ref), (got[0, PROMPT:].tolist(), ref[0, PROMPT:].tolist())
