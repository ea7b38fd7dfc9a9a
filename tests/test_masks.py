"""Reading a model's mask function (hf_ring.integration.masks), and the models whose masks say more than causality.

The reader is checked on mask functions composed by transformers' own
factories; the models (Llama 4's chunks, NoPE layers and temperature tuning,
PhiMoE's window known only to its mask, Gemma 3's bidirectional image blocks
inside a sliding-window model, PaliGemma's prefix) against ``eager`` in one
process and, where the sequence can be split, on 2 ranks.
"""
import pytest
import torch
from transformers import masking_utils as mu

from hf_ring.integration import masks
from hf_ring.integration.masks import MaskUseError, RingMask, read
from helpers import rel_err
from mask_cases import (TOL, gemma3_image_logits, llama4_config, paligemma_logits, phimoe_config, step_case,
                        text_logits)

pytestmark = pytest.mark.compat  # masks are composed by each release's masking_utils

N = 24
IDS = torch.tensor([[-1, -1, 0, 0, 0, -1, -1, 1, 1, 1, 1, -1] + [-1] * 12])  # two blocks of 3 and 4 rows


def test_causal_windows_and_chunks():
    assert read(mu.causal_mask_function, 1, N) == masks.MaskRead(causal=True)
    assert read(mu.sliding_window_causal_mask_function(5), 1, N).window == 5
    chunked = read(mu.chunked_causal_mask_function(8, torch.tensor([3])), 1, N)
    assert (chunked.causal, chunked.window, chunked.chunk, chunked.chunk_start.tolist()) == (True, None, 8, [3])
    assert read(mu.bidirectional_mask_function, 1, N).causal is False


def test_blocks_over_causality_and_a_window():
    plain = read(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(IDS)), 1, N)
    assert plain.refusal is None and torch.equal(plain.blocks, IDS)
    # Gemma 3's sliding layers: the window bounds a block's pairs too; blocks within the window read alike.
    gemma = mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(IDS)), mu.sliding_window_overlay(4))
    assert read(gemma, 1, N).refusal is None
    narrow = mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(IDS)), mu.sliding_window_overlay(3))
    assert "longer than the sliding window (3)" in read(narrow, 1, N).refusal
    # PaliGemma's on a sliding layer: blocks override the window.
    wide = mu.or_masks(mu.sliding_window_causal_mask_function(2), mu.blockwise_overlay(IDS))
    assert read(wide, 1, N).refusal is None


def test_blocks_that_are_not_one_run_are_refused():
    split = torch.tensor([[0, 0, -1, 0] + [-1] * (N - 4)])
    assert "not one run" in read(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(split)), 1, N).refusal


def test_packed_documents():
    docs = torch.tensor([[0] * 10 + [1] * 14])
    found = read(mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(docs)), 1, N)
    assert torch.equal(found.documents, docs)


def test_unknown_pieces_are_kept_only_where_they_change_nothing():
    always = read(mu.or_masks(mu.causal_mask_function, lambda *args: torch.tensor(True)), 1, N)
    assert always.causal is False  # Gemma 3's use_bidirectional_attention: every pair

    def own_causal(b, h, q, k):
        return k <= q

    assert read(mu.and_masks(mu.sliding_window_overlay(4), own_causal), 1, N).window == 4

    def mirror(b, h, q, k):  # Gemma 3's bidirectional window
        return (q - k).abs() < 4

    found = read(mu.or_masks(mu.sliding_window_causal_mask_function(4), mirror), 1, N)
    assert "does not compute" in found.refusal and "mirror" in found.refusal


def test_unknown_pieces_of_a_long_call_are_refused(monkeypatch):
    monkeypatch.setattr(masks, "PROBE_PAIRS", 100)

    def own_causal(b, h, q, k):
        return k <= q

    assert read(mu.and_masks(mu.sliding_window_overlay(4), own_causal), 1, N).refusal is not None


def test_a_sharded_call_reads_settings_only():
    found = read(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(IDS)), 1, N, sharded=True)
    assert "one rank's rows of a split sequence" in found.refusal
    none = torch.full((1, N), -1)
    assert read(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(none)), 1, N, sharded=True).refusal is None


def test_a_factory_that_changed_its_meaning_is_not_read(monkeypatch):
    """A release whose window overlay meant something else would have its windows refused, not misread."""
    def other_window(sliding_window):
        def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
            return kv_idx >= q_idx - sliding_window  # one key more than hf_ring reads a window as
        return inner_mask

    monkeypatch.setattr(mu, "sliding_window_overlay", other_window)
    masks.known_codes.cache_clear()
    try:
        fn = mu.and_masks(mu.sliding_window_overlay(4), mu.causal_mask_function)
        assert read(fn, 1, N).refusal is not None
    finally:
        masks.known_codes.cache_clear()


def test_a_ring_mask_used_as_a_tensor_says_why():
    mask = RingMask(None, mu.causal_mask_function, (1, N))
    assert not hasattr(mask, "dtype")
    with pytest.raises(MaskUseError, match="uses its attention mask as a tensor"):
        torch.zeros(1, 1, N, N) + mask
    assert mask.ndim == 4 and mask.shape == (1, 1, N, N)  # to transformers, a prepared mask: kept as it is
    assert mask.contiguous() is mask  # a layout request (generate's static-cache masks) reads nothing of it
    with pytest.raises(MaskUseError, match="uses its attention mask as a tensor"):
        mask.contiguous().masked_fill(None, 0)


@pytest.mark.parametrize("pad", [0, 5])
@pytest.mark.parametrize("kind", ["llama4", "phimoe"])
def test_one_process_equals_eager(kind, pad):
    config = llama4_config() if kind == "llama4" else phimoe_config()
    got, want, without = text_logits(config, pad)
    assert rel_err(got, want) <= TOL
    assert rel_err(without, want) > 1e-2  # the mask's own pattern matters here


@pytest.mark.parametrize("ulysses", [1, 2], ids=["ring", "ulysses"])
@pytest.mark.parametrize("kind", ["llama4", "phimoe"])
def test_two_ranks_equal_one_process_eager(pools, kind, ulysses):
    config = llama4_config() if kind == "llama4" else phimoe_config()
    want = step_case(config, pad=5)
    got = pools(2).run(step_case, config, pad=5, ulysses=ulysses)
    errs = {"loss": rel_err(got[0]["loss"], want["loss"])}
    errs.update({name: rel_err(got[0]["grads"][name], g) for name, g in want["grads"].items()})
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])


def test_gemma3_with_an_image_equals_eager():
    got, want, without = gemma3_image_logits()
    assert rel_err(got, want) <= TOL
    assert rel_err(without, want) > 1e-2  # the image's tokens attend each other both ways


def test_paligemma_prefix_equals_eager():
    got, want, without = paligemma_logits()
    assert rel_err(got, want) <= TOL
    assert rel_err(without, want) > 1e-2  # the prefix attends both ways


def test_chunked_attention_in_sharded_generation_is_refused(pools):
    results = pools(2).run(step_case, llama4_config(), generate=True)
    assert all("chunked attention" in r["refused"] for r in results)
