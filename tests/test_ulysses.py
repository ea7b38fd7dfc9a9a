"""Head parallelism (Ulysses) and the hybrid with the ring (USP) against the float64 reference, on 2-4 gloo ranks."""
import math

import pytest
import torch

import hf_ring
import reference as R
from attention_cases import assemble, head_parallel_case, make_qkv
from generation_cases import head_parallel_generate_case
from helpers import cancelling_scale, rel_err
from models import load, saved_model_dir
from hf_ring.engine.layout import head_split, local_positions, owner, shard_sizes
from hf_ring.engine.pattern import DilatedPattern
from hf_ring.engine.ulysses import MAX_CHUNKS, chunks

FP32_TOL = 1e-5
NAMES = ("out", "dq", "dk", "dv")

# (sp ranks, ulysses_size): head parallelism alone, and inside the ring
MODES = [pytest.param(2, 2, id="ulysses2"), pytest.param(3, 3, id="ulysses3"), pytest.param(4, 4, id="ulysses4"),
         pytest.param(4, 2, id="hybrid2x2")]


def run_modes(pools, world, ulysses, seed, b, hq, hkv, n, d, **kw):
    results = pools(world).run(head_parallel_case, seed, b, hq, hkv, n, d, ulysses=ulysses, **kw)
    got = {name: assemble(results, name, n) for name in NAMES}
    if "dsinks" in results[0]:
        got["dsinks"] = results[0]["dsinks"]
    return got


def check(got, ref, q, k, v, dout):
    errs = {name: rel_err(got[name], ref[name], zero_scale=cancelling_scale(name, q, k, v, dout)) for name in ref}
    assert max(errs.values()) <= FP32_TOL, errs
    return errs


def reference(seed, b, hq, hkv, n, d, *, causal=True, window=None, branches=None, pad=0, position_ids=None,
              softcap=None, sinks=None):
    q, k, v, dout = make_qkv(seed, b, hq, hkv, n, d)
    if position_ids is not None:
        bias = R.packed_bias(position_ids, hq, causal=causal, window=window, branches=branches)
    elif branches is not None:
        bias = torch.stack([torch.log(R.dilated_multiplicity(n, branches, h, causal).double()) for h in range(hq)])[None]
    else:
        bias = torch.zeros(n, n, dtype=torch.float64).masked_fill(~R.dense_mask(n, causal, window), -math.inf)[None, None]
    if pad:
        bias = bias.expand(b, hq, n, n).clone()
        bias[0, :, :, :pad] = -math.inf
    fn = lambda q, k, v, **kw: R.attention(q, k, v, bias=bias, softcap=softcap, **kw)  # noqa: E731
    if sinks is None:
        ref = dict(zip(NAMES, R.with_grads(fn, q, k, v, dout)))
    else:
        ref = dict(zip(NAMES + ("dsinks",), R.with_grads_sinks(fn, q, k, v, sinks, dout)))
    return ref, (q, k, v, dout)


@pytest.mark.parametrize("world,ulysses", MODES)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("n", [37, 64])
def test_causal_matches_reference(pools, world, ulysses, heads, n):
    if heads[0] % ulysses:
        heads = (12, heads[1] if 12 % heads[1] == 0 and (heads[1] % ulysses == 0 or ulysses % heads[1] == 0) else 3)
    args = (world * 1000 + n + heads[1], 2, heads[0], heads[1], n, 8)
    got = run_modes(pools, world, ulysses, *args)
    ref, qkv = reference(*args)
    check(got, ref, *qkv)


@pytest.mark.parametrize("world,ulysses", MODES)
@pytest.mark.parametrize("case", [
    pytest.param(dict(causal=False), id="full"),
    pytest.param(dict(window=7), id="window7"),
    pytest.param(dict(window=40), id="window40"),
    pytest.param(dict(pattern=DilatedPattern([8, 16, 32], [1, 2, 3])), id="dilated"),
    pytest.param(dict(pad=5), id="padding"),
    pytest.param(dict(softcap=2.0), id="softcap"),
    pytest.param(dict(sinks=True), id="sinks"),
    pytest.param(dict(documents=(0, 9, 30)), id="documents"),
    pytest.param(dict(documents=(0, 20, 33), pattern=DilatedPattern([6, 12], [2, 3])), id="dilated-documents"),
])
def test_every_feature_matches_reference(pools, world, ulysses, case):
    """Dilation rates include 3, which no member's first head index is a multiple of: a member that counted
    dilation offsets from its own head 0 instead of the global index would attend the wrong rows."""
    case = dict(case)
    hq, hkv = (12, 6) if ulysses == 3 else (8, 4)
    n = 50
    args = (world * 77 + len(case), 2, hq, hkv, n, 8)
    kw, ref_kw = {}, {}
    for key in ("causal", "window", "pad", "softcap"):
        if key in case:
            kw[key] = ref_kw[key] = case[key]
    if "pattern" in case:
        kw["pattern"] = case["pattern"]
        ref_kw["branches"] = case["pattern"].branches
    if case.get("sinks"):
        kw["sinks"] = ref_kw["sinks"] = torch.randn(hq, generator=torch.Generator().manual_seed(3))
    if "documents" in case:
        starts = list(case["documents"]) + [n]
        ids = torch.cat([torch.arange(starts[i + 1] - starts[i]) for i in range(len(starts) - 1)])
        kw["position_ids"] = ref_kw["position_ids"] = ids[None].expand(2, n)
    got = run_modes(pools, world, ulysses, *args, **kw)
    ref, qkv = reference(*args, **ref_kw)
    check(got, ref, *qkv)


@pytest.mark.parametrize("world,ulysses,n", [(4, 2, 3), (4, 4, 2), (2, 2, 1), (3, 3, 5)])
def test_ranks_with_few_or_no_rows(pools, world, ulysses, n):
    args = (5, 1, 4 if ulysses != 3 else 6, 2 if ulysses != 3 else 3, n, 8)
    got = run_modes(pools, world, ulysses, *args)
    ref, qkv = reference(*args)
    check(got, ref, *qkv)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_hybrid_layouts_and_dilation_across_groups(pools, layout):
    pattern = DilatedPattern([16, 64], [3, 4])  # members' first heads 0 and 4 have different offsets mod 3
    args = (21, 1, 8, 2, 101, 8)
    got = run_modes(pools, 4, 2, *args, layout=layout, pattern=pattern)
    ref, qkv = reference(*args, branches=pattern.branches)
    check(got, ref, *qkv)


# Pure index math: no processes.

@pytest.mark.parametrize("world,ulysses", [(2, 2), (4, 2), (4, 4), (6, 3), (6, 2), (8, 2)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [0, 1, 5, 17, 64, 99])
def test_group_rows_are_the_ring_shard_of_the_group(world, ulysses, layout, n):
    pos = [local_positions(n, r, world, layout, ulysses).tolist() for r in range(world)]
    assert sorted(p for rows in pos for p in rows) == list(range(n))
    for g in range(world // ulysses):
        joined = sum(pos[g * ulysses:(g + 1) * ulysses], [])
        assert joined == local_positions(n, g, world // ulysses, layout).tolist()
        sizes = [len(p) for p in pos[g * ulysses:(g + 1) * ulysses]]
        assert max(sizes) - min(sizes) <= 1  # members of a group hold near-equal pieces
    for r, rows in enumerate(pos):
        assert all(owner(p, n, world, layout, ulysses) == r for p in rows)
    assert shard_sizes(n, world, layout, ulysses) == [len(p) for p in pos]


@pytest.mark.parametrize("hq,hkv,u", [(8, 8, 2), (8, 4, 4), (8, 2, 4), (8, 1, 4), (12, 4, 2), (6, 3, 3), (32, 8, 8)])
def test_head_split_gives_each_rank_the_kv_heads_of_its_query_heads(hq, hkv, u):
    split = head_split(hq, hkv, u)
    g = hq // hkv
    kv_per_rank = max(1, hkv // u)
    for m in range(u):
        qs, kvs = split.q_heads(m), split.kv_heads(m)
        assert len(qs) == hq // u and len(kvs) == kv_per_rank
        local_g = len(qs) // len(kvs)
        for i, h in enumerate(qs):  # local GQA grouping reproduces the global one
            assert kvs[i // local_g] == h // g
    index = split.kv_index()
    assert (index is None) == (hkv >= u)
    if index is not None:  # K/V repeated only as far as the group needs: one head per rank
        assert index.numel() == u


@pytest.mark.parametrize("hq,hkv,u", [(8, 8, 2), (8, 4, 2), (8, 2, 4), (8, 1, 4), (12, 4, 2), (6, 3, 3), (32, 8, 2),
                                      (24, 24, 2)])
def test_chunks_cut_each_members_heads_into_whole_kv_heads(hq, hkv, u):
    split = head_split(hq, hkv, u)
    parts = chunks(split)
    g = hq // hkv
    assert 1 <= len(parts) <= MAX_CHUNKS
    for m in range(u):
        q_heads = [h for c in parts for h in c.q[m]]
        kv_heads = [h for c in parts for h in c.kv[m]]
        assert q_heads == list(split.q_heads(m))  # every query head once, in order
        if hkv >= u:
            assert kv_heads == list(split.kv_heads(m))
        for c in parts:  # a chunk's query heads read only its own K/V heads
            assert {h // g for h in c.q[m]} == set(c.kv[m])
            assert len(c.q[m]) == len(parts[0].q[0]) and len(c.kv[m]) == len(parts[0].kv[0])
    if hkv >= u and (hkv // u) % 2 == 0:
        assert len(parts) > 1  # heads that can be cut are, so exchanges overlap attention


@pytest.mark.parametrize("hq,hkv,u,match", [
    (6, 6, 4, "does not divide the model's 6 query heads"),
    (12, 3, 2, "neither divide the other"),
    (12, 4, 3, "neither divide the other"),
])
def test_head_split_refuses_uneven_splits(hq, hkv, u, match):
    with pytest.raises(ValueError, match=match):
        head_split(hq, hkv, u)


# Model level: generation's prefill in every mode.

@pytest.mark.parametrize("world,ulysses", MODES[:1] + MODES[2:])
@pytest.mark.parametrize("kind", ["llama", "mistral", "dilated"])
def test_generate_prefills_in_every_mode(pools, world, ulysses, kind):
    """Greedy tokens equal one process's, with left padding in the batch and Mistral's window smaller than the
    prompt; step logits equal the ring's; the decode cache stays sharded by row.

    Dense models are measured against transformers' sdpa; the dilated pattern against one-process
    ``ring_dilated``, itself checked against sdpa with the ``log m`` mask in test_generation."""
    path = saved_model_dir("mistral", sliding_window=8) if kind == "mistral" else saved_model_dir("llama")
    pattern = DilatedPattern([8, 16, 64], [1, 3, 4]) if kind == "dilated" else None
    g = torch.Generator().manual_seed(world + ulysses)
    n, new = 41, 12
    ids = torch.randint(3, 97, (2, n), generator=g)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[0, :5], ids[0, :5] = 0, 0
    kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
    if pattern is None:
        ref = load(path, "sdpa").generate(ids, attention_mask=mask, **kw)
    else:
        model = load(path, "ring_dilated")
        hf_ring.configure(model, pattern=pattern)
        ref = hf_ring.generate(model, ids, attention_mask=mask, **kw)
    assert len(set(ref[-1, n:].tolist())) > 2
    results = pools(world).run(head_parallel_generate_case, path, ids, mask, ulysses=ulysses, pattern=pattern, **kw)
    ring = pools(world).run(head_parallel_generate_case, path, ids, mask, ulysses=1, pattern=pattern, **kw)
    for res, base in zip(results, ring):
        assert torch.equal(res["sequences"], ref), (res["sequences"][:, n:], ref[:, n:])
        assert rel_err(res["logits"], base["logits"]) <= 1e-6
        assert res["rows"] <= -(-(n + new) // world) + 1


# Refusals: the same clear error on every rank, before any exchange that could hang.

def test_setup_refuses_a_size_that_does_not_divide_the_group(pools):
    from helpers import raises_on_rank

    for err in pools(2).run(raises_on_rank, hf_ring.setup_sequence_parallel, None, ulysses_size=3):
        assert err[0] == "ValueError" and "ulysses_size=3 does not divide the 2" in err[1]
    for bad in (0, True, 1.0):
        with pytest.raises(ValueError, match="ulysses_size must be a positive int"):
            hf_ring.setup_sequence_parallel(None, ulysses_size=bad)
    with pytest.raises(ValueError, match="needs several processes"):
        hf_ring.setup_sequence_parallel(None, ulysses_size=2)


@pytest.mark.parametrize("heads,match", [((3, 1), "does not divide the model's 3 query heads"),
                                         ((4, 2), None)])
def test_heads_the_size_cannot_split_are_refused_on_every_rank(pools, heads, match):
    from model_cases import head_parallel_refusal_case

    path = saved_model_dir("llama", hidden_size=16 * heads[0], num_attention_heads=heads[0],
                           num_key_value_heads=heads[1])
    for err in pools(2).run(head_parallel_refusal_case, path, 2):
        if match is None:
            assert err is None
        else:
            assert err[0] == "ValueError" and match in err[1] and "Choose a ulysses_size" in err[1]


def test_config_and_setup_must_name_the_same_size(pools):
    from model_cases import head_parallel_refusal_case

    for err in pools(2).run(head_parallel_refusal_case, saved_model_dir("llama"), 1, config_ulysses=2):
        assert err[0] == "ValueError" and "config.ring_dilated has ulysses_size=2 but the sequence-parallel setup has ulysses_size=1" in err[1]


def test_configure_stores_the_size_and_checks_the_heads():
    model = load(saved_model_dir("llama"), "ring_dilated")  # 4 query heads, 2 K/V heads
    hf_ring.configure(model, ulysses_size=4)
    assert model.config.ring_dilated["ulysses_size"] == 4
    with pytest.raises(ValueError, match="does not divide the model's 4 query heads"):
        hf_ring.configure(model, ulysses_size=3)
    with pytest.raises(ValueError, match="ulysses_size must be a positive int"):
        hf_ring.configure(model, ulysses_size=0)
    with pytest.raises(ValueError, match="ulysses_size must be a positive int"):
        hf_ring.integration.config.parse({"ulysses_size": "2"})


@pytest.mark.parametrize("world,ulysses,heads", [(2, 2, (8, 8)), (4, 4, (8, 2)), (4, 2, (8, 2)), (4, 4, (8, 1))])
def test_bytes_on_the_wire_are_the_planned_ones(pools, world, ulysses, heads):
    """The traffic table of the README (``bench ring --wire``) is planned, not measured: it must be what runs."""
    from attention_cases import counted_head_parallel_case
    from bench.common import planned_mode_mb

    n, d = 203, 8
    sent = pools(world).run(counted_head_parallel_case, 1, 1, heads[0], heads[1], n, d, ulysses=ulysses)
    planned = planned_mode_mb(n, world, ulysses, "zigzag", heads[0], heads[1], 1, d)
    assert max(sent) / 2**20 == pytest.approx(planned, rel=1e-12), (sent, planned)


@pytest.mark.parametrize("world,ulysses", MODES)
@pytest.mark.parametrize("dv", [4, 12], ids=["values-narrower", "values-wider"])
def test_values_of_another_head_size_than_the_keys(pools, world, ulysses, dv):
    """Head parallelism and USP with values of another head size than the queries and keys (multi-head latent
    attention): each tensor travels the all-to-alls at its own size."""
    hq, hkv = (12, 6) if ulysses == 3 else (8, 4)
    args = (world * 31 + dv, 2, hq, hkv, 41, 8)
    results = pools(world).run(head_parallel_case, *args, ulysses=ulysses, dv=dv)
    got = {name: assemble(results, name, 41) for name in NAMES}
    q, k, v, dout = make_qkv(*args, dv=dv)
    ref = dict(zip(NAMES, R.with_grads(R.dense_attention, q, k, v, dout)))
    assert got["out"].shape[-1] == got["dv"].shape[-1] == dv
    check(got, ref, q, k, v, dout)
