"""Bad input raises a clear error naming the argument; a failure on one rank never hangs the others."""
import os

import pytest
import torch
import torch.distributed as dist

import hf_ring
from dist_pool import RankPool


def qkv(b=1, hq=4, hkv=2, n=8, d=8, dtype=torch.float32):
    return torch.randn(b, hq, n, d, dtype=dtype), torch.randn(b, hkv, n, d, dtype=dtype), torch.randn(b, hkv, n, d, dtype=dtype)


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (lambda q, k, v: (q.numpy(), k, v), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: (q, k.double(), v), TypeError, "share one dtype"),
        (lambda q, k, v: (q, k, v[:, :1]), ValueError, "k and v must have the same shape"),
        (lambda q, k, v: (q[:, :, :, :4], k, v), ValueError, "head_dim"),
        (lambda q, k, v: (torch.cat([q, q]), k, v), ValueError, "batch size"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
        (lambda q, k, v: (q[:, :, :5], k, v), ValueError, "local rows"),
        (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, "floating-point"),
    ],
)
def test_bad_tensors(change, exc, match):
    with pytest.raises(exc, match=match):
        hf_ring.ring_attention(*change(*qkv()))


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"layout": "spiral"}, ValueError, "layout='spiral'"),
        ({"window": 0}, ValueError, "window must be >= 1"),
        ({"window": 2.5}, TypeError, "window must be a positive int"),
        ({"window": 4, "causal": False}, ValueError, "causal=True"),
        ({"seq_len": 9}, ValueError, "seq_len=9"),
        ({"seq_len": -1}, ValueError, "seq_len must be"),
        ({"group": object()}, ValueError, "torch.distributed is not initialised"),
    ],
)
def test_bad_options(kw, exc, match):
    with pytest.raises(exc, match=match):
        hf_ring.ring_attention(*qkv(), **kw)


def _wrong_seq_len():
    from cases import raises_on_rank

    rank = dist.get_rank()
    q, k, v = qkv(n=5 if rank == 0 else 4)
    return raises_on_rank(hf_ring.ring_attention, q, k, v, seq_len=10)


def _not_a_member():
    from cases import raises_on_rank

    group = dist.new_group([0])
    if dist.get_rank() == 0:
        return None
    return raises_on_rank(hf_ring.ring_attention, *qkv(), group=group)


def test_seq_len_inconsistent_across_ranks_raises_on_every_rank(pools):
    for res in pools(2).run(_wrong_seq_len):
        assert res is not None and res[0] == "ValueError"
        assert "seq_len=10" in res[1] and "[5, 4]" in res[1]


def test_group_without_this_rank(pools):
    res = pools(2).run(_not_a_member)
    assert res[0] is None
    assert res[1][0] == "ValueError" and "not a member" in res[1][1]


def _one_rank_fails():
    from cases import raises_on_rank

    os.environ["HF_RING_TIMEOUT"] = "3"
    if dist.get_rank() == 0:
        return raises_on_rank(hf_ring.ring_attention, *qkv(), window=0)
    return raises_on_rank(hf_ring.ring_attention, *qkv())


def test_failure_on_one_rank_does_not_hang_the_other():
    pool = RankPool(2)  # this case leaves the group unusable, so it gets a pool of its own
    try:
        bad, stranded = pool.run(_one_rank_fails)
    finally:
        pool.close()
    assert bad[0] == "ValueError"
    assert stranded[0] == "CommTimeoutError"
    assert "HF_RING_TIMEOUT" in stranded[1] and "other ranks" in stranded[1]
