"""Exact ring attention against the float64 reference, on 1-4 gloo ranks."""
import pytest
import torch

import reference as R
from attention_cases import key_mask_of, assemble, make_qkv, ring_case
from helpers import cancelling_scale, rel_err

FP32_TOL = 1e-5
BF16_TOL = 2e-2

MODES = [
    pytest.param({"causal": True}, id="causal"),
    pytest.param({"causal": False}, id="full"),
    pytest.param({"causal": True, "window": 7}, id="window7"),
]


def run_ring(pools, world, seed, b, hq, hkv, n, d, **kw):
    if world == 1:
        results = [ring_case(seed, b, hq, hkv, n, d, **kw)]
    else:
        results = pools(world).run(ring_case, seed, b, hq, hkv, n, d, **kw)
    return {name: assemble(results, name, n) for name in ("out", "dq", "dk", "dv")}


def check_against_reference(got, seed, b, hq, hkv, n, d, tol, dtype=torch.float32, causal=True, window=None, **_):
    q, k, v, dout = make_qkv(seed, b, hq, hkv, n, d, dtype)
    ref = dict(zip(("out", "dq", "dk", "dv"),
                   R.with_grads(R.dense_attention, q, k, v, dout, causal=causal, window=window)))
    errs = {name: rel_err(got[name], ref[name], zero_scale=cancelling_scale(name, q, k, v, dout)) for name in ref}
    assert max(errs.values()) <= tol, errs
    return errs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [37, 101])
def test_matches_reference_fp32(pools, world, layout, mode, n):
    args = (world * 100 + n, 2, 4, 2, n, 16)
    got = run_ring(pools, world, *args, layout=layout, **mode)
    check_against_reference(got, *args, FP32_TOL, **mode)


@pytest.mark.parametrize("heads", [(4, 1), (2, 2), (6, 3)], ids=["mqa", "mha", "gqa6x3"])
@pytest.mark.parametrize("world", [2, 3])
def test_head_layouts(pools, world, heads):
    args = (7, 1, heads[0], heads[1], 53, 8)
    got = run_ring(pools, world, *args, causal=True)
    check_against_reference(got, *args, FP32_TOL)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_bf16(pools, world, mode):
    args = (11, 1, 4, 2, 64, 16)
    got = run_ring(pools, world, *args, dtype=torch.bfloat16, **mode)
    assert got["out"].dtype == torch.bfloat16 and got["dk"].dtype == torch.bfloat16
    check_against_reference(got, *args, BF16_TOL, dtype=torch.bfloat16, **mode)


@pytest.mark.parametrize("world,n", [(3, 2), (4, 3), (4, 5), (2, 1)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ranks_with_few_or_no_rows(pools, world, n, layout):
    args = (3, 1, 2, 1, n, 8)
    got = run_ring(pools, world, *args, layout=layout)
    check_against_reference(got, *args, FP32_TOL)


@pytest.mark.parametrize("window", [1, 2, 40, 500])
def test_windows_across_shards(pools, window):
    args = (5, 1, 2, 2, 301, 8)
    got = run_ring(pools, 3, *args, window=window)
    check_against_reference(got, *args, FP32_TOL, window=window)


def test_explicit_seq_len_and_scale(pools):
    args = (9, 1, 2, 2, 40, 8)
    got = run_ring(pools, 2, *args, seq_len=40, scale=0.3)
    q, k, v, dout = make_qkv(*args)
    ref = R.with_grads(R.dense_attention, q, k, v, dout, scale=0.3)
    for name, r in zip(("out", "dq", "dk", "dv"), ref):
        assert rel_err(got[name], r) <= FP32_TOL


def future_changed_case(seed, n, changed):
    """This rank's positions and ring output when the last ``changed`` tokens' K/V are replaced."""
    import torch.distributed as dist

    import hf_ring

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v = future_changed_qkv(seed, n, changed)
    pos = hf_ring.local_positions(n, rank, world, "zigzag")
    return {"pos": pos, "out": hf_ring.ring_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos])}


def future_changed_qkv(seed, n, changed):
    q, k, v, _ = make_qkv(seed, 1, 2, 2, n, 8)
    k, v = k.clone(), v.clone()
    k[:, :, -changed:] += 10.0
    v[:, :, -changed:] -= 3.0
    return q, k, v


def test_causal_output_ignores_future_tokens(pools):
    """The ring run on K/V whose last tokens changed gives every earlier row of the unchanged input."""
    n, changed = 30, 5
    q, k, v, _ = make_qkv(21, 1, 2, 2, n, 8)
    ref = R.dense_attention(q, k, v)
    ref_changed = R.dense_attention(*future_changed_qkv(21, n, changed))
    assert rel_err(ref_changed[:, :, -changed:], ref[:, :, -changed:]) > 1e-2  # the change matters to those rows
    got = assemble(pools(3).run(future_changed_case, 21, n, changed), "out", n)
    assert rel_err(got, ref_changed) <= FP32_TOL
    assert rel_err(got[:, :, :-changed], ref[:, :, :-changed]) <= FP32_TOL


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pad", [0, 9])
def test_a_forward_that_keeps_its_kv_is_exact_and_spares_the_backward_an_exchange(pools, world, mode, pad):
    """Short sequences' forwards keep the K/V rows they receive (ring.KEEP_BYTES); forced on and off here."""
    args = (world * 7 + pad, 2, 4, 2, 101, 16)
    made = {}
    for keep in (True, False):
        results = pools(world).run(ring_case, *args, keep=keep, pad=pad, **mode)
        got = {name: assemble(results, name, args[4]) for name in ("out", "dq", "dk", "dv")}
        if pad:
            q, k, v, dout = make_qkv(*args)
            ref = R.with_grads(padded_dense, q, k, v, dout, key_mask=key_mask_of(2, 101, pad), **mode)
            errs = {n: rel_err(got[n], r) for n, r in zip(("out", "dq", "dk", "dv"), ref)}
            assert max(errs.values()) <= FP32_TOL, errs
        else:
            check_against_reference(got, *args, FP32_TOL, **mode)
        made[keep] = [r["exchanges"] for r in results]
    # each rank's K/V exchanges of the backward are the forward's again, or none
    assert all(kept < sent for kept, sent in zip(made[True], made[False])), made


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_shards_in_many_small_messages(pools, world, mode):
    args = (17, 1, 4, 2, 101, 8)
    got = run_ring(pools, world, *args, message_rows=5, **mode)
    check_against_reference(got, *args, FP32_TOL, **mode)


def padded_dense(q, k, v, *, causal=True, window=None, key_mask=None):
    """Dense attention with the keys ``key_mask`` marks False left out, sample by sample."""
    n = q.shape[2]
    bias = torch.zeros(n, n, dtype=torch.float64).masked_fill(~R.dense_mask(n, causal, window), float("-inf"))
    outs = []
    for i in range(q.shape[0]):
        bi = bias.clone()
        bi[:, ~key_mask[i]] = float("-inf")
        outs.append(R.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], bias=bi[None]))
    return torch.cat(outs)


def _padded_run(pools, world, n, pad, side, tile, mode, b=2):
    args = (4, b, 4, 2, n, 8)
    kw = dict(mode, pad=pad, pad_side=side, padded_tile=tile)
    results = [ring_case(*args, **kw)] if world == 1 else pools(world).run(ring_case, *args, **kw)
    got = {name: assemble(results, name, n) for name in ("out", "dq", "dk", "dv")}
    q, k, v, dout = make_qkv(*args)
    ref = dict(zip(("out", "dq", "dk", "dv"),
                   R.with_grads(padded_dense, q, k, v, dout, key_mask=key_mask_of(b, n, pad, side), **mode)))
    # A query row with no valid key (sample 0's first rows under left padding) attends to nothing: both give 0.
    errs = {name: rel_err(got[name], ref[name]) for name in ref}
    assert max(errs.values()) <= FP32_TOL, errs
    return results


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_padded_keys_in_small_tiles(pools, world, mode):
    """Three rows padded to different lengths: keys valid in some rows only go in tiles, masked where needed."""
    tile = 16
    results = _padded_run(pools, world, 101, 13, "staggered", tile, mode, b=3)
    assert 0 < max(r["max_mask"] for r in results) <= tile  # masks stay tile-sized, not shard-sized


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("side", ["right", "mixed", "all", "staggered"])
@pytest.mark.parametrize("mode", [{"causal": True}, {"causal": False}, {"causal": True, "window": 23}])
def test_padding_anywhere_is_exact(pools, world, side, mode):
    _padded_run(pools, world, 97, 29, side, 8, mode, b=3 if side == "staggered" else 2)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("side", ["none", "left", "right", "mixed", "all"])
def test_rows_padded_at_their_ends_need_no_mask(pools, world, side):
    """Keys are cut where their validity over the batch changes, so keys valid in every row run unmasked and
    whole, keys padded in every row are skipped, and where the rows differ each row runs unmasked or not at all:
    padding at a row's start or end never builds a mask."""
    for r in _padded_run(pools, world, 128, 43, side, 8, {"causal": True}):
        assert r["masked_calls"] == 0


@pytest.mark.parametrize("kw", [{"causal": True}, {"causal": False}, {"causal": True, "window": 700}])
def test_math_path_tiles_blocks_larger_than_its_tile(kw):
    """float64 runs the exact math path, which materialises scores: a 1500-row block runs in tiles, exactly.

    The LSE is kept in fp32 whatever the input, which bounds float64 results at ~1e-7 relative.
    """
    import reference as R
    from attention_cases import make_qkv
    import hf_ring
    from hf_ring.engine import kernels

    assert 1500 > kernels.MATH_TILE
    q, k, v, dout = make_qkv(3, 1, 2, 1, 1500, 8, torch.float64)
    ql, kl, vl = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = hf_ring.ring_attention(ql, kl, vl, **kw)
    out.backward(dout)
    ref = R.with_grads(R.dense_attention, q, k, v, dout, causal=kw["causal"], window=kw.get("window"))
    for got, want in zip((out.detach(), ql.grad, kl.grad, vl.grad), ref):
        assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("tile", [7, 16, 101])
def test_own_step_backward_in_tiles(tile):
    """A rank's own causal step runs its backward in tiles whose gradients add up to the whole triangle's, exactly."""
    import dataclasses

    from hf_ring.engine import ring
    from hf_ring.engine.checks import check_options
    from hf_ring.engine.kernels import block_forward

    n, hq, hkv, d = 101, 4, 2, 8
    q, k, v, dout = make_qkv(5, 2, hq, hkv, n, d)
    spec = check_options(True, None, None, None, d, "contiguous").at(seq_len=n)
    call = dataclasses.replace(ring.plan(hq, hkv, None, spec), backward_tile=tile)
    out, lse = block_forward(q, k, v, scale=spec.scale, causal=True, mask=None, softcap=None)
    got = ring._own_backward(call, dout, q, k, v, out, lse, torch.float32)
    ref = R.with_grads(R.dense_attention, q, k, v, dout, causal=True)
    for name, g, want in zip(("dq", "dk", "dv"), got, ref[1:]):
        assert rel_err(g, want, zero_scale=cancelling_scale(name, q, k, v, dout)) <= FP32_TOL, name


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dv", [8, 24], ids=["values-narrower", "values-wider"])
@pytest.mark.parametrize("mode", MODES + [pytest.param({"causal": True, "message_rows": 5}, id="small-messages"),
                                          pytest.param({"causal": True, "pad": 9}, id="padded")])
def test_values_of_another_head_size_than_the_keys(pools, world, dv, mode):
    """Multi-head latent attention's values are narrower than its queries and keys (DeepSeek V3: 128 against 192);
    the ring carries them at their own size and the kernels run them widened with zero columns: output and every
    gradient against the float64 reference, with V's own head size."""
    mode = dict(mode)
    pad = mode.pop("pad", 0)
    args = (23 + world + dv, 2, 4, 2, 45, 16)
    results = ([ring_case(*args, dv=dv, pad=pad, **mode)] if world == 1 else
               pools(world).run(ring_case, *args, dv=dv, pad=pad, **mode))
    got = {name: assemble(results, name, 45) for name in ("out", "dq", "dk", "dv")}
    q, k, v, dout = make_qkv(*args, dv=dv)
    assert v.shape[-1] == dv and got["out"].shape[-1] == dv and got["dv"].shape[-1] == dv
    key_mask = key_mask_of(2, 45, pad) if pad else torch.ones(2, 45, dtype=torch.bool)
    fn = lambda q, k, v: padded_dense(q, k, v, causal=mode["causal"], window=mode.get("window"),  # noqa: E731
                                      key_mask=key_mask)
    ref = dict(zip(("out", "dq", "dk", "dv"), R.with_grads(fn, q, k, v, dout)))
    errs = {name: rel_err(got[name], ref[name], zero_scale=cancelling_scale(name, q, k, v, dout)) for name in ref}
    assert max(errs.values()) <= FP32_TOL, errs
