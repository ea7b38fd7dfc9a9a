"""Soft-capping (Gemma 2) and attention sinks (gpt-oss) against the float64 reference, on 1-3 ranks and in decode.

The reference caps the scores with tanh and adds each head's sink as one more
softmax column whose value vector is zero; autograd gives the sink gradient.
"""
import math

import pytest
import torch

import hf_ring
import reference as R
from attention_cases import assemble, make_qkv, options_case, packed_case
from attention_cases import packed_reference as reference
from helpers import rel_err
from hf_ring.engine.decode import DENSE, cached_attention, cached_blocks, merge_ranks
from test_packed_attention import packed, pat

FP32_TOL = 1e-5
NAMES = ("out", "dq", "dk", "dv")
BRANCHES = ((8, 1), (16, 2), (32, 4))
CAP = 1.5  # scores are O(1) here: a cap this small bends them well into tanh's curve


def sinks_for(hq, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hq, generator=g) * 1.5


def run(pools, world, args, **kw):
    n = args[4]
    results = [packed_case(*args, **kw)] if world == 1 else pools(world).run(packed_case, *args, **kw)
    got = {name: assemble(results, name, n) for name in NAMES}
    if results[0]["dsinks"] is not None:
        # Every rank returns its own rows' share of the sink gradient; the sum is the whole.
        shares = [r["dsinks"] for r in results]
        got["dsinks"] = sum(shares)
        got["shares"] = shares
    return got


def check(got, ref):
    errs = {name: rel_err(got[name], ref[name]) for name in ref}
    assert max(errs.values()) <= FP32_TOL, errs
    return errs


MODES = {
    "causal": ({"causal": True}, {}),
    "full": ({"causal": False}, {"causal": False}),
    "window": ({"window": 9}, {"window": 9}),
    "dilated": ({"pattern": pat(BRANCHES)}, {"branches": BRANCHES}),
}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("what", ["softcap", "sinks", "both"])
def test_alone_and_together(pools, world, mode, what):
    args = (world + 40, 2, 4, 2, 75, 8)
    kw, rkw = MODES[mode]
    opts = {}
    if what in ("softcap", "both"):
        opts["softcap"] = CAP
    if what in ("sinks", "both"):
        opts["sinks"] = sinks_for(4)
    got = run(pools, world, args, layout="zigzag" if world != 2 else "contiguous", **kw, **opts)
    check(got, reference(args, **rkw, **opts))
    if "sinks" in opts and world > 1:
        assert all(s.abs().max() > 0 for s in got["shares"])  # each rank really holds a share, not the whole


@pytest.mark.parametrize("world,layout", [(1, "contiguous"), (2, "zigzag"), (3, "contiguous")])
@pytest.mark.parametrize("mode", ["causal", "window", "dilated"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 1)], ids=["gqa3", "mqa"])
def test_with_documents_and_gqa(pools, world, layout, mode, heads):
    n = 90
    pos = packed([[7, 1, 30, 2], [44, 1]], n)
    args = (7, 2, heads[0], heads[1], n, 8)
    kw, rkw = MODES[mode]
    opts = {"softcap": CAP, "sinks": sinks_for(heads[0], 3)}
    got = run(pools, world, args, layout=layout, position_ids=pos, **kw, **opts)
    check(got, reference(args, position_ids=pos, **rkw, **opts))


def test_rows_without_keys_give_zero_with_sinks(pools):
    """A fully padded sample and dilated heads that see nothing: the sink takes all weight, the output is 0."""
    args = (9, 2, 4, 4, 24, 8)
    opts = {"sinks": sinks_for(4, 1), "softcap": 3.0}
    got = run(pools, 2, args, pad=24, pattern=pat(((24, 4),)), **opts)
    ref = reference(args, pad=24, branches=((24, 4),), **opts)
    check(got, ref)
    assert torch.equal(got["out"][0], torch.zeros_like(got["out"][0]))  # sample 0 has no key at all
    assert float(ref["out"][1, 0, 1].abs().max()) == 0.0 and torch.equal(got["out"][1, 0, 1], ref["out"][1, 0, 1].float())


def test_sinks_keep_their_dtype_and_gradient_dtype():
    q, k, v, dout = make_qkv(2, 1, 4, 2, 20, 8)
    for dtype in (torch.float64, torch.bfloat16):
        sinks = sinks_for(4).to(dtype).requires_grad_(True)
        out = hf_ring.ring_attention(q, k, v, sinks=sinks)
        out.backward(dout)
        assert out.dtype == torch.float32 and sinks.grad.dtype == dtype
        ref = R.with_grads_sinks(lambda q, k, v, sinks: R.attention(q, k, v, bias=_causal(20), sinks=sinks),
                                 q, k, v, sinks.detach().double(), dout)
        assert rel_err(out, ref[0]) <= FP32_TOL
        tol = FP32_TOL if dtype == torch.float64 else 1e-2  # bf16 rounds the gradient itself
        assert rel_err(sinks.grad, ref[4]) <= tol


def _causal(n):
    return torch.zeros(1, n, n, dtype=torch.float64).masked_fill(~R.dense_mask(n), float("-inf"))


class StackedPartials:
    """Stands in for a ring of ``len(parts)`` ranks whose all-gather returns these packed partials."""

    def __init__(self, parts):
        self.parts, self.world_size = parts, len(parts)

    def all_gather(self, tensor, what):
        return torch.stack(self.parts)


@pytest.mark.parametrize("branches", [DENSE, BRANCHES], ids=["dense", "dilated"])
@pytest.mark.parametrize("world", [1, 3])
def test_decode_with_softcap_and_sinks_equals_full_forward_rows(branches, world):
    args = (11, 2, 4, 2, 48, 8)
    q, k, v, _ = make_qkv(*args)
    sinks = sinks_for(4, 5)
    ref = reference(args, branches=None if branches is DENSE else branches, softcap=CAP, sinks=sinks)["out"]
    worst = 0.0
    for t in (0, 1, 17, 47):
        parts = []
        for r in range(world):
            mine = torch.arange(t + 1)[r::world]  # keys dealt round-robin over the simulated ranks
            blocks = cached_blocks(torch.tensor([t]), mine, hq=4, hkv=2, branches=branches)
            o, lse = cached_attention(q[:, :, t:t + 1], k[:, :, mine], v[:, :, mine], blocks,
                                      scale=8 ** -0.5, softcap=CAP)
            parts.append(torch.cat([o, lse.to(o.dtype).unsqueeze(-1)], -1))
        if world == 1:
            got = merge_ranks(parts[0][..., :-1], parts[0][..., -1], None, sinks=sinks)
        else:
            got = merge_ranks(parts[0][..., :-1], parts[0][..., -1], StackedPartials(parts), sinks=sinks)
        worst = max(worst, rel_err(got, ref[:, :, t:t + 1]))
    assert worst <= FP32_TOL, worst


def test_decode_refuses_documents_and_bad_options():
    with pytest.raises(ValueError, match="packed documents"):
        cached_blocks(torch.tensor([3]), torch.arange(4), hq=2, hkv=2, documents=((0, 2),))
    q, k, v, _ = make_qkv(0, 1, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
        cached_attention(q, k, v, [], scale=0.5, softcap=-1.0)
    with pytest.raises(ValueError, match=r"sinks must have shape \(query heads,\) = \(2,\)"):
        merge_ranks(q, q[..., 0], None, sinks=torch.zeros(3))


@pytest.mark.parametrize("kw,exc,match", [
    ({"softcap": 0.0}, ValueError, "softcap must be a finite float > 0"),
    ({"softcap": -2.0}, ValueError, "softcap must be a finite float > 0"),
    ({"softcap": math.nan}, ValueError, "softcap must be a finite float > 0"),
    ({"softcap": math.inf}, ValueError, "softcap must be a finite float > 0"),
    ({"softcap": True}, TypeError, "softcap must be a float"),
    ({"softcap": "30"}, TypeError, "softcap must be a float"),
    ({"sinks": torch.zeros(3)}, ValueError, r"sinks must have shape \(query heads,\) = \(2,\)"),
    ({"sinks": torch.zeros(1, 2)}, ValueError, r"sinks must have shape"),
    ({"sinks": torch.zeros(2, dtype=torch.long)}, TypeError, "sinks must be a floating-point tensor"),
    ({"sinks": [0.0, 0.0]}, TypeError, "sinks must be a float tensor"),
])
def test_bad_options(kw, exc, match):
    q, k, v, _ = make_qkv(0, 1, 2, 2, 8, 4)
    with pytest.raises(exc, match=match):
        hf_ring.ring_attention(q, k, v, **kw)


@pytest.mark.parametrize("per_rank,word", [
    ([{"softcap": 30.0}, {}], "softcap"),
    ([{"softcap": 30.0}, {"softcap": 50.0}], "softcap"),
    ([{}, {"sinks": torch.zeros(2)}], "sinks"),
], ids=["softcap-presence", "softcap-value", "sinks-presence"])
def test_ranks_disagreeing_fail_alike(pools, per_rank, word):
    res = pools(2).run(options_case, per_rank)
    assert res[0] == res[1] and res[0][0] == "ValueError" and f"different {word}" in res[0][1], res
