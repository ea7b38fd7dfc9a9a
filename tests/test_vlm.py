"""Vision-language models: towers on their own attention, the language model split after the images merge.

Every comparison is against one process's ``eager`` on the whole batch, in float64: the loss and every
parameter's gradient (vision tower and projector included) within 1e-5 relative per tensor; generation's tokens
equal ``model.generate``'s.
"""
from __future__ import annotations

import pytest
import torch

import hf_ring
from hf_ring.entry import backend
from helpers import gradient_errors
from models import saved_model_dir
from vlm import FAMILIES, UNTESTED, packed
from trainer_cases import example_case
from vlm_cases import TOL, generate, mrope_positions, refused, step, trainer, worst

NAMES = list(FAMILIES)


def _exact(pools, name, world=2, **options):
    path = FAMILIES[name].build()
    want = step(name, path, **{k: v for k, v in options.items() if k in ("where", "pad", "n")})
    got = pools(world).run(step, name, path, **options)
    for rank, result in enumerate(got):
        key, err, _ = worst(result, want)
        assert err <= TOL, (rank, key, err)


@pytest.mark.compat  # what the models hand their language model differs between releases
@pytest.mark.parametrize("name", NAMES)
def test_one_process_equals_sdpa(name, monkeypatch):
    """A string attn_implementation reaches every sub-model: the towers run sdpa, the language model the ring."""
    family = FAMILIES[name]
    batch = family.batch(0, 64)
    logits, calls = {}, {"ring": 0, "tower": 0}

    def counted(kind, fn):
        def call(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(backend, "run", counted("ring", backend.run))
    monkeypatch.setattr(backend, "_tower", counted("tower", backend._tower))
    for attn in ("sdpa", "ring_dilated"):
        with torch.no_grad():
            model = family.load(attn, torch.float64).eval()
            logits[attn] = model(**batch).logits
    assert (logits["ring_dilated"] - logits["sdpa"]).abs().max() <= TOL * logits["sdpa"].abs().max()
    assert calls["ring"] == model.config.get_text_config(decoder=True).num_hidden_layers and calls["tower"] > 0


@pytest.mark.compat  # what the models hand their language model differs between releases
@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_equal_one_process_eager(pools, name):
    """Images straddle the shard borders (zigzag over 2 ranks: rows 16 and 48)."""
    _exact(pools, name)


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl", "paligemma"])
def test_one_rank_group_through_shard_batch(pools, name):
    """A group of one: the loss inputs shard_batch hands over whole pass through the language model's call."""
    _exact(pools, name, world=1)


@pytest.mark.parametrize("name", NAMES)
def test_rows_with_padding_and_different_image_counts(pools, name):
    _exact(pools, name, where=FAMILIES[name].two_rows, pad=(0, 6))


PACKS = [n for n in NAMES if n not in ("gemma3", "paligemma")]


@pytest.mark.compat  # what the models hand their language model differs between releases
@pytest.mark.parametrize("name", PACKS)
def test_packed_rows_equal_the_rows_apart(pools, name):
    """Two rows packed into one (position ids restarting; Qwen's four-axis form), each with an image, on 2 ranks:
    the loss and every gradient of the two rows run apart in one process."""
    _exact(pools, name, where=((4,), (4,)), n=40, pack=True)


@pytest.mark.compat  # what the models hand their language model differs between releases
def test_packed_gemma3_rows_equal_the_rows_apart_or_are_refused_on_every_rank(pools):
    """Gemma 3's mask finds its image blocks by row in some transformers releases (computed, exact) and by the
    position ids inside packed documents in others (refused)."""
    family = FAMILIES["gemma3"]
    errors = pools(2).run(refused, family.build(), packed(family.batch(0, 40, where=((4,), (4,)))))
    if errors == ["", ""]:
        _exact(pools, "gemma3", where=((4,), (4,)), n=40, pack=True)
    else:
        assert errors[0] == errors[1] and "bidirectional blocks looked up at positions inside packed" in errors[0]


@pytest.mark.parametrize("name,positions,error", [
    ("paligemma", "2-D", "ring_dilated computes blocks that are contiguous runs of the sequence"),
    ("qwen2_5_vl", "2-D", "packed rows of a model with mRoPE positions take position_ids of shape (4, batch"),
    ("qwen2_5_vl", "3-axis", "position_ids of three axes restart inside a row"),
])
def test_packed_rows_a_model_cannot_tell_apart_are_refused_on_every_rank(pools, name, positions, error):
    family = FAMILIES[name]
    batch = family.batch(0, 40, where=((4,), (4,)) if family.prefix == 0 else ((0,), (0,)))
    if positions == "3-axis":
        model = family.load("eager")
        batch = packed(batch, mrope_positions(model, batch))
        batch["position_ids"] = batch["position_ids"][1:]
    else:
        batch = packed(batch)
    errors = pools(2).run(refused, family.build(), batch)
    assert errors[0] == errors[1] and error in errors[0], errors


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("world,ulysses", [(4, 1), (2, 2), (4, 2)], ids=["ring4", "heads2", "hybrid4"])
def test_four_ranks_head_parallel_and_hybrid(pools, name, world, ulysses):
    _exact(pools, name, world=world, ulysses=ulysses)


@pytest.mark.compat  # what the models hand their language model differs between releases
@pytest.mark.parametrize("name", NAMES)
def test_generate_with_images_gives_model_generate_tokens(pools, name):
    path = FAMILIES[name].build()
    want = generate(name, path)
    got = pools(2).run(generate, name, path)
    assert all(torch.equal(g, want) for g in got), (want[:, -4:], [g[:, -4:] for g in got])


def test_generate_rows_with_different_image_counts(pools):
    path = FAMILIES["qwen2_5_vl"].build()
    want = generate("qwen2_5_vl", path, where=((14, 45), (30,)))
    got = pools(2).run(generate, "qwen2_5_vl", path, where=((14, 45), (30,)))
    assert all(torch.equal(g, want) for g in got)


def test_an_untested_family_is_refused_by_name_on_every_rank(pools):
    errors = pools(2).run(refused, UNTESTED.build(), UNTESTED.batch(0, 64))
    assert errors[0] == errors[1] and "AyaVisionForConditionalGeneration (model type 'aya_vision') is a " \
        "multimodal family whose sequence split is not tested" in errors[0], errors


def test_a_text_model_given_images_is_refused_on_every_rank(pools):
    batch = FAMILIES["llava"].batch(0, 64)
    batch["input_ids"] = batch["input_ids"] % 97
    errors = pools(2).run(refused, saved_model_dir("llama"), batch, text_model=True)
    assert errors[0] == errors[1] and "takes no images" in errors[0], errors


def test_a_language_model_on_another_attention_is_refused_on_every_rank(pools):
    family = FAMILIES["llava"]
    attn = {"text_config": "sdpa", "vision_config": "ring_dilated", "": "ring_dilated"}
    errors = pools(2).run(refused, family.build(), family.batch(0, 64), attn=attn)
    assert errors[0] == errors[1] and "load it with attn_implementation='ring_dilated'" in errors[0], errors


def test_prepare_trainer_refuses_an_untested_family_at_setup(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = UNTESTED.load("sdpa")
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    with pytest.raises(ValueError, match="'aya_vision'.* is a multimodal family whose sequence split is not tested"):
        hf_ring.prepare_trainer(trainer)


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl", "gemma3"])
def test_trainer_steps_equal_one_process(pools, name):
    """gemma3: a model whose Trainer passes no token count (accepts_loss_kwargs=False)."""
    path = FAMILIES[name].build()
    want = trainer(name, path)
    got = pools(2).run(trainer, name, path, sp_size=2)[0]
    assert got["losses"] == pytest.approx(want["losses"], rel=TOL)
    for step_got, step_want in zip(got["grads"], want["grads"], strict=True):
        errs = gradient_errors(step_got, step_want)
        assert max(errs.values()) <= TOL, max(errs, key=errs.get)


def test_vision_sft_example_on_two_ranks_equals_one_process(pools, tmp_path):
    """TRL's SFTTrainer with its vision collator and Llava's processor: every step's loss and the held-out loss."""
    argv = ["--steps", "3", "--frames", "6", "--batch-size", "2", "--eval-rows", "4", "--gradient-checkpointing"]
    got = pools(2).run(example_case, "vision_sft", argv + ["--sp-size", "2", "--output", str(tmp_path / "sp")])
    want = example_case("vision_sft", argv + ["--output", str(tmp_path / "one")])
    assert want["world"] == 1 and all(g["world"] == 2 and g["sp_size"] == 2 for g in got)
    for g in got:
        assert g["losses"] == pytest.approx(want["losses"], rel=TOL) and len(want["losses"]) == 3
        assert g["eval_loss"] == pytest.approx(want["eval_loss"], rel=TOL)
