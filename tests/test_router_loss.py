"""A mixture of experts' router load-balancing loss with the sequence split equals one process's: the loss (router
term included) and every gradient within 1e-5 relative per tensor, the reported ``aux_loss`` the whole sequence's
on every rank, for every type whose forward adds its module's ``load_balancing_loss_func``, padded and packed.

The references are transformers' ``eager`` models in one process on the whole batch (a packed row's documents kept
apart by transformers' own mask from the restarting positions)."""
import pytest
import torch

import router_cases
from helpers import close, gradient_errors, rel_err, scalar_rel_err, worst_rel_err
from dist_pool import RankError
from trainer_cases import dpo_case, example, kto_case, sampling_case, sft_case, trainer_case
from hf_ring.patches import router_loss

pytestmark = pytest.mark.filterwarnings("ignore")

TOL = 1e-5
ROUTED = router_cases.routed_types()
STANDARD = [t for t in ROUTED if router_cases.reduced_over_shards(t)]
OTHER = [t for t in ROUTED if t not in STANDARD]
FORMS = [False, True]


def _errors(got, want):
    errs = {"loss": rel_err(got["loss"], want["loss"]), "aux_loss": rel_err(got["aux_loss"], want["aux_loss"]),
            **gradient_errors(got["grads"], want["grads"])}
    worst = max(errs, key=errs.get)
    return worst, errs[worst]


def _reference(model_type, packed):
    try:
        return router_cases.one_process(model_type, packed)
    except AssertionError as err:
        pytest.skip(f"cannot be built tiny: {err}")
    except router_cases.NoExperts as err:
        pytest.skip(str(err))


def _check(got, want):
    """Exact, or refused alike on every rank for the model's structure (never for its router term)."""
    if any("unbuilt" in r for r in got):
        pytest.skip(f"transformers cannot build it with ring_dilated: {got[0]['unbuilt']}")
    refused = [r.get("refused") for r in got]
    if any(refused):
        assert len(set(refused)) == 1 and "router" not in refused[0], refused
        return
    for r in got:  # every rank reports the whole sequence's router term, as one process does
        assert rel_err(r["aux_loss"], want["aux_loss"]) <= TOL, (r["aux_loss"], want["aux_loss"])
    worst, err = _errors(got[0], want)
    assert err <= TOL, (worst, err)


def test_the_routed_types_are_found_from_their_modeling_code():
    assert {"mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss", "granitemoe", "jamba", "qwen3_next",
            "qwen3_5_moe_text", "granitemoehybrid", "minimax"} <= set(ROUTED), ROUTED


@pytest.mark.parametrize("packed", FORMS, ids=["padded", "packed"])
@pytest.mark.parametrize("model_type", STANDARD)
def test_the_router_loss_over_two_ranks_is_one_processs(pools, model_type, packed):
    want = _reference(model_type, packed)
    _check(pools(2).run(router_cases.sharded_step, model_type, packed), want)


@pytest.mark.parametrize("model_type", OTHER)
def test_a_router_loss_of_another_form_is_refused_on_every_rank(pools, model_type):
    """A family whose load_balancing_loss_func is not the loss reduced over the group (another signature or
    formula: Doge's expert keys, ...) is refused before the model computes, naming the function."""
    got = pools(2).run(router_cases.sharded_step, model_type, False)
    refused = [r.get("refused") for r in got]
    assert len(set(refused)) == 1 and refused[0] and "load_balancing_loss_func" in refused[0], refused


@pytest.mark.parametrize("ulysses", [1, 2, 4], ids=["ring", "ring-and-heads", "heads"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_the_router_loss_over_four_ranks_is_one_processs(pools, model_type, ulysses):
    want = _reference(model_type, True)
    _check(pools(4).run(router_cases.sharded_step, model_type, True, ulysses), want)


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled-loss", "own-loss"])
def test_the_tiled_loss_adds_the_router_term(pools, tiled):
    """The tiled loss (no rows x vocab logits) keeps a mixture of experts: its router term added, not refused."""
    want = _reference("qwen3_moe", False)
    got = pools(2).run(router_cases.sharded_step, "qwen3_moe", False, 1, tiled)
    _check(got, want)
    assert [r["logits"] for r in got] == [not tiled] * 2


def test_a_router_term_of_another_form_is_refused():
    def per_sequence(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return router_loss._standard(gate_logits, num_experts, top_k, attention_mask) ** 2

    assert router_loss.matches(router_loss._standard)
    assert not router_loss.matches(per_sequence)
    assert not router_loss.matches(lambda logits: 0.0)


def test_a_trainer_step_with_the_router_loss_is_one_processs(pools, tmp_path):
    """transformers' Trainer under prepare_trainer, two micro-batches of padded rows per step, each adding its own
    router term: every logged loss, every step's gradients and the final parameters equal one process's."""
    path = router_cases.saved_moe(tmp_path, 97, torch.float32)
    res = pools(2).run(trainer_case, path, 2, predict_rows=0)[0]
    ref = trainer_case(path, predict_rows=0)
    assert len(res["losses"]) == len(ref["losses"]) > 0
    for got, want in zip(res["losses"], ref["losses"]):
        assert close(scalar_rel_err(got, want), TOL), (res["losses"], ref["losses"])
    for got, want in zip(res["grads"], ref["grads"]):
        assert close(worst_rel_err(got, want), TOL)
    assert close(worst_rel_err(res["params"], ref["params"]), TOL)


def _same_training(got, want):
    """Every logged loss and every step's gradients within TOL (and the final parameters where returned)."""
    assert len(got["losses"]) == len(want["losses"]) > 0
    for g, w in zip(got["losses"], want["losses"]):
        assert close(scalar_rel_err(g, w), TOL), (got["losses"], want["losses"])
    assert len(got["grads"]) == len(want["grads"]) > 0
    for g, w in zip(got["grads"], want["grads"]):
        assert close(worst_rel_err(g, w), TOL)
    if "params" in want:
        assert close(worst_rel_err(got["params"], want["params"]), TOL)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
def test_sft_trainer_with_the_router_loss_is_one_processs(pools, tmp_path, padding_free):
    """SFTTrainer adds its fused LM head's router term to a rank's share of the token loss, unscaled for the
    average over ranks: the term's gradient is handed over scaled for it, so every logged loss (router term
    included) and every step's gradients equal one process's; a term carrying one share's gradient fails here."""
    pytest.importorskip("trl")
    path = router_cases.saved_moe(tmp_path, len(example("sft").char_tokenizer()), torch.float64)
    options = dict(padding_free=padding_free, dtype=torch.float64, experts_implementation="eager")
    got = pools(2).run(sft_case, path, 2, **options)[0]
    _same_training(got, sft_case(path, **options))


def test_sft_trainer_with_the_router_loss_over_data_and_sequence_parallelism(pools, tmp_path):
    """Two replicas of two ranks each: every replica's router term is its own batch's, as two processes without the
    sequence split compute it (transformers and TRL average it over the replicas)."""
    pytest.importorskip("trl")
    path = router_cases.saved_moe(tmp_path, len(example("sft").char_tokenizer()), torch.float64)
    options = dict(dtype=torch.float64, experts_implementation="eager", steps=1)
    got = pools(4).run(sft_case, path, 2, **options)[0]
    _same_training(got, pools(2).run(sft_case, path, None, **options)[0])


POST_TRAINING = {"DPO": (dpo_case, {}), "KTO": (kto_case, {}), "GRPO": (sampling_case, {"trainer": "GRPO"}),
                 "RLOO": (sampling_case, {"trainer": "RLOO"})}
SAMPLING = ("GRPO", "RLOO")
"""Trainers that sample with generate: a config asking for router logits would make every decoding step compute
transformers' router loss from one token per row against the whole mask, which fails in one process too; the
trainers ask for them in the calls they score."""


@pytest.mark.parametrize("name", sorted(POST_TRAINING))
def test_post_training_with_the_router_loss_is_one_processs(pools, tmp_path, name):
    """TRL's post-training trainers add the fused head's router term to a loss every rank computes whole: losses,
    every step's gradients and the final parameters equal one process's."""
    pytest.importorskip("trl")
    case, options = POST_TRAINING[name]
    path = router_cases.saved_moe(tmp_path, len(example("sft").char_tokenizer()), torch.float64, name not in SAMPLING)
    options = dict(options, experts_implementation="eager")
    got = pools(2).run(case, path, 2, **options)[0]
    _same_training(got, case(path, **options))
