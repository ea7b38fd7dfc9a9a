"""Decoding over a cache (hf_ring.engine.decode) and cache placement (hf_ring.generation.cache), in one process.

Every output is compared with the float64 reference of the *full* forward:
decoding token t must reproduce row t of it, whichever ranks hold the keys.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ring.generation.cache import ShardedCache
from hf_ring.generation.slots import place_tokens
from hf_ring.engine.decode import DENSE, cached_attention, cached_blocks, merge_partials
from hf_ring.engine.layout import shard_sizes
from helpers import rel_err
from reference import attention, dense_mask, dilated_attention, dilated_multiplicity

TOL = 1e-5
BRANCHES = ((8, 1), (16, 2), (32, 4))


def qkv(seed, b=2, hq=4, hkv=2, n=80, d=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g),
            torch.randn(b, hkv, n, d, generator=g))


def decode(q, k, v, q_pos, k_pos, key_mask=None, owners=None, world=1, **kw):
    """Attention of the queries at ``q_pos`` over the keys at ``k_pos``, split over ``world`` simulated ranks."""
    outs, lses = [], []
    for r in range(world):
        mine = torch.tensor([i for i in range(len(k_pos)) if owners is None or owners[i] == r], dtype=torch.long)
        blocks = cached_blocks(q_pos, k_pos[mine], hq=q.shape[1], hkv=k.shape[1], **kw)
        o, lse = cached_attention(q[:, :, q_pos], k[:, :, k_pos[mine]], v[:, :, k_pos[mine]], blocks,
                                  scale=q.shape[-1] ** -0.5,
                                  key_mask=None if key_mask is None else key_mask[:, k_pos[mine]])
        outs.append(o)
        lses.append(lse)
    return merge_partials(torch.stack(outs), torch.stack(lses))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_dilated_token_by_token_equals_full_forward_rows(world):
    q, k, v = qkv(0)
    n = q.shape[2]
    ref = dilated_attention(q, k, v, branches=BRANCHES)
    owners = place_tokens([0] * world, n)
    worst = 0.0
    for t in range(n):
        got = decode(q, k, v, torch.tensor([t]), torch.arange(t + 1), owners=owners, world=world, branches=BRANCHES)
        worst = max(worst, rel_err(got, ref[:, :, t:t + 1]))
    assert worst <= TOL, worst


def test_dilated_rows_no_branch_covers_are_zero():
    # Rate 4 on the only branch: query heads 0..3 each see one residue; head 0 at t=1 sees nothing.
    q, k, v = qkv(1, hq=4, hkv=4, n=12)
    got = decode(q, k, v, torch.tensor([1]), torch.arange(2), branches=((12, 4),))
    assert torch.equal(got[:, 0], torch.zeros_like(got[:, 0]))
    ref = dilated_attention(q, k, v, branches=((12, 4),))
    assert rel_err(got, ref[:, :, 1:2]) <= TOL


def padded_reference(q, k, v, branches, pad):
    """Float64 rows of the full forward with each sample's padded keys removed from the softmax."""
    n, hq = q.shape[2], q.shape[1]
    if branches is DENSE:
        bias = torch.zeros(hq, n, n, dtype=torch.float64).masked_fill(~dense_mask(n), float("-inf"))
    else:
        bias = torch.stack([torch.log(dilated_multiplicity(n, branches, h).double()) for h in range(hq)])
    return torch.cat([
        attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], bias=bias.masked_fill(~pad[i][None, None, :], float("-inf")))
        for i in range(q.shape[0])
    ])


@pytest.mark.parametrize("branches", [DENSE, BRANCHES])
def test_several_new_tokens_at_once_with_padding(branches):
    q, k, v = qkv(2, n=60)
    pad = torch.ones(2, 60, dtype=torch.bool)
    pad[0, :9] = False  # a left-padded sample
    ref = padded_reference(q, k, v, branches, pad)
    prompt = shard_sizes(40, 3, "zigzag")
    owners = [r for r in range(3) for _ in range(prompt[r])]  # positions' owners need not be sorted by rank
    owners = [owners[i] for i in torch.randperm(40, generator=torch.Generator().manual_seed(0))]
    owners += place_tokens(prompt, 20)
    got = decode(q, k, v, torch.arange(40, 60), torch.arange(60), key_mask=pad, owners=owners, world=3,
                 branches=branches)
    assert rel_err(got, ref[:, :, 40:60]) <= TOL


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window_decode(window):
    q, k, v = qkv(3, n=50)
    m = dense_mask(50, window=window)
    ref = attention(q, k, v, bias=torch.zeros(1, 50, 50, dtype=torch.float64).masked_fill(~m, float("-inf")))
    owners = place_tokens([0, 0], 50)
    for t in (0, 7, 30, 49):
        got = decode(q, k, v, torch.tensor([t]), torch.arange(t + 1), owners=owners, world=2, window=window)
        assert rel_err(got, ref[:, :, t:t + 1]) <= TOL


def test_blocks_skip_unneeded_keys():
    # Dense decode over keys all in the past: one call, no mask, no row selection.
    (blk,) = cached_blocks(torch.tensor([9]), torch.arange(9), hq=4, hkv=2)
    assert blk.mask is None and blk.k_rows is None and blk.q_rows is None
    # A window of 3 keeps only the last keys.
    (blk,) = cached_blocks(torch.tensor([9]), torch.arange(10), hq=4, hkv=2, window=3)
    assert blk.k_rows.tolist() == [7, 8, 9]
    # Rate 2 over one segment: query 9 (residue 1) reads only odd keys, with heads 1 and 3.
    blocks = cached_blocks(torch.tensor([9]), torch.arange(10), hq=4, hkv=4, branches=((16, 2),))
    assert [b.k_rows.tolist() for b in blocks] == [[1, 3, 5, 7, 9]]
    assert blocks[0].q_heads == range(1, 4, 2)


def _same_blocks(a, b):
    def key(blk):
        rows = [None if t is None else t.tolist() for t in (blk.q_rows, blk.k_rows, blk.mask)]
        return (blk.q_heads, blk.kv_heads, *map(str, rows))
    return [key(x) for x in a] == [key(x) for x in b]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 70), q_len=st.integers(1, 3), drop=st.integers(0, 5), causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 80)),
       branches=st.sampled_from([DENSE, ((64, 1),), ((16, 1),), ((16, 2),), ((8, 1), (16, 2))]))
def test_all_visible_shortcut_gives_the_general_blocks(n, q_len, drop, causal, window, branches):
    # Decoding's one-pass check for "every cached key visible" must yield exactly the blocks of the general path.
    import hf_ring.engine.decode as decode_mod

    k_pos = torch.arange(n)[drop:] if drop < n else torch.arange(n)
    q_pos = torch.arange(n, n + q_len) if causal else torch.arange(q_len)
    kw = dict(hq=4, hkv=2, causal=causal, window=window, branches=branches)
    fast = cached_blocks(q_pos, k_pos, **kw)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(decode_mod, "_every_pair_allowed", lambda *a: False)
        general = cached_blocks(q_pos, k_pos, **kw)
    assert _same_blocks(fast, general)


def test_all_visible_shortcut_is_taken_for_dense_decoding():
    from hf_ring.engine.decode import _every_pair_allowed

    assert _every_pair_allowed(torch.tensor([100]), torch.arange(100), True, None, DENSE)
    assert not _every_pair_allowed(torch.tensor([100]), torch.arange(102), True, None, DENSE)  # a future key
    assert not _every_pair_allowed(torch.tensor([100]), torch.arange(100), True, 50, DENSE)  # keys out of the window
    assert not _every_pair_allowed(torch.tensor([100]), torch.arange(100), True, None, ((64, 1),))  # two segments
    assert not _every_pair_allowed(torch.tensor([100]), torch.arange(100), True, None, ((128, 2),))  # dilated


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4), (6, 3)])
def test_query_heads_of_one_kv_head_keep_their_own_rows_and_masks(hq, hkv):
    # A decode kernel runs the query heads that share a K/V head as that head's rows; a mask that differs
    # per query row and per sample must still reach each head's own row.
    q, k, v = qkv(5, b=2, hq=hq, hkv=hkv, n=40)
    queries = q[:, :, 30:36]
    pair = torch.rand(2, 1, 6, 40, generator=torch.Generator().manual_seed(1)) > 0.4
    pair[..., 0] = True  # every row sees a key
    blocks = cached_blocks(torch.arange(30, 36), torch.arange(40), hq=hq, hkv=hkv, causal=False)
    out, lse = cached_attention(queries, k, v, blocks, scale=q.shape[-1] ** -0.5, pair_mask=pair)
    bias = torch.zeros(2, 1, 6, 40, dtype=torch.float64).masked_fill(~pair, float("-inf"))
    assert rel_err(out, attention(queries, k, v, bias=bias)) <= TOL
    assert lse.shape == (2, hq, 6)


def test_merge_partials_ignores_empty_partials():
    out = torch.randn(3, 1, 2, 1, 4)
    lse = torch.tensor([0.5, float("-inf"), -1.0]).view(3, 1, 1, 1).expand(3, 1, 2, 1).clone()
    got = merge_partials(out, lse)
    w = torch.tensor([math.exp(0.5), 0.0, math.exp(-1.0)], dtype=torch.float64)
    want = (w.view(3, 1, 1, 1, 1) * out.double()).sum(0) / w.sum()
    assert rel_err(got, want) <= TOL
    empty = merge_partials(torch.zeros(2, 1, 1, 1, 4), torch.full((2, 1, 1, 1), float("-inf")))
    assert torch.equal(empty, torch.zeros(1, 1, 1, 4))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 400), world=st.integers(1, 6), new=st.integers(0, 300),
       layout=st.sampled_from(["zigzag", "contiguous"]))
def test_every_rank_holds_at_most_ceil_n_over_p_plus_one(n, world, new, layout):
    counts = shard_sizes(n, world, layout)
    assert max(counts) <= -(-n // world) + 1
    total = n
    for owner in place_tokens(counts, new):
        counts[owner] += 1
        total += 1
        assert max(counts) <= -(-total // world) + 1


def test_sharded_caches_partition_the_positions():
    caches = [ShardedCache(r, 3, "zigzag") for r in range(3)]
    for c in caches:
        c.begin_prefill(23)
    for _ in range(10):
        for c in caches:
            c.begin_step(1)
    for c in caches:
        c.begin_step(4)  # a continuation of several tokens
    held = sorted(int(p) for c in caches for p in c.index)
    assert held == list(range(37))
    assert all(c.counts == caches[0].counts for c in caches)
    assert [c.local_length() for c in caches] == caches[0].counts
    assert all(torch.equal(c.index, c.index.sort().values) for c in caches)


def test_sharded_cache_refuses_crop_and_second_prefill():
    c = ShardedCache(0, 2, "zigzag")
    c.begin_prefill(5)
    with pytest.raises(ValueError, match="empty cache"):
        c.begin_prefill(5)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        c.crop(-1)


def test_cache_layer_appends_without_losing_rows_and_with_bounded_room():
    cache = ShardedCache(0, 1, "contiguous")
    cache.begin_prefill(100)
    k = torch.randn(2, 2, 100, 4)
    cache.update(k, -k, 0)
    assert cache.nbytes() == 2 * k.numel() * 4  # the prefill is stored without spare room
    rows = [k]
    for _ in range(300):
        cache.begin_step(1)
        new = torch.randn(2, 2, 1, 4)
        rows.append(new)
        keys, values = cache.update(new, -new, 0)
    want = torch.cat(rows, 2)
    assert torch.equal(keys, want) and torch.equal(values, -want)
    assert cache.nbytes() <= 2 * 2 * 2 * 4 * 4 * (400 + max(64, 400 // 8))
    cache.batch_select_indices(torch.tensor([1]))
    cache.begin_step(1)
    keys, _ = cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
    assert torch.equal(keys[:, :, :400], want[1:]) and keys.shape == (1, 2, 401, 4)
