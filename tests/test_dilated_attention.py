"""Dilated (LongNet) attention against the float64 multiplicity-weighted reference, on 1-4 ranks."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_ring
import reference as R
from attention_cases import assemble, make_qkv, ring_case
from helpers import cancelling_scale, rel_err
from hf_ring import DilatedPattern

FP32_TOL = 1e-5
NAMES = ("out", "dq", "dk", "dv")


def run(pools, world, seed, b, hq, hkv, n, d, **kw):
    if world == 1:
        results = [ring_case(seed, b, hq, hkv, n, d, **kw)]
    else:
        results = pools(world).run(ring_case, seed, b, hq, hkv, n, d, **kw)
    return {name: assemble(results, name, n) for name in NAMES}


def reference(seed, b, hq, hkv, n, d, branches, causal=True):
    q, k, v, dout = make_qkv(seed, b, hq, hkv, n, d)
    return dict(zip(NAMES, R.with_grads(R.dilated_attention, q, k, v, dout, branches=branches, causal=causal)))


def check(got, ref, args, tol=FP32_TOL):
    """Per-tensor errors; ``args`` rebuild the inputs, for gradients that are exactly zero (see helpers)."""
    q, k, v, dout = make_qkv(*args)
    errs = {name: rel_err(got[name], ref[name], zero_scale=cancelling_scale(name, q, k, v, dout)) for name in NAMES}
    assert max(errs.values()) <= tol, errs


def pat(branches):
    return {"segment_lengths": [w for w, _ in branches], "dilation_rates": [r for _, r in branches]}


BRANCHES = [
    pytest.param(((64, 1), (128, 2), (256, 4)), id="64-128-256"),
    pytest.param(((1000, 1),), id="dense-as-pattern"),
    pytest.param(((100, 3), (37, 1)), id="odd-segments"),
]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("branches", BRANCHES)
def test_uneven_length_matches_reference(pools, world, layout, branches):
    args = (31, 1, 4, 2, 1000, 8)
    got = run(pools, world, *args, layout=layout, pattern=pat(branches))
    check(got, reference(*args, branches), args)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("heads", [(8, 8), (6, 2), (8, 2), (4, 1)], ids=["mha", "gqa3", "gqa4", "mqa"])
def test_head_offsets_under_gqa(pools, world, heads):
    branches = ((16, 1), (32, 2), (48, 4), (96, 3))
    args = (5, 2, heads[0], heads[1], 97, 8)
    got = run(pools, world, *args, pattern=pat(branches))
    check(got, reference(*args, branches), args)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_non_causal(pools, world):
    branches = ((32, 1), (64, 4))
    args = (8, 1, 4, 4, 150, 8)
    got = run(pools, world, *args, causal=False, pattern=pat(branches))
    check(got, reference(*args, branches, causal=False), args)


def test_dense_branch_equals_dense_attention():
    args = (3, 1, 4, 2, 77, 8)
    for branches in (((77, 1),), ((500, 1),)):
        got = run(None, 1, *args, pattern=pat(branches))
        q, k, v, dout = make_qkv(*args)
        ref = dict(zip(NAMES, R.with_grads(R.dense_attention, q, k, v, dout)))
        check(got, ref, args)


def test_r1_dividing_segments_are_independent_blocks():
    args, w = (4, 1, 2, 2, 96, 8), 32
    got = run(None, 1, *args, pattern=pat(((w, 1),)))
    q, k, v, _ = make_qkv(*args)
    for s in range(0, 96, w):
        blk = R.dense_attention(q[:, :, s:s + w], k[:, :, s:s + w], v[:, :, s:s + w])
        assert rel_err(got["out"][:, :, s:s + w], blk) <= FP32_TOL


def test_full_length_dilation_is_strided_attention():
    n, r = 90, 3
    args = (6, 1, 6, 6, n, 8)
    got = run(None, 1, *args, pattern=pat(((n, r),)))
    q, k, v, _ = make_qkv(*args)
    for h in range(6):
        o = h % r
        sub = R.dense_attention(q[:, h:h + 1, o::r], k[:, h:h + 1, o::r], v[:, h:h + 1, o::r])
        assert rel_err(got["out"][:, h:h + 1, o::r], sub) <= FP32_TOL
        others = torch.ones(n, dtype=torch.bool)
        others[o::r] = False
        assert torch.all(got["out"][:, h, others] == 0), "rows no branch covers must be exactly 0"


def test_duplicate_and_reordered_branches_change_nothing():
    args = (12, 1, 4, 2, 120, 8)
    a = run(None, 1, *args, pattern=pat(((16, 1), (64, 2))))
    b = run(None, 1, *args, pattern=pat(((64, 2), (16, 1), (64, 2), (16, 1))))
    ref = reference(*args, ((16, 1), (64, 2)))
    check(a, ref, args)
    check(b, ref, args)


def test_causal_outputs_ignore_later_tokens(pools):
    n, cut = 80, 50
    branches = ((32, 1), (80, 4))
    q, k, v, _ = make_qkv(13, 1, 4, 4, n, 8)
    out = run(pools, 2, 13, 1, 4, 4, n, 8, pattern=pat(branches))["out"]
    k2, v2 = k.clone(), v.clone()
    k2[:, :, cut:] = torch.randn_like(k2[:, :, cut:]) * 5
    v2[:, :, cut:] = torch.randn_like(v2[:, :, cut:]) * 5
    out2 = hf_ring.ring_attention(q, k2, v2, pattern=DilatedPattern([32, 80], [1, 4]))
    assert rel_err(out2[:, :, :cut], out[:, :, :cut]) <= FP32_TOL


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 120), branches=st.lists(st.tuples(st.integers(1, 130), st.integers(1, 6)), min_size=1, max_size=4),
       heads=st.sampled_from([(4, 4), (4, 2), (6, 3), (2, 1)]), causal=st.booleans())
def test_random_patterns_single_process(n, branches, heads, causal):
    branches = tuple(branches)
    args = (n, 1, heads[0], heads[1], n, 8)
    got = run(None, 1, *args, causal=causal, pattern=pat(branches))
    check(got, reference(*args, branches, causal=causal), args)


def test_random_patterns_on_three_ranks(pools):
    import random

    rng = random.Random(0)
    for case in range(12):
        n = rng.randint(3, 150)
        branches = tuple((rng.randint(1, 160), rng.randint(1, 5)) for _ in range(rng.randint(1, 3)))
        layout = rng.choice(["zigzag", "contiguous"])
        args = (case, 1, 4, 2, n, 8)
        got = run(pools, 3, *args, layout=layout, pattern=pat(branches))
        check(got, reference(*args, branches), args)


def test_dilated_in_many_small_messages(pools):
    branches = ((64, 1), (128, 2), (256, 4))
    args = (33, 1, 4, 2, 300, 8)
    got = run(pools, 3, *args, pattern=pat(branches), message_rows=3)
    check(got, reference(*args, branches), args)


def padded_dilated(q, k, v, *, branches, pad):
    """The dilated reference with the first ``pad`` keys of sample 0 masked (left padding)."""
    n, hq = q.shape[2], q.shape[1]
    bias = torch.stack([torch.log(R.dilated_multiplicity(n, branches, h).double()) for h in range(hq)])
    outs = []
    for i in range(q.shape[0]):
        bi = bias.clone()
        if i == 0:
            bi[..., :pad] = float("-inf")
        outs.append(R.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], bias=bi))
    return torch.cat(outs)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("message_rows", [None, 7])
def test_rows_shared_by_branches_with_padding_and_small_messages(pools, world, message_rows):
    """Rates 2, 4 and 8 over segments that cross ranks: the shared rows travel once and are read as views."""
    n, pad = 203, 11
    branches = ((32, 1), (96, 2), (203, 4), (203, 8))
    args = (21, 2, 8, 4, n, 8)
    got = run(pools, world, *args, pattern=pat(branches), pad=pad, message_rows=message_rows)
    q, k, v, dout = make_qkv(*args)
    ref = dict(zip(NAMES, R.with_grads(padded_dilated, q, k, v, dout, branches=branches, pad=pad)))
    check(got, ref, args)


@pytest.mark.parametrize("world", [1, 3])
def test_a_segment_named_twice_is_weighted_twice_on_every_rank(pools, world):
    """Two identical dense branches: each rank's own blocks have the causal triangle's area, yet are not it."""
    branches = ((4, 1), (4, 1))
    args = (11, 1, 4, 2, 20, 8)
    got = run(pools, world, *args, layout="zigzag", pattern=pat(branches))
    check(got, reference(*args, branches), args)
