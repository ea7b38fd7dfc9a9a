"""The CUDA route's code around the fused kernels, exact against the float64 reference on 1-3 gloo ranks.

Every block of the ring goes through ``hf_ring.engine.cuda_kernels`` (windows cut to
flash's bottom-right window sizes, query-head groups split into strided views
and stacked back, logsumexp rows padded for the efficient backward, rows with
no key), with the four fused aten ops replaced by float64 stand-ins that
compute what torch documents for them (``tests/cuda_emulation.py``). The
kernels themselves are measured by ``python -m bench gpu`` on a GPU.
"""
import pytest
import torch

from attention_cases import assemble, make_qkv, packed_case, packed_reference
from cuda_emulation import emulated, emulated_case
from helpers import cancelling_scale, rel_err

FP32_TOL = 1e-5
NAMES = ("out", "dq", "dk", "dv")
BRANCHES = ((8, 1), (16, 2), (32, 4))


def _documents(n):
    """Documents of 1, 5, 17, 9 and 30 rows (crossing shard borders) in batch row 0, one document in row 1."""
    row = [i for length in (1, 5, 17, 9, 30) for i in range(length)][:n]
    return torch.tensor([row, list(range(n))])


CONFIGS = {
    "causal": ({}, {}),
    "full": ({"causal": False}, {"causal": False}),
    "window7": ({"window": 7}, {"window": 7}),
    "window40": ({"window": 40}, {"window": 40}),
    "dilated": ({"pattern": {"segment_lengths": [8, 16, 32], "dilation_rates": [1, 2, 4]}},
                {"branches": BRANCHES}),
    "padding": ({"pad": 5}, {"pad": 5}),
    "documents": ({"documents": True}, {"documents": True}),
    "dilated documents": ({"documents": True, "pattern": {"segment_lengths": [8, 16, 32], "dilation_rates": [1, 2, 4]}},
                          {"documents": True, "branches": BRANCHES}),
}


def _run(pools, world, route, args, kw):
    kw = dict(kw)
    n = args[4]
    if kw.pop("documents", False):
        kw["position_ids"] = _documents(n)
    if world == 1:
        results = [emulated_case(route, packed_case, *args, message_rows=7, **kw)]
    else:
        results = pools(world).run(emulated_case, route, packed_case, *args, message_rows=7, **kw)
    return {name: assemble(results, name, n) for name in NAMES}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("route", ["flash", "efficient"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1)], ids=["gqa", "mqa"])
def test_cuda_route_matches_reference(pools, route, world, config, heads):
    ring_kw, ref_kw = CONFIGS[config]
    ref_kw = dict(ref_kw)
    args = (world * 10 + len(config), 2, heads[0], heads[1], 61, 16)
    got = _run(pools, world, route, args, ring_kw)
    position_ids = _documents(args[4]) if ref_kw.pop("documents", False) else None
    ref = packed_reference(args, position_ids, **ref_kw)
    q, k, v, dout = make_qkv(*args)
    errs = {name: rel_err(got[name], ref[name], zero_scale=cancelling_scale(name, q, k, v, dout)) for name in NAMES}
    assert max(errs.values()) <= FP32_TOL, errs


def test_emulation_is_what_runs():
    """The stand-ins are really called: a block routed to flash reaches the flash stand-in."""
    import cuda_emulation
    from hf_ring.engine import kernels

    calls = []
    saved = cuda_emulation.flash_forward

    def spy(*a, **kw):
        calls.append(kw)
        return saved(*a, **kw)

    cuda_emulation._Aten._flash_attention_forward = staticmethod(spy)
    try:
        with emulated("flash"):
            q = torch.randn(1, 4, 20, 16)
            kernels.block_forward(q, q[:, :2], q[:, :2], scale=0.25, band=(-3, 0))
    finally:
        cuda_emulation._Aten._flash_attention_forward = staticmethod(saved)
    assert calls and calls[0]["window_size_left"] == 3 and calls[0]["window_size_right"] == 0
