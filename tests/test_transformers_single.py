"""ring_dilated as a transformers backend in one process: a drop-in for sdpa, and dilated on request."""
import pytest
import torch

import hf_ring
from hf_ring.integration.seams import CACHE_KEYWORD
import hf_ring.entry.backend
import reference as R
from helpers import rel_err
from models import batch, load, saved_model_dir, tiny_config

pytestmark = pytest.mark.compat  # the subset run on every supported transformers release

TOL = 1e-5


def logits(model, data, **kw):
    with torch.no_grad():
        return model(input_ids=data["input_ids"], attention_mask=data.get("attention_mask"), use_cache=False, **kw).logits


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("pad", ["none", "right", "left"])
def test_dense_logits_equal_sdpa(kind, pad):
    path = saved_model_dir(kind)
    data = batch(1, 2, 40, pad=pad)
    ref = logits(load(path, "sdpa"), data)
    got = logits(load(path, "ring_dilated"), data)
    keep = data["attention_mask"].bool()  # padded query rows carry no meaning in either backend
    assert rel_err(got[keep], ref[keep]) <= TOL


def test_mistral_sliding_window_smaller_than_sequence():
    path = saved_model_dir("mistral", sliding_window=8)
    data = batch(2, 2, 45)
    ref = logits(load(path, "sdpa"), data)
    got = logits(load(path, "ring_dilated"), data)
    assert rel_err(got, ref) <= TOL
    full = logits(load(saved_model_dir("mistral"), "ring_dilated"), data)
    assert rel_err(full, got) > 1e-3, "the window must change the result"


def test_training_loss_and_grads_equal_sdpa():
    path = saved_model_dir("llama")
    data = batch(3, 2, 33, pad="right")
    results = []
    for attn in ("sdpa", "ring_dilated"):
        model = load(path, attn).train()
        out = model(**data, use_cache=False)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l1, g1), (l2, g2) = results
    assert abs(l1 - l2) <= TOL * abs(l1)
    for name in g1:
        assert rel_err(g2[name], g1[name]) <= TOL, name


def test_set_attn_implementation_and_from_config():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config(), attn_implementation="ring_dilated")
    assert model.config._attn_implementation == "ring_dilated"
    model.set_attn_implementation("sdpa")
    model.set_attn_implementation("ring_dilated")
    assert model.config._attn_implementation == "ring_dilated"


def test_dilated_model_matches_reference_attention():
    """A one-layer model's attention output equals the float64 dilated reference."""
    path = saved_model_dir("llama", num_hidden_layers=1)
    model = load(path, "ring_dilated")
    branches = ((8, 1), (16, 2), (40, 4))
    hf_ring.configure(model, pattern={"segment_lengths": [8, 16, 40], "dilation_rates": [1, 2, 4]})
    captured = {}
    attn = model.model.layers[0].self_attn
    original = hf_ring.entry.backend.run

    def spy(q, k, v, comm, spec):
        captured.update(q=q.detach(), k=k.detach(), v=v.detach(), scale=spec.scale)
        out = original(q, k, v, comm, spec)
        captured["out"] = out.detach()
        return out

    hf_ring.entry.backend.run = spy
    try:
        logits(model, batch(4, 1, 40))
    finally:
        hf_ring.entry.backend.run = original
    ref = R.dilated_attention(captured["q"], captured["k"], captured["v"], branches=branches, scale=captured["scale"])
    assert rel_err(captured["out"], ref) <= TOL
    assert attn.config.ring_dilated["dilation_rates"] == [1, 2, 4]


def test_config_round_trip(tmp_path):
    path = saved_model_dir("llama")
    model = load(path, "ring_dilated")
    pattern = hf_ring.DilatedPattern([8, 32], [1, 2])
    hf_ring.configure(model, pattern=pattern, layout="contiguous")
    data = batch(5, 1, 48)
    before = logits(model, data)
    model.save_pretrained(tmp_path, safe_serialization=True)
    again = load(str(tmp_path), "ring_dilated")
    assert again.config.ring_dilated == {"layout": "contiguous", "segment_lengths": [8, 32], "dilation_rates": [1, 2]}
    assert torch.equal(logits(again, data), before)


@pytest.mark.parametrize(
    "value,exc,match",
    [
        ({"segment_lengths": [8], "dilation_rates": [1], "windo": 3}, ValueError, "unknown keys"),
        ({"segment_lengths": [8]}, ValueError, "both segment_lengths and dilation_rates"),
        ({"segment_lengths": [8, 16], "dilation_rates": [1]}, ValueError, "one rate per segment length"),
        ({"layout": "ring"}, ValueError, "layout='ring'"),
        ([8, 1], TypeError, "must be a dict"),
    ],
)
def test_bad_config_is_reported(value, exc, match):
    model = load(saved_model_dir("llama"), "ring_dilated")
    model.config.ring_dilated = value
    with pytest.raises(exc, match=match):
        logits(model, batch(6, 1, 16))


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_transformers_cache_in_one_process_equals_full_forward(kind):
    path = saved_model_dir("llama") if kind == "llama" else saved_model_dir("mistral", sliding_window=5)
    model = load(path, "ring_dilated")
    ids = batch(7, 2, 16)["input_ids"]
    with torch.no_grad():
        full = load(path, "sdpa")(input_ids=ids, use_cache=False).logits
        out = model(input_ids=ids[:, :10], use_cache=True)
        steps = [out.logits]
        cache = getattr(out, CACHE_KEYWORD)
        for t in range(10, 16, 3):  # three tokens at a time over transformers' own cache
            out = model(input_ids=ids[:, t:t + 3], **{CACHE_KEYWORD: cache}, use_cache=True)
            steps.append(out.logits)
    assert rel_err(torch.cat(steps, 1), full) <= TOL


def _shared_prefix(dtype):
    """transformers' custom-4-D-mask case: a 3-token prefix and three one-token continuations of it in one row of
    6 (positions 0, 1, 2, 3, 3, 3), each continuation seeing the prefix and itself; the mask additive (``dtype``'s
    lowest value where masked, as transformers' test writes it) or boolean."""
    allowed = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                            [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    mask = allowed if dtype is torch.bool else torch.zeros(6, 6, dtype=dtype).masked_fill(~allowed,
                                                                                           torch.finfo(dtype).min)
    return mask[None, None], torch.tensor([[0, 1, 2, 3, 3, 3]])


@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool], ids=["additive", "boolean"])
def test_a_custom_4d_mask_gives_sdpas_logits(kind, dtype):
    """A 4-D mask of the caller's own (tree and speculative decoding, packed rows with a block mask) in one process:
    sdpa's logits, and each continuation's logits those of its own sequence run alone."""
    path = saved_model_dir(kind)
    ids = batch(5, 1, 6)["input_ids"]
    mask, positions = _shared_prefix(dtype)
    got, want = (logits(load(path, attn), {"input_ids": ids, "attention_mask": mask}, position_ids=positions)
                 for attn in ("ring_dilated", "sdpa"))
    assert rel_err(got, want) <= TOL
    model = load(path, "ring_dilated")
    for last in (3, 4, 5):  # the prefix, then that one continuation
        alone = logits(model, {"input_ids": torch.cat([ids[:, :3], ids[:, last:last + 1]], 1)})
        assert rel_err(got[0, last], alone[0, -1]) <= TOL
