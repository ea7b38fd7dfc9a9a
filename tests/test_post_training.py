"""Post-training under sequence parallelism: TRL's DPO, KTO, reward, GRPO, RLOO and distillation trainers through
prepare_trainer, and a sequence classifier through shard_batch, equal one process on 2 and 4 gloo ranks; the trainers
hf_ring does not take are refused by name."""
import os

import pytest
import torch

import hf_ring
from helpers import close, rel_err, scalar_rel_err
from helpers import worst_rel_err as worst
from models import saved_model_dir
from trainer_cases import (distillation_case, dpo_case, example, example_case, kto_case, reward_case, sampling_case,
                           teacher_model)

# peft and TRL read transformers' deprecated is_gradient_checkpointing (not hf_ring)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
COMPAT = pytest.mark.compat
"""TRL's trainers and fused head and transformers' classifier pooling are what this reads, and they move between
releases: every trainer's 2-rank case, the replicas' cases and the refusals run on every release (the compatibility
subset); the 4-rank variants of a trainer, which read nothing more of them, on the pinned releases only."""

TOL = 1e-5
# The models are float64 and so is hf_ring's attention (its log-sum-exp included: kept in float32 it put the reward
# trainer's eval_min_reward at 1.03e-5 on AVX-512 and 1e-14 once float64). What still rounds in float32 is TRL's: its
# fused LM head (DPO, KTO, GRPO, RLOO) and its distillation divergence compute in float32 whatever the model's dtype.
# Worst over the whole suite on three roundings (AVX-512 with one thread, scalar kernels ATEN_CPU_CAPABILITY=default,
# AVX2 with two threads): DPO 6.2e-6 (4 ranks, LoRA; the same on all three), KTO 3.5e-6 (scalar kernels; 3.3e-7 on
# the others), distillation 5.8e-7, GRPO/RLOO 1.4e-7, reward and classifier below 1e-13.
METRICS = ("eval_loss", "eval_kl", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies", "eval_logps/chosen",
           "eval_logps/rejected", "eval_min_reward", "eval_mean_reward", "eval_max_reward", "eval_accuracy",
           "eval_entropy", "eval_num_tokens", "eval_completions/mean_length")
MARGINS = {"eval_rewards/margins": ("eval_rewards/chosen", "eval_rewards/rejected"),
           "eval_margin": ("eval_min_reward", "eval_max_reward")}
"""Differences of two rewards, held to TOL of the rewards' size (their own relative error grows as they cancel)."""


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    pytest.importorskip("trl")
    sft = example("sft")
    return sft.default_model(str(tmp_path_factory.mktemp("post")), len(sft.char_tokenizer()), 0)


@pytest.fixture(scope="module")
def char_teacher(char_model):
    return teacher_model(os.path.dirname(char_model), len(example("sft").char_tokenizer()))


def check_run(got, ref):
    """Every logged loss, every step's gradient of every trainable parameter, the final parameters and the trainer's
    own evaluation metrics within TOL (relative, per tensor) of one process."""
    assert len(got["losses"]) == len(ref["losses"]) == 2
    for g, r in zip(got["losses"], ref["losses"]):
        assert close(scalar_rel_err(g, r), TOL), (got["losses"], ref["losses"])
    assert len(got["grads"]) == len(ref["grads"]) == 2
    for g, r in zip(got["grads"], ref["grads"]):
        assert set(g) == set(r)
        assert close(worst(g, r), TOL)
    assert close(worst(got["params"], ref["params"]), TOL)
    checked = [k for k in METRICS if k in ref["metrics"]]
    assert len(checked) >= 4
    for key in checked:
        assert close(scalar_rel_err(got["metrics"][key], ref["metrics"][key]), TOL), key
    for key, (a, b) in MARGINS.items():
        if key in ref["metrics"]:
            size = max(abs(ref["metrics"][a]), abs(ref["metrics"][b]))
            assert abs(got["metrics"][key] - ref["metrics"][key]) <= TOL * size, key


# TRL's fused LM head computes in float32 whatever the model's dtype: a lower learning rate keeps its rounding in the
# first step from moving the second step's gradients by more than TOL.
@pytest.mark.parametrize("world, reference", [pytest.param(2, "model", marks=COMPAT), (4, "lora")])
def test_dpo_trainer_equals_one_process(pools, char_model, world, reference):
    got = pools(world).run(dpo_case, char_model, world, reference=reference, lr=0.05)[0]
    ref = dpo_case(char_model, reference=reference, lr=0.05)
    check_run(got, ref)
    assert ref["metrics"]["eval_rewards/margins"] != 0  # the two steps moved the policy away from its reference


@pytest.mark.parametrize("world, ulysses_size", [pytest.param(2, 1, marks=COMPAT), (4, 2)])
def test_reward_trainer_equals_one_process(pools, char_model, world, ulysses_size):
    got = pools(world).run(reward_case, char_model, world, ulysses_size=ulysses_size)[0]
    ref = reward_case(char_model)
    check_run(got, ref)


@pytest.mark.parametrize("world", [pytest.param(2, marks=COMPAT), 4])
def test_kto_trainer_equals_one_process(pools, char_model, world):
    got = pools(world).run(kto_case, char_model, world)[0]
    ref = kto_case(char_model)
    check_run(got, ref)


def check_sampling_run(got, ref, losses=True):
    """A sampling trainer's run: every step's gradient of every parameter, the final parameters and the logged
    rewards, reward spread, KL, completion lengths and token counts within TOL of the reference (the same completions
    sampled), and its logged losses when ``losses``."""
    if losses:
        for g, r in zip(got["losses"], ref["losses"]):
            assert close(scalar_rel_err(g, r), TOL), (got["losses"], ref["losses"])
    assert len(got["grads"]) == len(ref["grads"]) == 2
    for g, r in zip(got["grads"], ref["grads"]):
        assert close(worst(g, r), TOL)
    assert close(worst(got["params"], ref["params"]), TOL)
    check_logged(got, ref, 10)


def check_logged(got, ref, least):
    """The training metrics the trainer logged (at least ``least`` over the steps) within TOL of the reference."""
    assert set(got["logged"]) == set(ref["logged"]) and len(ref["logged"]) >= least
    for key, value in ref["logged"].items():
        assert close(scalar_rel_err(got["logged"][key], value), TOL), key


# RLOO's logged loss is zero by construction here (on-policy, its leave-one-out advantages sum to zero in each group,
# and its KL is in the reward): what is left of it is rounding, so only GRPO's losses are compared.
@pytest.mark.parametrize("world, trainer, accum", [pytest.param(2, "GRPO", 1, marks=COMPAT), (4, "GRPO", 2),
                                                   pytest.param(2, "RLOO", 1, marks=COMPAT)])
def test_sampling_trainer_equals_one_process(pools, char_model, world, trainer, accum):
    """Completions sampled through hf_ring.generate, the prompt split; 4 ranks with two generation steps per
    generation batch."""
    per_device = 4 // accum
    got = pools(world).run(sampling_case, char_model, world, trainer=trainer, accum=accum, per_device=per_device)[0]
    ref = sampling_case(char_model, trainer=trainer, accum=accum, per_device=per_device)
    check_sampling_run(got, ref, losses=trainer == "GRPO")


@COMPAT
def test_grpo_dp2_sp2_equals_trl_over_two_processes(pools, char_model):
    """2 data-parallel replicas of 2 ranks each sample, score and train as TRL's own 2 processes do."""
    got = pools(4).run(sampling_case, char_model, 2)[0]
    ref = pools(2).run(sampling_case, char_model, None)[0]
    check_sampling_run(got, ref)


@pytest.mark.parametrize("world, options", [pytest.param(2, {}, marks=COMPAT),
                                            (4, {"lora": True, "accum": 2, "per_device": 1, "ulysses_size": 2})])
def test_distillation_trainer_equals_one_process(pools, char_model, char_teacher, world, options):
    """A narrower teacher; completions sampled through hf_ring.generate; left-padded prompts, right-padded
    completions; 4 ranks: LoRA, two accumulation steps per generation batch, ring x head parallelism."""
    got = pools(world).run(distillation_case, char_model, char_teacher, world, **options)[0]
    ref = distillation_case(char_model, char_teacher, **{k: v for k, v in options.items() if k != "ulysses_size"})
    check_run(got, ref)
    check_logged(got, ref, 6)  # completion lengths, token counts, entropy
    assert len({v for k, v in ref["logged"].items() if k.startswith("completions/mean_length")} | {6.0}) > 1


@COMPAT
def test_distillation_dp2_sp2_equals_trl_over_two_processes(pools, char_model, char_teacher):
    """2 data-parallel replicas of 2 ranks each sample and train as TRL's own 2 processes do."""
    got = pools(4).run(distillation_case, char_model, char_teacher, 2)[0]
    ref = pools(2).run(distillation_case, char_model, char_teacher, None)[0]
    check_run(got, ref)
    check_logged(got, ref, 6)


@COMPAT
def test_rank_view_keeps_the_rows_that_predict_a_trained_token():
    """Prompt of 3 tokens, completion of 4 (the last padding, the third a tool result): global positions 2..5 predict
    completion tokens 0..3; a rank holding rows 0, 2, 5 and 6 sees only 2 (token 0) and 5 (token 3, padding: off)."""
    from hf_ring.training.distillation import predicted_tokens, rank_view

    assert predicted_tokens(torch.tensor([0, 1, 2, 5, 6]), 3, 4).tolist() == [-1, -1, 0, 3, -1]
    inputs = {"prompt_ids": torch.tensor([[7, 8, 9]]), "prompt_mask": torch.ones(1, 3, dtype=torch.long),
              "completion_ids": torch.tensor([[4, 5, 6, 0]]), "completion_mask": torch.tensor([[1, 1, 1, 0]]),
              "tool_mask": torch.tensor([[1, 1, 0, 1]]), "num_items_in_batch": torch.tensor(2)}
    rows = torch.tensor([0, 2, 5, 6])
    view = rank_view(inputs, rows, torch.tensor([[7, 9, 6, 0]]))
    assert view["completion_mask"].tolist() == [[0, 1, 0, 0]] and view["completion_ids"].tolist() == [[7, 9, 6, 0]]
    assert view["prompt_ids"].shape == (1, 0) and "tool_mask" not in view and view["num_items_in_batch"] == 2
    rows = torch.tensor([3, 4])  # tokens 1 and 2: the second a tool result; held with a third, placeholder-like row
    assert rank_view(inputs, rows, torch.zeros(1, 3, dtype=torch.long))["completion_mask"].tolist() == [[1, 0, 0]]


@COMPAT
@pytest.mark.parametrize("setting, match", [
    ("vlm", "vision-language processor"), ("teacher", "without a teacher model"), ("tp", "tensor parallelism"),
    ("iterable", "IterableDataset")])
def test_distillation_settings_not_split_are_refused(setting, match):
    from types import SimpleNamespace

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(())

    from hf_ring.training import distillation

    trainer = SimpleNamespace(_is_vlm=setting == "vlm", teacher_model=None if setting == "teacher" else object(),
                              train_dataset=Stream() if setting == "iterable" else [])
    with pytest.raises(ValueError, match=match):
        distillation.check(trainer, 2 if setting == "tp" else 1)


@COMPAT
@pytest.mark.parametrize("setting", ["use_vllm", "log_completions"])
def test_sampling_settings_not_split_are_refused(setting):
    trl = pytest.importorskip("trl")
    trainer = object.__new__(trl.GRPOTrainer)
    trainer.args = type("Args", (), {"use_vllm": setting == "use_vllm", "log_completions": setting == "log_completions"})()
    with pytest.raises(ValueError, match=f"GRPOTrainer with {setting}=True"):
        hf_ring.prepare_trainer(trainer, sp_size=2)


def classifier_case(path, labels_kind, n=23):
    """One step of a sequence classifier on left- and right-padded rows through shard_batch and sync_gradients (one
    process when no group is set up): its pooled logits, loss and gradients."""
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    split = dist.is_initialized()
    torch.manual_seed(0)  # the new score head's initial values, the same in every process
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1 if labels_kind == "regression" else 3, dtype=torch.float64,
        attn_implementation="ring_dilated" if split else "sdpa")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 30, (3, n), generator=g)
    ids[0, n - n // 4:] = 0  # right padding: its last real token is on another rank than the row's last one
    ids[1, : n // 5] = 0  # left padding
    labels = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64) if labels_kind == "regression" else \
        torch.tensor([2, 0, 1])
    batch = {"input_ids": ids, "attention_mask": ids.ne(0).long(), "labels": labels}
    if split:
        hf_ring.setup_sequence_parallel(None, dist.get_world_size())
        batch = hf_ring.shard_batch(batch)
    try:
        out = model(**batch)
        out.loss.backward()
        hf_ring.sync_gradients(model)
    finally:
        hf_ring.clear_sequence_parallel()
    return {"logits": out.logits.detach(), "loss": out.loss.item(),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}


@COMPAT
@pytest.mark.parametrize("labels_kind, world, n", [("regression", 2, 23), ("classes", 2, 23), ("classes", 4, 3)])
def test_sequence_classifier_through_shard_batch(pools, labels_kind, world, n):
    """Left- and right-padded rows; 3 tokens on 4 ranks leave one rank a placeholder row."""
    path = saved_model_dir("llama", pad_token_id=0)
    ref = classifier_case(path, labels_kind, n)
    for got in pools(world).run(classifier_case, path, labels_kind, n):
        assert rel_err(got["logits"], ref["logits"]) < TOL
        assert close(scalar_rel_err(got["loss"], ref["loss"]), TOL)
        assert close(worst(got["grads"], ref["grads"]), TOL)


def token_classifier_case(path):
    import torch.distributed as dist
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=3, attn_implementation="ring_dilated")
    hf_ring.setup_sequence_parallel(None, dist.get_world_size())
    try:
        ids = torch.randint(3, 30, (2, 15))
        model(**hf_ring.shard_batch({"input_ids": ids}))
    except ValueError as err:
        return str(err)
    finally:
        hf_ring.clear_sequence_parallel()
    return "ran"


@COMPAT
def test_token_classifier_refused_on_every_rank(pools):
    errors = pools(2).run(token_classifier_case, saved_model_dir("llama", pad_token_id=0))
    assert len(set(errors)) == 1 and "LlamaForTokenClassification" in errors[0] and "one process" in errors[0], errors


@COMPAT
@pytest.mark.parametrize("module, name", [("orpo", "ORPOTrainer"), ("server_distillation", "ServerDistillationTrainer")])
def test_trainers_not_taken_are_refused_by_name(monkeypatch, module, name):
    """TRL's trainers outside the checked set, a subclass of a checked one included."""
    pytest.importorskip("trl")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    import importlib

    trainer = object.__new__(getattr(importlib.import_module(f"trl.experimental.{module}"), name))
    with pytest.raises(ValueError, match=f"does not take TRL's {name}") as err:  # before it reads anything of it
        hf_ring.prepare_trainer(trainer, sp_size=2)
    assert ("DPOTrainer, DistillationTrainer, GRPOTrainer, KTOTrainer, RLOOTrainer, RewardTrainer, SFTTrainer"
            in str(err.value))


def test_dpo_example_sp2_equals_one_process(pools, char_model, tmp_path):
    argv = ["--steps", "2", "--batch-size", "2", "--eval-rows", "4", "--length", "60", "--model", char_model]
    got = pools(2).run(example_case, "dpo", argv + ["--sp-size", "2", "--output", str(tmp_path / "sp")])
    ref = example_case("dpo", argv + ["--output", str(tmp_path / "one")])
    assert all(g["world"] == 2 and g["sp_size"] == 2 for g in got) and ref["world"] == 1
    for g in got:  # (its margins, differences of two rewards, are held to the rewards' size in the trainer test)
        for key in ("train_loss", "eval_loss_before", "eval_loss_after"):
            assert close(scalar_rel_err(g[key], ref[key]), TOL), key
        assert g["accuracy_after"] == ref["accuracy_after"]
    assert os.path.isfile(tmp_path / "sp" / "summary.json")
