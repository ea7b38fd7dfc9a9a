"""The CUDA route of every block kind, on fake CUDA tensors: no GPU needed.

``FakeTensorMode`` runs the CUDA kernels' shape functions on this CPU-only
build. Each block kind the ring, dilated branches, packed documents and
decoding make is run through ``block_forward``/``block_backward`` under a
dispatch-mode spy, which must see the fused kernel the README's table names,
no math-path op, the kernels' run-time contracts met, K/V with their own head
count, and nothing as large as the block's scores. Forcing the route to the
math path must make the same check fail, so it can.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ring.engine import cuda_kernels

from hf_ring.engine import kernels
from hf_ring.engine.blocks import Progression, allowed_pairs, band_mask, band_of
from bench import routes

CASES = routes.block_cases()
FUSED_CASES = [c for c in CASES if c.expect != "math"]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_block_kind_runs_its_kernel(case):
    with routes.fake_cuda():
        got = routes.run(case)
        inp = got.inputs
        out, lse = got.result
        dq, dk, dv = got.grads
        assert out.shape == inp.q.shape and out.dtype == case.dtype and out.device.type == "cuda"
        assert lse.shape == inp.q.shape[:3] and lse.dtype == torch.float32
        assert dq.shape == inp.q.shape and dk.shape == inp.k.shape and dv.shape == inp.v.shape
    routes.check(case, got.fwd, got.bwd, got.limit)


@pytest.mark.parametrize("case", FUSED_CASES, ids=[c.name for c in FUSED_CASES])
def test_check_fails_when_the_route_is_forced_to_the_math_path(case, monkeypatch):
    monkeypatch.setattr(kernels, "KERNELS", tuple(kn for kn in kernels.KERNELS if kn.name == "math"))
    with routes.fake_cuda():
        got = routes.run(case)
    with pytest.raises(AssertionError, match="did not run"):
        routes.check(case, got.fwd, got.bwd)


def test_check_catches_a_whole_block_mask(monkeypatch):
    """A band materialised as one mask over a block larger than a tile is caught by the allocation bound."""
    case = next(c for c in CASES if "whole shard" in c.name)
    monkeypatch.setattr(kernels, "_needs_tiles", lambda *args: False)
    with routes.fake_cuda():
        got = routes.run(case)
    with pytest.raises(AssertionError, match="more than twice what it was handed"):
        routes.check(case, got.fwd, got.bwd, got.limit)


def test_check_catches_repeated_kv_and_a_broken_contract():
    """The spy's contract check is itself tested: a repeated K/V and a strided logsumexp are reported."""
    case = routes.block_cases()[0]
    with routes.fake_cuda():
        inp = routes.make_inputs(case)
        g = case.hq // case.hkv
        k = inp.k.unsqueeze(2).expand(-1, -1, g, -1, -1).reshape(inp.q.shape[0], case.hq, inp.k.shape[2], case.d)
        with routes.OpSpy() as spy:
            torch.ops.aten._flash_attention_forward(
                inp.q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), None, None, case.sq, case.sk, 0.0,
                True, False, scale=0.1)
            torch.ops.aten._flash_attention_backward(
                inp.dout.transpose(1, 2), inp.q.transpose(1, 2), inp.k.transpose(1, 2), inp.v.transpose(1, 2),
                inp.out.transpose(1, 2), inp.lse.transpose(1, 2), None, None, case.sq, case.sk, 0.0, True,
                torch.empty(2, dtype=torch.uint64, device="cuda"), torch.empty((), dtype=torch.uint64, device="cuda"),
                scale=0.1)
    problems = [p for c in spy.calls if c.op.startswith("_flash") for p in routes.contract_problems(c, case)]
    assert any("K/V reached the kernel with 32 heads" in p for p in problems), problems
    assert any("logsumexp not fp32, 3-D and contiguous" in p for p in problems), problems


def _flash_allows(i: int, j: int, nq: int, nk: int, left: int, right: int) -> bool:
    """Flash's window rule, aligned to the bottom-right corner; -1 is unbounded."""
    diag = i + nk - nq
    return (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)


@settings(max_examples=300, deadline=None)
@given(sq=st.integers(1, 12), sk=st.integers(1, 12), lo=st.one_of(st.none(), st.integers(-14, 14)),
       hi=st.integers(-14, 14))
def test_band_cut_is_the_band_in_flash_window_terms(sq, sk, lo, hi):
    """Pure index math: the rows, keys and window sizes handed to flash allow exactly the band's pairs."""
    want = {(i, j) for i in range(sq) for j in range(sk) if (lo is None or j - i >= lo) and j - i <= hi}
    cut = cuda_kernels.band_cut(sq, sk, lo, hi)
    if cut is None:
        assert not want
        return
    i0, nq, k0, nk, left, right = cut
    assert 0 <= i0 and i0 + nq <= sq and 0 <= k0 and k0 + nk <= sk and right >= 0 and (left >= 0 or lo is None)
    got = {(i0 + i, k0 + j) for i in range(nq) for j in range(nk) if _flash_allows(i, j, nq, nk, left, right)}
    assert got == want
    assert bool(band_mask(sq, sk, lo, hi).any()) == bool(want)


@settings(max_examples=300, deadline=None)
@given(stride=st.integers(1, 5), qpos=st.integers(0, 60), dk=st.integers(0, 40), nq=st.integers(1, 9),
       nk=st.integers(1, 9), window=st.one_of(st.none(), st.integers(1, 50)))
def test_band_of_is_the_mask_rule(stride, qpos, dk, nq, nk, window):
    """A causal block of progressions with one stride and residue: the band equals the mask rule on positions."""
    if window is not None:
        stride = 1  # windows never combine with dilation
    k_pos = qpos - dk * stride
    if k_pos < 0:
        return
    q = Progression(0, qpos, nq, stride)
    qp = torch.arange(qpos, qpos + nq * stride, stride)
    kp = torch.arange(k_pos, k_pos + nk * stride, stride)
    assert torch.equal(band_mask(nq, nk, *band_of(q, k_pos, True, window)), allowed_pairs(qp, kp, True, window))


needs_cuda_build = pytest.mark.skipif(not torch.backends.cuda.is_built(),
                                      reason="the ring's own indexing needs a CUDA build of torch under fake tensors")


@needs_cuda_build
@pytest.mark.parametrize("kw", [{}, {"window": 700}, {"pattern": {"segment_lengths": [512, 1024, 2048],
                                                                  "dilation_rates": [1, 2, 4]}}],
                         ids=["dense", "window", "dilated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_whole_ring_runs_fused_kernels(kw, dtype):
    """One process's ring, forward and backward, on fake CUDA tensors: every block a fused kernel, no math path."""
    import hf_ring.engine.ring as ring
    from hf_ring.engine.checks import check_options

    n, hq, hkv, d = 4096, 8, 2, 64
    with routes.fake_cuda():
        q, k, v, dout = (t.transpose(1, 2) for t in (torch.randn(1, n, h, d, dtype=dtype, device="cuda")
                                                      for h in (hq, hkv, hkv, hq)))
        spec = check_options(True, kw.get("window"), kw.get("pattern"), None, d, "contiguous").at(seq_len=n)
        geo = ring.Geometry(n, 1, "contiguous", True, spec.window, spec.branches, hq, hkv)
        call = ring.RingCall(None, ring.rank_plan(geo, 0, 1 << 30), spec, backward_tile=1024)
        with routes.OpSpy() as fwd:
            out, lse = ring.ring_forward(q, k, v, call)
        with routes.OpSpy() as bwd:
            dq, dk, dv = ring.ring_backward(dout, q, k, v, out, lse, call)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for spy, phase in ((fwd, 0), (bwd, 1)):
        ops = set(spy.ops())
        assert not ops & routes.MATH_OPS, ops & routes.MATH_OPS
        assert any(route[phase] in ops for route in routes.FUSED.values()), ops
