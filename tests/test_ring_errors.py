"""Bad input raises a clear error naming the argument; a failure on one rank never hangs the others."""
import os

import pytest
import torch
import torch.distributed as dist

import hf_ring


def qkv(b=1, hq=4, hkv=2, n=8, d=8, dtype=torch.float32):
    return torch.randn(b, hq, n, d, dtype=dtype), torch.randn(b, hkv, n, d, dtype=dtype), torch.randn(b, hkv, n, d, dtype=dtype)


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (lambda q, k, v: (q.numpy(), k, v), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: (q, k.double(), v), TypeError, "share one dtype"),
        (lambda q, k, v: (q, k, v[:, :1]), ValueError, "k and v must have the same batch, heads and rows"),
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
    from helpers import raises_on_rank

    rank = dist.get_rank()
    q, k, v = qkv(n=5 if rank == 0 else 4)
    return raises_on_rank(hf_ring.ring_attention, q, k, v, seq_len=10)


def _not_a_member():
    from helpers import raises_on_rank

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


BAD_ON_ONE_RANK = [
    pytest.param({"window": 0}, "ValueError", "window must be >= 1", id="window0"),
    pytest.param({"window": 2.5}, "TypeError", "window must be a positive int", id="window-float"),
    pytest.param({"window": 4, "causal": False}, "ValueError", "causal=True", id="window-noncausal"),
    pytest.param({"causal": "yes"}, "TypeError", "causal must be a bool", id="causal"),
    pytest.param({"layout": "spiral"}, "ValueError", "layout='spiral'", id="layout"),
    pytest.param({"scale": -1.0}, "ValueError", "scale must be a finite number > 0", id="scale"),
    pytest.param({"pattern": 5}, "TypeError", "pattern must be a hf_ring.DilatedPattern", id="pattern"),
    pytest.param({"key_mask": "bad shape"}, "ValueError", "key_mask must have shape", id="key_mask-shape"),
    pytest.param({"key_mask": "not bool"}, "TypeError", "key_mask must be torch.bool", id="key_mask-dtype"),
    pytest.param({"softcap": -1.0}, "ValueError", "softcap must be a finite float > 0", id="softcap"),
    pytest.param({"sinks": "bad shape"}, "ValueError", "sinks must have shape", id="sinks"),
    pytest.param({"position_ids": "float"}, "TypeError", "position_ids must be an integer tensor", id="position_ids"),
    pytest.param({"position_ids": "ok", "documents": ((0,),)}, "ValueError", "either position_ids", id="both"),
    pytest.param({"message_rows": 0}, "ValueError", "message_rows must be a positive int", id="message_rows"),
    pytest.param({"seq_len": -1}, "ValueError", "seq_len must be", id="seq_len"),
    pytest.param({"q": "numpy"}, "TypeError", "q must be a torch.Tensor", id="q-not-tensor"),
    pytest.param({"q": "3-D"}, "ValueError", "q must be 4-D", id="q-3d"),
    pytest.param({"k": "double"}, "TypeError", "share one dtype", id="mixed-dtype"),
]


def _bad_argument_on_last_rank(bad):
    """ring_attention where only the last rank passes ``bad``; what each rank raised and how long it took."""
    import time

    from helpers import raises_on_rank

    os.environ["HF_RING_TIMEOUT"] = "60"
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 8 * world
    q, k, v = qkv(n=8)
    kw = {"seq_len": n}
    if rank == world - 1:
        kw.update(bad)
        made = {"bad shape": lambda name: torch.ones(3, dtype=torch.bool) if name == "key_mask" else torch.zeros(3),
                "not bool": lambda name: torch.ones(1, 8), "float": lambda name: torch.zeros(1, 8),
                "ok": lambda name: torch.arange(8)[None]}
        for name in ("key_mask", "sinks", "position_ids"):
            if isinstance(kw.get(name), str):
                kw[name] = made[kw[name]](name)
        if kw.pop("q", None) == "numpy":
            q = q.numpy()
        elif bad.get("q") == "3-D":
            q = q[0]
        if kw.pop("k", None) == "double":
            k = k.double()
    t0 = time.perf_counter()
    got = raises_on_rank(hf_ring.ring_attention, q, k, v, **kw)
    return got, time.perf_counter() - t0


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bad,exc,match", BAD_ON_ONE_RANK)
def test_bad_argument_on_one_rank_fails_every_rank_at_once(pools, world, bad, exc, match):
    """The local checks' outcome rides in the agreement: every rank raises the failing rank's error, no waiting."""
    results = pools(world).run(_bad_argument_on_last_rank, bad)
    for got, seconds in results:
        assert got is not None and got[0] == exc, got
        assert got[1].startswith(f"rank {world - 1}: ") and match in got[1], got[1]
        assert seconds < 10, seconds  # far below HF_RING_TIMEOUT: nobody waited for the failing rank


def _bad_model_argument_on_last_rank(path):
    from helpers import raises_on_rank
    from models import batch, load

    os.environ["HF_RING_TIMEOUT"] = "60"
    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated").train()
        if dist.get_rank() == dist.get_world_size() - 1:
            model.config.attention_dropout = 0.1
            for layer in model.model.layers:
                layer.self_attn.attention_dropout = 0.1
        return raises_on_rank(model, **hf_ring.shard_batch(batch(0, 1, 24)))
    finally:
        hf_ring.clear_sequence_parallel()


@pytest.mark.parametrize("world", [2, 3])
def test_bad_layer_argument_on_one_rank_fails_every_rank(pools, world):
    """The attention backend's own checks fold into the forward's agreement the same way."""
    from models import saved_model_dir

    results = pools(world).run(_bad_model_argument_on_last_rank, saved_model_dir("llama"))
    for got in results:
        assert got is not None and got[0] == "ValueError", got
        assert got[1].startswith(f"rank {world - 1}: ") and "attention dropout" in got[1], got[1]
