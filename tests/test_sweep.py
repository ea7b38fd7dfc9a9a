"""Every causal-LM type of the installed transformers, shrunk from its own defaults: exact against ``eager`` in
one process and on 2 ranks, or refused with a message; a type that cannot be built tiny is skipped with why.

The net under :mod:`hf_ring.integration.masks` and the guard on a sharded call: a model whose mask says more
than causality and a window (chunks, blocks, a window known only to its mask), that mixes the sequence other
than through attention (a state-space scan, a convolution, positions counted from its own input ids) or whose
layers never reach the attention backend is computed exactly or refused on every rank, never silently wrong. A
hybrid type is built twice (:mod:`hybrid_models`): with its attention layers and with recurrent layers only.
"""
import warnings

import pytest
import torch
from transformers import AutoConfig

import hybrid_models
import sweep
from helpers import gradient_errors, rel_err

pytestmark = pytest.mark.filterwarnings("ignore")

TOL = 1e-5
ROWS = sweep.causal_lm_rows()
IDS = [t if p is None else f"{t}-{p}" for t, p in ROWS]
FOUND = {}


def row(model_type, pattern):
    if (model_type, pattern) not in FOUND:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            FOUND[model_type, pattern] = sweep.one_process_row(model_type, pattern)
    return FOUND[model_type, pattern]


def skip_unbuildable(found):
    if found["status"] in ("unbuilt", "eager-fails"):
        pytest.skip(f"{found['status']}: {found['why'][:200]}")


@pytest.mark.compat  # the net for a new release: every type of it, in one process
@pytest.mark.parametrize("model_type, pattern", ROWS, ids=IDS)
def test_one_process_is_exact_or_refused(model_type, pattern):
    found = row(model_type, pattern)
    skip_unbuildable(found)
    if found["status"] == "not-routed":
        pytest.skip(found["why"])  # its own code ran: nothing of hf_ring's to compare in one process
    assert found["status"] in ("exact", "refused"), found
    if found["status"] == "refused":
        assert "attn_implementation='sdpa'" in found["why"] or "attn_implementation='eager'" in found["why"], found


def check_two_ranks(model_type, got, want):
    """Both ranks refused with the same one-line message naming the type, or the step equals one process's."""
    if any(r.get("unbuilt") for r in got):
        pytest.skip(f"transformers cannot build it with ring_dilated: {got[0].get('unbuilt')}")
    refusals = [r.get("refused") for r in got]
    if any(refusals):
        assert refusals[0] == refusals[1], refusals  # the same error on every rank
        named = {repr(model_type), repr(got[0]["built"])}  # a multimodal type builds its text model's config
        assert "\n" not in refusals[0] and any(n in refusals[0] for n in named), refusals[0]
        return "refused"
    errs = {"loss": rel_err(got[0]["loss"], want["loss"]), **gradient_errors(got[0]["grads"], want["grads"])}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])
    return "exact"


@pytest.mark.parametrize("model_type, pattern", ROWS, ids=IDS)
def test_two_ranks_are_exact_or_refused_alike(pools, model_type, pattern):
    found = row(model_type, pattern)
    skip_unbuildable(found)
    if found["status"] == "refused":
        pytest.skip("refused in one process")
    # float64 where the model runs in it: rounding stays far below the bound, and a wrong pair does not
    try:
        dtype, want = torch.float64, sweep.eager_step(model_type, pattern=pattern)
    except RuntimeError:  # a kernel without float64 (grouped expert matmuls)
        dtype, want = torch.float32, sweep.eager_step(model_type, dtype=torch.float32, pattern=pattern)
    got = pools(2).run(sweep.sharded_step_case, model_type, dtype=dtype, pattern=pattern)
    check_two_ranks(model_type, got, want)


IMAGE_TEXT = sweep.image_text_types()


@pytest.mark.parametrize("model_type", IMAGE_TEXT)
def test_image_text_models_on_two_ranks_are_exact_or_refused_alike(pools, model_type):
    """Every image-text-to-text type on text rows: its language model split (a tested family) or the whole model
    refused, on every rank alike."""
    found = FOUND.setdefault((model_type, sweep.IMAGE_TEXT), sweep.one_process_row(model_type, head=sweep.IMAGE_TEXT))
    skip_unbuildable(found)
    assert found["status"] in ("exact", "refused", "not-routed"), found
    if found["status"] == "refused":
        pytest.skip("refused in one process")
    try:
        dtype, want = torch.float64, sweep.eager_step(model_type, head=sweep.IMAGE_TEXT)
    except RuntimeError:
        dtype, want = torch.float32, sweep.eager_step(model_type, dtype=torch.float32, head=sweep.IMAGE_TEXT)
    got = pools(2).run(sweep.sharded_step_case, model_type, dtype=dtype, head=sweep.IMAGE_TEXT)
    check_two_ranks(model_type, got, want)


@pytest.mark.parametrize("model_type", hybrid_models.hybrid_types())
def test_a_packed_row_of_every_hybrid_type_is_exact_or_refused(pools, model_type):
    """One row packing four documents (position ids restarting, no mask, no cache) in one process and on 2 ranks:
    the loss and every gradient equal the documents run one by one, or every rank refuses naming the type, never a
    silent mix of the documents."""
    import hybrid_cases
    from test_hybrids import check_family

    try:
        want = hybrid_cases.family_reference(model_type, packed=True)
    except Exception as err:  # noqa: BLE001 -- a type whose reference does not run tiny has nothing to compare
        pytest.skip(f"reference: {type(err).__name__}: {str(err)[:200]}")
    one = hybrid_cases.packed_or_refused(model_type, 1)
    two = pools(2).run(hybrid_cases.packed_or_refused, model_type, 2)
    if "refused" in one:
        assert repr(model_type) in one["refused"] and "packed rows" in one["refused"], one["refused"]
        assert all("refused" in r and repr(model_type) in r["refused"] for r in two), two
        assert two[0]["refused"] == two[1]["refused"]
        return
    check_family(one, want)
    check_family(two[0], want)


MLA = ["deepseek_v3", "minicpm3", "glm4_moe_lite"]
"""Multi-head latent attention at its released widths (values 16 against keys 24, GLM-4-MoE-Lite's 32 against 32)."""


@pytest.mark.parametrize("world, ulysses", [(2, 1), (4, 1), (4, 2)], ids=["2-ranks", "4-ranks", "4-ranks-heads2"])
@pytest.mark.parametrize("model_type", MLA)
def test_multi_head_latent_attention_over_ranks_is_exact(pools, model_type, world, ulysses):
    """Values narrower than the keys on the ring and under head parallelism: the loss and every gradient equal
    one process's eager step (float64), never refused."""
    text = sweep.build(model_type)[0].config.get_text_config(decoder=True)
    assert text.v_head_dim == (16 if model_type != "glm4_moe_lite" else 32), text
    want = sweep.eager_step(model_type)
    got = pools(world).run(sweep.sharded_step_case, model_type, ulysses=ulysses)
    assert check_two_ranks(model_type, got, want) == "exact"


@pytest.mark.compat
def test_every_tiny_config_keeps_the_released_relations():
    """A tiny model is its released config shrunk, not another shape: each row's query to key/value heads, head
    width against the hidden size's share, latent attention's value and rotary widths against its keys', rotary
    part of a head, windows and experts per token are what the type's default config (a released model's) has."""
    checked, kept = 0, set()
    for model_type, pattern in ROWS:
        chosen = hybrid_models.pattern_kwargs(model_type, pattern)
        try:
            released = AutoConfig.for_model(model_type, **(chosen or {}))
            tiny = sweep.tiny_config(model_type, chosen or {})
        except Exception:  # noqa: BLE001 -- an unbuilt row of the sweep, listed there with why
            continue
        want = sweep.relations(released.get_text_config(decoder=True))
        got = sweep.relations(tiny.get_text_config(decoder=True))
        # a setting the default leaves unset (DeepSeek V2's experts per token) is the size fix's
        assert {k: v for k, v in got.items() if k in want} == want, (model_type, pattern, got)
        checked += 1
        kept |= set(want)
    assert checked > 150 and kept == {"heads", "head_width", "latent", "rotary_dim", "partial_rotary_factor",
                                      "sliding_window", "attention_chunk_size", "window_size", "experts_per_token"}, (
        checked, kept)
