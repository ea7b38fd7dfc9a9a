"""transformers.Trainer and TRL's SFTTrainer with hf_ring.prepare_trainer on 2 and 4 gloo ranks equal one process."""
import functools
import os

import pytest
import torch

import hf_ring
from trainer_cases import example, example_case, sft_case, trainer_case
from dist_pool import RankError
from hf_ring.integration.seams import TRAINER_KEEPS_LOADED_SHARDING_SINCE, since
from helpers import close, scalar_rel_err
from helpers import rel_err as rel
from helpers import worst_rel_err as worst
from models import saved_model_dir

pytestmark = pytest.mark.compat  # the subset run on every supported transformers release

TOL = 1e-5
# The Trainer's own runs are float32, at the float32 floor (worst 1.5e-6 over three roundings: AVX-512, scalar
# kernels, AVX2 with two threads); the SFT runs are float64, where only transformers' loss, which upcasts logits with
# .float(), rounds in float32 (1.7e-7): at lr 0.5 a float32 first step moved the second step's gradients by up to
# 7.9e-6 (0.8 of TOL) on one of those roundings.


def check_losses(got, ref):
    assert len(got) == len(ref) > 0
    for g, r in zip(got, ref):
        assert close(scalar_rel_err(g, r), TOL), (got, ref)


def check_steps(res, ref):
    """Logged losses and every optimizer step's gradients equal the reference."""
    check_losses(res["losses"], ref["losses"])
    assert len(res["grads"]) == len(ref["grads"]) > 0
    for got, want in zip(res["grads"], ref["grads"]):
        assert close(worst(got, want), TOL)


@functools.lru_cache(maxsize=None)
def reference(kind="llama", **kw):
    """A single-process Trainer run (sdpa) on the same rows."""
    return trainer_case(saved_model_dir(kind), **kw)


def test_sp2_trainer_equals_one_process_and_resumes(pools, tmp_path):
    path = saved_model_dir("llama")
    results = pools(2).run(trainer_case, path, 2, resume_at=1, out_dir=str(tmp_path / "sp"))
    ref = reference(resume_at=1, out_dir=str(tmp_path / "ref"))
    for res in results:  # every rank logs the global loss
        check_losses(res["losses"], ref["losses"])
    res = results[0]
    assert res["wrapped"] == "DistributedDataParallel"
    check_steps(res, ref)
    assert close(scalar_rel_err(res["eval_loss"], ref["eval_loss"]), TOL)
    assert res["logits"].shape == ref["logits"].shape == (3, 23, 97)  # global order, no row repeated
    assert close(rel(res["logits"], ref["logits"]), TOL)
    assert torch.equal(res["label_ids"], ref["label_ids"])
    assert close(rel(res["logits_unlabelled"], ref["logits"]), TOL)  # a batch without labels is sharded too
    assert close(worst(res["params"], ref["params"]), TOL)
    # resumed from the checkpoint of step 1, trained to step 2: the uninterrupted run's parameters
    assert close(worst(res["resumed"], ref["params"]), TOL)


def test_dp2_sp2_trainer_equals_one_process(pools):
    path = saved_model_dir("llama")
    results = pools(4).run(trainer_case, path, 2, eval_rows=4, eval_pad="none")
    # one process sees both replicas' rows per micro-batch; the eval rows make equal batches, as one process's do
    ref = reference(per_device=2, eval_rows=4, eval_pad="none")
    for res in results:
        check_losses(res["losses"], ref["losses"])
    res = results[0]
    assert res["wrapped"] == "DistributedDataParallel"
    check_steps(res, ref)
    assert close(scalar_rel_err(res["eval_loss"], ref["eval_loss"]), TOL)
    assert res["logits"].shape == ref["logits"].shape == (3, 23, 97)  # the row repeated for an even split dropped
    assert close(rel(res["logits"], ref["logits"]), TOL)
    assert torch.equal(res["label_ids"], ref["label_ids"])
    assert close(worst(res["params"], ref["params"]), TOL)


@pytest.mark.parametrize("world,sp_size,ulysses", [(2, 2, 2), (4, 4, 2), (4, 4, 4), (4, 2, 2)],
                         ids=["ulysses2", "hybrid2x2", "ulysses4", "dp2-ulysses2"])
def test_head_parallel_trainer_equals_one_process(pools, world, sp_size, ulysses):
    """Every mode trains like one process: logged losses, every step's gradients, eval loss and predictions."""
    path = saved_model_dir("llama", num_attention_heads=4, num_key_value_heads=2)
    dp = world // sp_size
    results = pools(world).run(trainer_case, path, sp_size, ulysses_size=ulysses, eval_rows=2 * dp, eval_pad="none")
    ref = reference(per_device=dp, eval_rows=2 * dp, eval_pad="none")
    for res in results:
        check_losses(res["losses"], ref["losses"])
    res = results[0]
    assert res["ulysses_size"] == ulysses
    check_steps(res, ref)
    assert close(scalar_rel_err(res["eval_loss"], ref["eval_loss"]), TOL)
    assert close(rel(res["logits"], ref["logits"]), TOL)
    assert close(worst(res["params"], ref["params"]), TOL)


# peft's get_peft_model reads transformers' deprecated is_gradient_checkpointing (peft_model.py), not hf_ring
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_with_gradient_checkpointing_sp2(pools):
    pytest.importorskip("peft")
    path = saved_model_dir("mistral")
    kw = dict(lora=True, checkpointing=True, predict_rows=0)
    res = pools(2).run(trainer_case, path, 2, **kw)[0]
    ref = reference("mistral", **kw)
    assert res["checkpointing"] and ref["checkpointing"]
    assert all("lora_" in name for name in res["grads"][0]) and len(res["grads"][0]) == 8  # 2 layers x q, v x A, B
    check_steps(res, ref)
    assert close(scalar_rel_err(res["eval_loss"], ref["eval_loss"]), TOL)


def test_fsdp2_dp2_sp2(pools):
    """FSDP2 over all four ranks (transformers shards the model at load time; gloo runs it on CPU)."""
    path = saved_model_dir("llama")
    kw = dict(eval_rows=4, eval_pad="none")
    if not since(TRAINER_KEEPS_LOADED_SHARDING_SINCE):
        # This release's Trainer would wrap the shards in DDP: refused on every rank, naming the release.
        with pytest.raises(RankError, match=r"(?s)NotImplementedError.*trains under transformers' Trainer from "
                                            r"transformers 5.19 on.*rank 1: NotImplementedError"):
            pools(4).run(trainer_case, path, 2, fsdp=True, **kw)
        return
    res = pools(4).run(trainer_case, path, 2, fsdp=True, **kw)[0]
    ref = reference(per_device=2, **kw)
    assert res["dtensor"] and res["wrapped"] != "DistributedDataParallel"
    check_steps(res, ref)
    assert close(scalar_rel_err(res["eval_loss"], ref["eval_loss"]), TOL)
    assert close(rel(res["logits"], ref["logits"]), TOL)
    assert close(worst(res["params"], ref["params"]), TOL)


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    pytest.importorskip("trl")
    sft = example("sft")
    return sft.default_model(str(tmp_path_factory.mktemp("sft")), len(sft.char_tokenizer()), 0)


def test_sft_trainer_sp2(pools, sft_model):
    res = pools(2).run(sft_case, sft_model, 2, dtype=torch.float64)[0]
    ref = sft_case(sft_model, dtype=torch.float64)
    check_steps(res, ref)
    for key in ("eval_loss", "accuracy", "num_tokens"):  # TRL's metrics too: one count per sp group
        assert close(scalar_rel_err(res[key], ref[key]), TOL), key


@pytest.mark.parametrize("layout", [None, "balanced"])
def test_sft_trainer_packed_rows_sp2(pools, sft_model, layout):
    """padding_free=True: each micro-batch one packed row; ``balanced`` splits each by its documents."""
    res = pools(2).run(sft_case, sft_model, 2, padding_free=True, dtype=torch.float64, layout=layout)[0]
    assert "refused" not in res, res
    ref = sft_case(sft_model, padding_free=True, dtype=torch.float64)
    check_steps(res, ref)


@pytest.mark.parametrize("trl", [True, False])
def test_sft_example_sp2_equals_one_process(pools, sft_model, tmp_path, trl):
    argv = ["--steps", "2", "--batch-size", "2", "--train-rows", "16", "--eval-rows", "4", "--model", sft_model]
    argv += [] if trl else ["--no-trl"]
    got = pools(2).run(example_case, "sft", argv + ["--sp-size", "2", "--output", str(tmp_path / "sp")])
    ref = example_case("sft", argv + ["--output", str(tmp_path / "one")])
    assert all(g["world"] == 2 and g["sp_size"] == 2 for g in got) and ref["world"] == 1
    for g in got:
        for key in ("train_loss", "eval_loss"):
            assert close(scalar_rel_err(g[key], ref[key]), TOL), key
        assert g["held_out_token_accuracy"] == ref["held_out_token_accuracy"]
    assert os.path.isfile(tmp_path / "sp" / "model.safetensors") and os.path.isfile(tmp_path / "sp" / "summary.json")


def test_prepare_trainer_in_one_process_switches_attention_only(tmp_path):
    from transformers import Trainer, TrainingArguments

    from models import load

    model = load(saved_model_dir("llama"), "sdpa")
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    assert hf_ring.prepare_trainer(trainer) is trainer
    assert model.config._attn_implementation == "ring_dilated"
    assert hf_ring.entry.parallel.current() is None and trainer.get_cp_size() == 1
    with pytest.raises(TypeError, match="transformers.Trainer"):
        hf_ring.prepare_trainer(object())
