"""DeepSpeed ZeRO 1-3 with hf_ring's sequence parallelism on 2 and 4 gloo ranks equals one process without either.

Every DeepSpeed run is compared with an independent run: a plain Trainer (or a plain loop) in one process, sdpa
attention on the whole batch, no DeepSpeed and no hf_ring. Each tensor within TOL relative (||a - b|| / ||b||,
no absolute floor): logged losses, every optimizer step's gradients (gathered whole under ZeRO-3), final parameters.
"""
import os
import subprocess
import sys

import pytest
import torch

from deepspeed_cases import (ds_distillation_case, ds_loop_case, ds_refusal_case, ds_trainer_case, loop_reference,
                             trainer_reference)
import router_cases
from dist_pool import RankPool
from helpers import close, scalar_rel_err
from helpers import norm_rel_err as rel
from helpers import worst_rel_err
from models import saved_model_dir
from trainer_cases import distillation_case, example, teacher_model

TOL = 1e-5


def check_training(results, ref, *, evaluated=False):
    """Every rank's logged losses, rank 0's gradients of every step and final parameters equal the reference."""
    for res in results:
        assert len(res["losses"]) == len(ref["losses"]) > 0
        losses = rel(torch.tensor(res["losses"]), torch.tensor(ref["losses"]))
        assert close(losses, TOL, "l2"), (res["losses"], ref["losses"])
    res = results[0]
    assert len(res["grads"]) == len(ref["grads"]) > 0
    for got, want in zip(res["grads"], ref["grads"]):
        assert close(worst_rel_err(got, want, rel), TOL, "l2")
    assert close(worst_rel_err(res["params"], ref["params"], rel), TOL, "l2")
    if evaluated:
        assert close(rel(torch.tensor(res["eval_loss"]), torch.tensor(ref["eval_loss"])), TOL, "l2")
    if "logits" in ref:
        assert res["logits"].shape == ref["logits"].shape
        assert close(rel(res["logits"], ref["logits"]), TOL, "l2")


@pytest.fixture(scope="module")
def ds_pools():
    """Gloo pools of this module alone: DeepSpeed leaves process-wide state (its comm backend, accelerate's state).

    DeepSpeed's CPU comm op is compiled once, here, before any rank starts (cached afterwards).
    """
    build = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    subprocess.run([sys.executable, "-c", build], check=True, env=dict(os.environ, DS_ACCELERATOR="cpu"),
                   stdout=subprocess.DEVNULL, timeout=600)
    pools = {}

    def get(world_size: int) -> RankPool:
        pool = pools.get(world_size)
        if pool is None or pool.broken:
            pools[world_size] = pool = RankPool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module")
def path():
    return saved_model_dir("llama")


@pytest.fixture(scope="module")
def reference(path):
    """One-process references, each computed once."""
    cache = {}

    def get(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = trainer_reference(path, **kw)
        return cache[key]

    return get


def test_zero3_sp2_trainer_equals_one_process(ds_pools, path, reference):
    """ZeRO-3, the ring over 2 ranks: training, evaluation and predictions, and DeepSpeed counts each sequence once."""
    results = ds_pools(2).run(ds_trainer_case, path, 2, stage=3)
    check_training(results, reference(), evaluated=True)
    res = results[0]
    assert res["tiled"]["loss"] > 0  # the tiled loss (on by default) ran under ZeRO-3's hooks
    assert res["engine"] == "DeepSpeedEngine" and res["reduced_over"] == 2
    assert res["train_batch_size"] == 1 * 2 * 1  # micro batch x accumulation x dp replicas


def test_zero3_dp2_sp2_trainer_equals_one_process(ds_pools, path, reference):
    """ZeRO-3 over 4 ranks: 2 data-parallel replicas x 2 ranks per sequence."""
    kw = dict(eval_rows=4, eval_pad="none")  # one process sees both replicas' rows; 4 rows split evenly
    results = ds_pools(4).run(ds_trainer_case, path, 2, stage=3, **kw)
    check_training(results, reference(per_device=2, **kw), evaluated=True)
    assert results[0]["reduced_over"] == 4 and results[0]["train_batch_size"] == 1 * 2 * 2


def test_zero3_head_parallel_tiled_offloaded(ds_pools, path, reference):
    """ZeRO-3 with head parallelism, the loss, MLP and norms tiled over chunks, checkpoints offloaded to the host."""
    results = ds_pools(2).run(ds_trainer_case, path, 2, stage=3, ulysses_size=2, tiling=True, offload=True,
                              eval_rows=0)
    check_training(results, reference(eval_rows=0))
    assert results[0]["tiled"]["loss"] > 0 and results[0]["tiled"]["rows"] > 0  # MLP and norms really chunked


def test_zero3_hybrid_sp4(ds_pools, path, reference):
    """ZeRO-3, one sequence over 4 ranks: head parallelism in pairs, the ring across the pairs."""
    results = ds_pools(4).run(ds_trainer_case, path, 4, stage=3, ulysses_size=2, eval_rows=0)
    check_training(results, reference(eval_rows=0))


@pytest.mark.parametrize("stage,loss_kwargs,tiling", [(1, False, False), (2, True, True)],
                         ids=["zero1-own-loss-scale", "zero2-tiled"])
def test_zero12_sp2_trainer_equals_one_process(ds_pools, path, reference, stage, loss_kwargs, tiling):
    """ZeRO-1 on the path where hf_ring scales the loss itself (a model taking no loss kwargs); ZeRO-2 tiled."""
    kw = dict(loss_kwargs=loss_kwargs, eval_rows=0)
    results = ds_pools(2).run(ds_trainer_case, path, 2, stage=stage, tiling=tiling, **kw)
    check_training(results, reference(**kw))
    assert results[0]["tiled"]["loss"] > 0 and (results[0]["tiled"]["rows"] > 0) == tiling


def test_zero3_sp2_mixture_of_experts_with_its_router_loss(ds_pools, tmp_path):
    """ZeRO-3 and the ring over 2 ranks on a mixture of experts with its router load-balancing loss on (reduced
    over the group): losses, gradients and parameters equal one process's."""
    path = router_cases.saved_moe(tmp_path, 97, torch.float32)
    results = ds_pools(2).run(ds_trainer_case, path, 2, stage=3, eval_rows=0)
    check_training(results, trainer_reference(path, eval_rows=0))


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # TRL reads it
def test_zero3_distillation_trainer_sp2_equals_one_process(ds_pools, tmp_path):
    """TRL's DistillationTrainer, student and teacher under ZeRO-3 (float32: DeepSpeed takes no float64), the
    sequence split over 2 ranks, equals one process without either: losses, gradients, parameters, eval loss and
    the logged completion lengths, token counts and entropy."""
    pytest.importorskip("trl")
    sft = example("sft")
    student = sft.default_model(str(tmp_path), len(sft.char_tokenizer()), 0)
    teacher = teacher_model(str(tmp_path), len(sft.char_tokenizer()))
    results = ds_pools(2).run(ds_distillation_case, student, teacher, 2, stage=3)
    ref = distillation_case(student, teacher, dtype=torch.float32)
    check_training(results, dict(ref, eval_loss=ref["metrics"]["eval_loss"]))
    assert close(rel(torch.tensor(results[0]["metrics"]["eval_loss"]), torch.tensor(ref["metrics"]["eval_loss"])),
                 TOL, "l2")
    assert set(results[0]["logged"]) == set(ref["logged"]) and len(ref["logged"]) >= 6
    for key, value in ref["logged"].items():
        assert close(scalar_rel_err(results[0]["logged"][key], value), TOL, "l2"), key


def test_zero3_accelerate_loop_sp2(ds_pools, path):
    """An accelerate loop with a DeepSpeedPlugin: ``loss * sp.loss_scale`` gives the one-process gradients."""
    res = ds_pools(2).run(ds_loop_case, path, 2, stage=3)[0]
    ref = loop_reference(path, 1)
    assert len(res["grads"]) == len(ref["grads"]) == 2
    for got, want in zip(res["grads"], ref["grads"]):
        assert close(worst_rel_err(got, want, rel), TOL, "l2")
    assert close(worst_rel_err(res["params"], ref["params"], rel), TOL, "l2")
    assert res["reduced_over"] == 2 and res["train_batch_size"] == 1 * 2 * 1
    assert "DeepSpeed manages" in res["sync_gradients"]  # the engine reduces; a second reduction is refused


@pytest.mark.parametrize("extra,gloo,needle", [
    ({"data_parallel_size": 1, "sequence_parallel_size": 2}, True, "remove data_parallel_size"),
    ({"sequence_parallel_size": 1}, True, "sets sequence_parallel_size=1 but prepare_trainer was given sp_size=2"),
    ({"tensor_parallel": {"autotp_size": 2}}, True, "remove tensor_parallel.autotp_size"),
    (None, False, "PartialState(backend='gloo')"),
], ids=["own-mesh", "other-sp-size", "autotp", "accelerate-one-process"])
def test_deepspeed_refusals_are_the_same_on_every_rank(ds_pools, path, extra, gloo, needle):
    messages = ds_pools(2).run(ds_refusal_case, path, 2, extra=extra, gloo=gloo)
    assert messages[0] is not None and needle in messages[0], messages
    assert messages[1] == messages[0]


def test_an_engine_with_sequence_parallelism_of_its_own_is_refused():
    """The loss scaling assumes an average over every rank: an engine reducing within fewer, or dividing by an sp
    size of its own (an mpu, a data_parallel_size mesh), is refused at the training step."""
    from types import SimpleNamespace

    from hf_ring.training.zero import check_engine

    sp = (2, 2)  # sp 2 x dp 2
    check_engine(SimpleNamespace(seq_dp_world_size=4, sequence_parallel_size=1), *sp)
    for engine in (SimpleNamespace(seq_dp_world_size=2, sequence_parallel_size=1),
                   SimpleNamespace(seq_dp_world_size=4, sequence_parallel_size=2)):
        with pytest.raises(ValueError, match="average over all ranks with none of its own"):
            check_engine(engine, *sp)


def test_the_cpu_op_compile_is_announced_once_where_it_will_happen(tmp_path, monkeypatch):
    """DeepSpeed compiles its CPU communication op inside accelerate's state, before any hf_ring call: import hf_ring
    says so on the CPU DeepSpeed route while the op is not cached, on local rank 0 only, and nowhere else."""
    import importlib.util

    from hf_ring.training.zero import SHM_OP, shm_op_cache, shm_op_notice

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "deepspeed" else None)
    env = {"DS_ACCELERATOR": "cpu", "ACCELERATE_USE_DEEPSPEED": "true", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    line = shm_op_notice(env)
    assert line is not None and SHM_OP in line and "2.5 minutes" in line and shm_op_cache(env) in line
    assert shm_op_notice(dict(env, LOCAL_RANK="1")) is None
    assert shm_op_notice(dict(env, DS_ACCELERATOR="cuda")) is None
    assert shm_op_notice({k: v for k, v in env.items() if k != "ACCELERATE_USE_DEEPSPEED"}) is None
    cache = shm_op_cache(env)
    os.makedirs(cache)
    open(os.path.join(cache, SHM_OP + ".so"), "w").close()
    assert shm_op_notice(env) is None  # compiled once, cached afterwards
