"""Sequence tiling of the loss and the MLP: same loss and gradients as the untiled model, no (rows x vocab) logits."""
import math

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

import hf_ring
from model_cases import sp_tiled_train_case
from helpers import close
from helpers import rel_err as rel
from helpers import worst_rel_err as worst_grad
from hf_ring.patches import tiling
from hf_ring.integration.seams import enable_checkpointing
from models import batch, load, saved_model_dir

pytestmark = pytest.mark.compat  # the subset run on every supported transformers release

TOL = 1e-5


# ---- the loss function alone, against transformers' loss on full logits in float64 ----------------------------

def _inputs(seed, b=2, n=13, h=8, v=11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, n, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    bias = torch.randn(v, generator=g)
    labels = torch.randint(0, v, (b, n), generator=g)
    labels[0, :3] = -100
    labels[1, 7] = -100
    return hidden, weight, bias, labels


def _reference(hidden, weight, bias, softcap=None, **loss_kw):
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    bb = None if bias is None else bias.double().requires_grad_()
    logits = torch.nn.functional.linear(h, w, bb)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    loss = ForCausalLMLoss(logits, vocab_size=w.shape[0], **loss_kw)
    loss.backward()
    return loss.detach(), [t.grad for t in (h, w, bb) if t is not None]


@pytest.mark.parametrize("chunk", [1, 4, 26, 100])
@pytest.mark.parametrize("form", ["labels", "shift_labels", "num_items_int", "num_items_tensor", "softcap", "no_bias"])
def test_tiled_loss_equals_full_logits_loss(chunk, form):
    hidden, weight, bias, labels = _inputs(1)
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    kw, ref_kw, softcap = {"labels": labels}, {"labels": labels}, None
    if form == "shift_labels":
        kw = ref_kw = {"labels": labels, "shift_labels": shifted}
    elif form == "num_items_int":
        kw = ref_kw = {"labels": labels, "num_items_in_batch": 40}
    elif form == "num_items_tensor":
        kw = ref_kw = {"labels": labels, "num_items_in_batch": torch.tensor(40)}
    elif form == "softcap":
        softcap = 2.5
    elif form == "no_bias":
        bias = None
    ref_loss, ref_grads = _reference(hidden, weight, bias, softcap, **ref_kw)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    h, w = leaves[:2]
    loss = hf_ring.tiled_causal_lm_loss(h, w, leaves[2] if bias is not None else None, softcap=softcap,
                                        chunk_rows=chunk, **kw)
    loss.backward()
    assert close(rel(loss.detach(), ref_loss), TOL)
    for leaf, ref in zip(leaves, ref_grads):
        assert close(rel(leaf.grad, ref), TOL)


def test_tiled_loss_scales_by_any_output_gradient_and_backwards_twice():
    hidden, weight, bias, labels = _inputs(5)
    ref_loss, ref_grads = _reference(hidden, weight, bias, labels=labels)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = hf_ring.tiled_causal_lm_loss(*leaves, labels=labels, chunk_rows=5)
    (loss * 3.0).backward(retain_graph=True)
    for leaf, ref in zip(leaves, ref_grads):
        assert close(rel(leaf.grad, 3.0 * ref), TOL)
    loss.backward()  # the gradients the forward computed are still intact
    for leaf, ref in zip(leaves, ref_grads):
        assert close(rel(leaf.grad, 4.0 * ref), TOL)


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_tiled_loss_makes_each_chunks_logits_once_and_no_gradients_without_grad_mode():
    hidden, weight, bias, labels = _inputs(6)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    chunks = math.ceil(hidden.shape[0] * hidden.shape[1] / 7)
    with _CountMatmuls() as counted:
        hf_ring.tiled_causal_lm_loss(*leaves, labels=labels, chunk_rows=7).backward()
    assert counted.count == 3 * chunks  # logits, d hidden, d weight: once each per chunk
    with torch.no_grad(), _CountMatmuls() as counted:
        loss = hf_ring.tiled_causal_lm_loss(*leaves, labels=labels, chunk_rows=7)
    assert counted.count == chunks
    assert close(rel(loss, _reference(hidden, weight, bias, labels=labels)[0]), TOL)


def test_tiled_loss_rows_all_ignored_is_nan_like_the_untiled_loss():
    hidden, weight, bias, labels = _inputs(2)
    labels[:] = -100
    assert torch.isnan(hf_ring.tiled_causal_lm_loss(hidden, weight, bias, labels=labels, chunk_rows=4))
    assert torch.isnan(ForCausalLMLoss(torch.nn.functional.linear(hidden, weight, bias), labels, vocab_size=11))


def test_tiled_loss_refuses_bad_arguments():
    hidden, weight, bias, labels = _inputs(3)
    with pytest.raises(ValueError, match="labels or shift_labels"):
        hf_ring.tiled_causal_lm_loss(hidden, weight)
    with pytest.raises(ValueError, match="does not match"):
        hf_ring.tiled_causal_lm_loss(hidden, weight, labels=labels[:, :5])
    with pytest.raises(ValueError, match="chunk_rows"):
        hf_ring.tiled_causal_lm_loss(hidden, weight, labels=labels, chunk_rows=0)
    with pytest.raises(ValueError, match="softcap"):
        hf_ring.tiled_causal_lm_loss(hidden, weight, labels=labels, softcap=-1.0)


def test_tiled_rows_equals_one_pass_and_repeats_dropout():
    g = torch.Generator().manual_seed(4)
    lin1, lin2 = torch.nn.Linear(6, 10), torch.nn.Linear(10, 6)
    drop = torch.nn.Dropout(0.3)

    def fn(x):
        return lin2(drop(torch.nn.functional.silu(lin1(x))))

    x = torch.randn(2, 9, 6, generator=g)
    dout = torch.randn(2, 9, 6, generator=g)
    params = list(lin1.parameters()) + list(lin2.parameters())
    for chunk in (4, 18, 50):
        torch.manual_seed(7)
        xr = x.clone().requires_grad_()
        ref = fn(xr)
        ref_grads = torch.autograd.grad(ref, [xr] + params, dout)
        torch.manual_seed(7)
        xt = x.clone().requires_grad_()
        out = hf_ring.tiled_rows(fn, xt, params, chunk)
        # Dropout draws in row order, so chunks see the same mask as one pass.
        assert close(rel(out, ref), TOL)
        for got, want in zip(torch.autograd.grad(out, [xt] + params, dout), ref_grads):
            assert close(rel(got, want), TOL)


# ---- whole models in one process -----------------------------------------------------------------------------

def _step(model, data, **extra):
    out = model(**data, **extra)
    out.loss.backward()
    return out, {k: p.grad.clone() for k, p in model.named_parameters()}


def _check_tiled_step(model, data, ref, ref_grads, **chunks):
    """A step of ``model`` with loss, MLP and norms tiled gives ``ref``'s loss and gradients, and no logits."""
    hf_ring.configure_tiling(model, loss=True, mlp=True, norm=True, **chunks)
    try:
        out, grads = _step(model, data)
    finally:
        tiling.revert(model)
    assert out.logits is None
    assert close(rel(out.loss.detach(), ref.loss.detach()), TOL)
    assert close(worst_grad(grads, ref_grads), TOL)


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),
    ("mistral", {}),
    ("llama", {"tie_word_embeddings": True}),
])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_model_step_equals_untiled(kind, overrides, checkpointing):
    path = saved_model_dir(kind, **overrides)
    data = batch(5, 2, 29, pad="right")
    ref_model = load(path, "sdpa").train()
    model = load(path, "sdpa").train()
    if checkpointing:
        enable_checkpointing(ref_model)
        enable_checkpointing(model)
    _check_tiled_step(model, data, *_step(ref_model, data), loss_chunk_rows=7, row_chunk_rows=9)


def _family_model(kind):
    from transformers import AutoModelForCausalLM, Gemma2Config, Qwen2Config, Qwen3Config

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    cfg = {"qwen2": lambda: Qwen2Config(**common),
           "qwen3": lambda: Qwen3Config(head_dim=16, **common),
           "gemma2": lambda: Gemma2Config(head_dim=16, final_logit_softcapping=3.0, **common)}[kind]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).train()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "gemma2"])
def test_tiled_step_other_families(kind):
    model = _family_model(kind)
    data = batch(6, 1, 23, pad="right")
    ref, ref_grads = _step(model, data)
    model.zero_grad(set_to_none=True)
    _check_tiled_step(model, data, ref, ref_grads, loss_chunk_rows=5, row_chunk_rows=6)


def test_logits_come_back_without_labels_or_when_asked():
    path = saved_model_dir("llama")
    model = load(path, "sdpa")
    data = batch(7, 1, 17)
    with torch.no_grad():
        ref = model(**data)
        hf_ring.configure_tiling(model, loss=True, mlp=True, norm=True, loss_chunk_rows=4, row_chunk_rows=5)
        try:
            plain = model(input_ids=data["input_ids"])
            asked = model(**data, return_logits=True)
            tiled = model(**data)
            as_tuple = model(**data, return_dict=False)
        finally:
            tiling.revert(model)
    assert plain.loss is None and close(rel(plain.logits, ref.logits), TOL)
    assert close(rel(asked.logits, ref.logits), TOL) and close(rel(asked.loss, ref.loss), TOL)
    assert tiled.logits is None and close(rel(tiled.loss, ref.loss), TOL)
    assert isinstance(as_tuple, tuple) and close(rel(as_tuple[0], ref.loss), TOL)


def test_untiled_by_default_without_sequence_parallelism_and_when_switched_off():
    path = saved_model_dir("llama")
    model = load(path, "sdpa")
    data = batch(8, 1, 12)
    try:
        hf_ring.configure_tiling(model)  # default: tiled under sequence parallelism only
        assert model(**data).logits is not None
        hf_ring.configure_tiling(model, loss=False)
        assert model(**data).logits is not None
    finally:
        tiling.revert(model)


def test_patch_is_reversible_and_idempotent():
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaMLP

    forward, mlp_forward = LlamaForCausalLM.forward, LlamaMLP.forward
    tiling.apply("llama")
    patched = LlamaForCausalLM.forward
    tiling.apply(LlamaForCausalLM)
    assert tiling.is_applied("llama") and LlamaForCausalLM.forward is patched and LlamaMLP.forward is not mlp_forward
    tiling.revert("llama")
    assert LlamaForCausalLM.forward is forward and LlamaMLP.forward is mlp_forward and not tiling.is_applied("llama")
    tiling.apply_all()
    tiling.revert_all()
    assert LlamaForCausalLM.forward is forward


def test_forwards_and_mlps_the_tiled_versions_do_not_reproduce_are_refused():
    from transformers import (CohereConfig, CohereForCausalLM, GemmaConfig, GemmaForCausalLM, MixtralConfig,
                              MixtralForCausalLM)

    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2)
    with pytest.raises(TypeError, match=r"CohereForCausalLM \(model type 'cohere', transformers .*differs"):
        tiling.apply(CohereForCausalLM(CohereConfig(**small)))  # its logit scale
    mixtral = MixtralForCausalLM(MixtralConfig(num_local_experts=2, **small))
    with pytest.raises(TypeError, match="MixtralSparseMoeBlock is not a known row-wise MLP"):
        tiling.apply(mixtral)
    tiling.apply(mixtral, mlp=False, norm=False)  # its loss with the router term is reproduced
    assert tiling.is_applied(mixtral)
    tiling.revert(mixtral)
    gemma = GemmaForCausalLM(GemmaConfig(head_dim=8, **small))
    with pytest.raises(TypeError, match="GemmaMLP is not a known row-wise MLP"):
        tiling.apply(gemma)
    with pytest.raises(TypeError, match="GemmaRMSNorm is not a known row-wise Norm"):
        tiling.apply(gemma, mlp=False)
    tiling.apply(gemma, mlp=False, norm=False)  # the loss alone is standard
    assert tiling.is_applied(gemma)
    tiling.revert(gemma)
    assert not tiling.is_applied(gemma)
    with pytest.raises(ValueError, match="no tiling entry"):
        tiling.apply("gpt2")
    model = load(saved_model_dir("llama"), "sdpa")
    with pytest.raises(ValueError, match="loss_chunk_rows"):
        hf_ring.configure_tiling(model, loss_chunk_rows=0)
    with pytest.raises(TypeError, match="loss must be"):
        hf_ring.configure_tiling(model, loss="yes")


# ---- sharded over 2 ranks ------------------------------------------------------------------------------------

def _untiled_reference(path, seed, b, n, pad="right"):
    model = load(path, "sdpa").train()
    out, grads = _step(model, batch(seed, b, n, pad=pad))
    return out, grads


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("chunks", [(5, 7), (64, 64)])  # not dividing the 18/19-row shards; longer than a shard
def test_sp2_tiled_step_equals_untiled_single_process(pools, kind, chunks):
    path = saved_model_dir(kind)
    n = 37
    results = pools(2).run(sp_tiled_train_case, path, 11, 2, n, *chunks)
    ref, ref_grads = _untiled_reference(path, 11, 2, n)
    for res in results:
        assert res["logits"] is None
        assert close(rel(torch.tensor(res["loss"]), ref.loss.detach()), TOL)
    assert close(worst_grad(results[0]["grads"], ref_grads), TOL)


def test_sp2_tiled_dilated_step_and_logits_on_request(pools):
    path = saved_model_dir("llama")
    pattern = {"segment_lengths": [8, 16, 41], "dilation_rates": [1, 2, 4]}
    results = pools(2).run(sp_tiled_train_case, path, 12, 1, 41, 6, 5, pattern=pattern, return_logits=True)
    model = load(path, "ring_dilated").train()
    hf_ring.configure(model, pattern=pattern)
    ref, ref_grads = _step(model, batch(12, 1, 41, pad="right"))
    for res in results:
        assert close(rel(res["logits"], ref.logits.detach()), TOL)
        assert close(rel(torch.tensor(res["loss"]), ref.loss.detach()), TOL)
    assert close(worst_grad(results[0]["grads"], ref_grads), TOL)


def test_sp2_tiled_step_makes_no_rows_by_vocab_tensor(pools):
    path = saved_model_dir("llama")
    n, vocab, hidden, chunk = 200, 97, 64, 8  # 100 rows per rank, more than the hidden size
    tiled = pools(2).run(sp_tiled_train_case, path, 13, 1, n, chunk, 16, spy_vocab=vocab)
    for res in tiled:
        assert res["rows"] == 100 and res["vocab_shapes"], "the spy saw no logits at all"
        # Only chunks of logits and the (transposed) lm_head weight end in the vocabulary.
        leading = [math.prod(s[:-1]) for s in res["vocab_shapes"]]
        assert max(leading) <= max(chunk, hidden) < res["rows"], res["vocab_shapes"]
        assert (chunk, vocab) in res["vocab_shapes"]
    # The same spy does see the (batch, rows, vocab) logits of an untiled step.
    untiled = pools(2).run(sp_tiled_train_case, path, 13, 1, n, chunk, 16, spy_vocab=vocab, return_logits=True)
    for res in untiled:
        assert (1, res["rows"], vocab) in res["vocab_shapes"]
