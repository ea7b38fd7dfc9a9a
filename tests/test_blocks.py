"""The schedule: every allowed (query, key) pair is computed exactly as often as the pattern says."""
import itertools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import reference as R
from hf_ring import local_positions
from hf_ring.engine.blocks import Progression, tiles
from hf_ring.engine.schedule import Geometry, contains, local_causal, pair_plan, rank_plan, sent


def _plan(n, rank, world, layout, causal, window, branches, hq, hkv, budget=None):
    return rank_plan(Geometry(n, world, layout, causal, window, branches, hq, hkv), rank, budget)


def coverage(n, world, layout, causal, window, branches, hq, hkv, bwd_tile=None, budget=None):
    """cover[h, t, k]: how many computed blocks let query head h at t see key k; checks kinds on the way."""
    cover = torch.zeros(hq, n, n, dtype=torch.long)
    g = hq // hkv
    for rank in range(world):
        qpos = local_positions(n, rank, world, layout)
        plan = _plan(n, rank, world, layout, causal, window, branches, hq, hkv, budget)
        for step in plan.steps:
            kpos_src = local_positions(n, step.src, world, layout)
            for blk in step.recv.blocks:
                piece = step.recv.pieces[blk.piece]
                piece_pos = kpos_src[piece.rows.slice]
                kp = Progression(blk.k_off * blk.q.stride, blk.k_pos, blk.nk, blk.q.stride)
                parts = [(blk.q, kp, blk.kind)] if bwd_tile is None else tiles(blk.q, kp, causal, window, bwd_tile)
                for qt, kt, kind in parts:
                    t = qpos[qt.slice]
                    assert torch.equal(t, torch.arange(qt.pos, qt.last_pos + 1, qt.stride))
                    ks = piece_pos[kt.local // kt.stride: kt.local // kt.stride + kt.count]
                    assert torch.equal(ks, torch.arange(kt.pos, kt.pos + kt.count * kt.stride, kt.stride))
                    ok = (ks[None, :] <= t[:, None]) if causal else torch.ones(len(t), len(ks), dtype=torch.bool)
                    if window is not None:
                        ok &= ks[None, :] > t[:, None] - window
                    if kind == "full":
                        assert ok.all()
                    if kind == "causal":
                        assert torch.equal(t, ks) and torch.equal(ok, torch.ones_like(ok).tril())
                    for j, h in enumerate(blk.q_heads):
                        u = piece.heads[j // (len(blk.q_heads) // len(piece.heads))]
                        assert u == h // g, "query head paired with the wrong K/V head"
                        cover[h][t[:, None].expand_as(ok)[ok], ks[None, :].expand_as(ok)[ok]] += 1
    return cover


def expected(n, causal, window, branches, hq):
    if branches is None:
        m = R.dense_mask(n, causal, window).long()
        return m.expand(hq, n, n)
    return torch.stack([R.dilated_multiplicity(n, branches, h, causal) for h in range(hq)])


DENSE = [(n, w, layout, c, win) for n, w, layout, (c, win) in itertools.product(
    [1, 5, 37, 101], [1, 2, 3, 4], ["zigzag", "contiguous"],
    [(True, None), (False, None), (True, 1), (True, 3), (True, 16), (True, 300)])]


@pytest.mark.parametrize("n,world,layout,causal,window", DENSE)
def test_dense_pairs_once(n, world, layout, causal, window):
    got = coverage(n, world, layout, causal, window, ((max(n, 1), 1),), 2, 1)
    assert torch.equal(got, expected(n, causal, window, None, 2))


PATTERNS = [((8, 1),), ((4, 1), (8, 2)), ((16, 4), (5, 2), (64, 1)), ((1000, 3),), ((8, 2), (8, 2))]


@pytest.mark.parametrize("branches", PATTERNS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_dilated_multiplicity(branches, world, layout, causal):
    n = 45
    got = coverage(n, world, layout, causal, None, branches, 6, 2)
    assert torch.equal(got, expected(n, causal, None, branches, 6))


def test_rows_shared_by_branches_travel_once():
    n, world, hq = 1024, 2, 8
    travelling = lambda plan: sum(len(p.heads) * p.rows.count for s in plan.steps[1:] for p in sent(s.recv.pieces))  # noqa: E731
    two = _plan(n, 1, world, "contiguous", False, None, ((n, 2),), hq, hq)
    # the offset-o rows of rate 4 (heads o, o+4) are among the offset-o rows of rate 2 (heads o, o+2, ...)
    both = _plan(n, 1, world, "contiguous", False, None, ((n, 2), (n, 4)), hq, hq)
    assert travelling(both) == travelling(two)
    views = [p for s in both.steps[1:] for p in s.recv.pieces if p.within is not None]
    assert views and sum(len(p.heads) * p.rows.count for p in views) * 4 == n // world * hq
    for budget in (64, 100):  # cut into messages, each view still travels inside its parent's message
        cut = _plan(n, 1, world, "contiguous", False, None, ((n, 2), (n, 4)), hq, hq, budget)
        assert travelling(cut) == travelling(two)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), world=st.integers(1, 4), layout=st.sampled_from(["zigzag", "contiguous"]),
       window=st.one_of(st.none(), st.integers(1, 80)), tile=st.integers(1, 30))
def test_backward_tiles_cover_the_same_pairs(n, world, layout, window, tile):
    got = coverage(n, world, layout, True, window, ((max(n, 1), 1),), 2, 2, bwd_tile=tile)
    assert torch.equal(got, expected(n, True, window, None, 2))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), world=st.integers(1, 4), layout=st.sampled_from(["zigzag", "contiguous"]),
       branches=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 5)), min_size=1, max_size=3),
       heads=st.sampled_from([(4, 4), (4, 2), (6, 2), (6, 3)]), tile=st.integers(1, 9))
def test_dilated_tiles_cover_the_pattern(n, world, layout, branches, heads, tile):
    branches = tuple(branches)
    got = coverage(n, world, layout, True, None, branches, heads[0], heads[1], bwd_tile=tile)
    assert torch.equal(got, expected(n, True, None, branches, heads[0]))


def own_pairs(geo, rank):
    """How often the blocks of ``rank`` on its own K/V pair local query row i with local key row j, per query head."""
    plan = pair_plan(geo, rank, rank)
    rows = len(local_positions(geo.seq_len, rank, geo.world_size, geo.layout))
    cover = torch.zeros(geo.hq, rows, rows, dtype=torch.long)
    for blk in plan.blocks:
        piece = plan.pieces[blk.piece]
        qi = torch.arange(blk.q.local, blk.q.local + blk.q.count * blk.q.stride, blk.q.stride)
        kj = piece.rows.local + (blk.k_off + torch.arange(blk.nk)) * piece.rows.stride
        ok = torch.ones(len(qi), len(kj), dtype=torch.long)
        if blk.kind == "causal":
            ok = ok.tril()
        elif blk.kind != "full":
            ok = ok * 0 - 1  # a masked block is never the triangle
        for h in blk.q_heads:
            cover[h][qi[:, None], kj[None, :]] += ok
    return cover


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 90), world=st.integers(1, 4), layout=st.sampled_from(["zigzag", "contiguous"]),
       causal=st.booleans(), window=st.one_of(st.none(), st.integers(1, 60)),
       branches=st.one_of(st.none(), st.lists(st.tuples(st.integers(1, 70), st.integers(1, 4)), min_size=1, max_size=2)),
       tile=st.one_of(st.none(), st.integers(1, 20)))
@example(n=20, world=3, layout="zigzag", causal=True, window=None, branches=[(4, 1), (4, 1)], tile=None)  # areas add up
def test_local_causal_only_where_the_own_blocks_are_the_local_triangle(n, world, layout, causal, window, branches, tile):
    br = ((n, 1),) if branches is None else tuple(branches)
    geo = Geometry(n, world, layout, causal, window, br, 4, 2, tile)
    for rank in range(world):
        rows = len(local_positions(n, rank, world, layout))
        triangle = torch.ones(rows, rows, dtype=torch.long).tril().expand(4, rows, rows)
        if local_causal(geo, rank):
            assert torch.equal(own_pairs(geo, rank), triangle)
        if causal and rows and (window is None or window >= n) and br == ((n, 1),):
            assert local_causal(geo, rank), "a dense causal rank's own blocks are its local triangle"
        if not causal or (window is not None and window < rows):
            assert not local_causal(geo, rank)


def test_future_rows_are_never_sent():
    # Contiguous causal: rank 0 needs nothing from anyone, so only the ranks after it receive.
    plan0 = _plan(64, 0, 4, "contiguous", True, None, ((64, 1),), 2, 2)
    assert all(not s.recv.pieces for s in plan0.steps if s.shift)
    # Zigzag: at every step a rank computes half of (its rows x the visiting rows), and
    # when the visitor is an earlier rank only the half it can use travels.
    plan = _plan(64, 2, 4, "zigzag", True, None, ((64, 1),), 2, 2)
    for step in plan.steps[1:]:
        assert sum(b.q.count * b.nk for b in step.recv.blocks) == 16 * 16 // 2
        rows = sum(p.rows.count for p in step.recv.pieces)
        assert rows == (8 if step.src < 2 else 16)


def test_window_limits_steps_and_masks():
    plan = _plan(4096, 3, 4, "contiguous", True, 100, ((4096, 1),), 2, 2)
    assert [s.shift for s in plan.steps] == [0, 1]  # only the previous shard is within reach
    assert sum(p.rows.count for p in plan.steps[1].recv.pieces) == 99  # and only its last 99 rows
    big = pair_plan(Geometry(1 << 16, 1, "contiguous", True, 512, ((1 << 16, 1),), 2, 2), 0, 0)
    masked = [b for b in big.blocks if b.kind == "mask"]
    assert masked and max(b.q.count * b.nk for b in masked) <= 512 * 512


def test_segments_inside_a_rank_need_no_traffic():
    plan = _plan(1024, 1, 4, "contiguous", True, None, ((64, 1), (256, 4)), 8, 8)
    assert [s.shift for s in plan.steps] == [0]
    zig = _plan(1024, 1, 4, "zigzag", True, None, ((128, 1), (64, 2)), 8, 8)
    assert [s.shift for s in zig.steps] == [0]


def test_dilated_branch_sends_one_rth_of_the_rows():
    n, world, hq = 1024, 2, 8
    dense = _plan(n, 1, world, "contiguous", False, None, ((n, 1),), hq, hq)
    for r in (2, 4, 8):
        dil = _plan(n, 1, world, "contiguous", False, None, ((n, r),), hq, hq)
        count = lambda plan: sum(len(p.heads) * p.rows.count for s in plan.steps[1:] for p in s.recv.pieces)  # noqa: E731
        assert count(dil) * r == count(dense)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 70), world=st.integers(2, 4), layout=st.sampled_from(["zigzag", "contiguous"]),
       window=st.one_of(st.none(), st.integers(1, 80)), budget=st.integers(1, 40),
       branches=st.one_of(st.none(), st.lists(st.tuples(st.integers(1, 70), st.integers(1, 4)), min_size=1, max_size=2)))
def test_messages_split_by_budget_cover_the_same_pairs(n, world, layout, window, budget, branches):
    if branches is not None:
        window = None
    br = ((max(n, 1), 1),) if branches is None else tuple(branches)
    got = coverage(n, world, layout, True, window, br, 4, 2, budget=budget)
    assert torch.equal(got, expected(n, True, window, None if branches is None else br, 4))
    for rank in range(world):
        plan = _plan(n, rank, world, layout, True, window, br, 4, 2, budget)
        for step in plan.steps[1:]:
            for pieces in (step.recv.pieces, step.send):
                assert sum(len(p.heads) * p.rows.count for p in sent(pieces)) <= max(budget, 2)
                for p in pieces:  # a piece that does not travel is a view of one in the same message
                    assert p.within is None or (pieces[p.within].within is None and contains(pieces[p.within], p))


def test_key_validity_answers_ranges_per_batch_row():
    from hf_ring.engine.blocks import KeyValidity

    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    mask[2, 7:] = False  # right padding
    kv = KeyValidity(mask)
    assert kv.state(4, 7) == "all" and kv.state(0, 10) == "some"
    assert KeyValidity(torch.zeros(2, 5, dtype=torch.bool)).state(1, 4) == "none"
    assert kv.runs(0, 4) == [(slice(0, 1), "none"), (slice(1, 3), "all")]
    assert kv.runs(2, 8) == [(slice(0, 1), "some"), (slice(1, 2), "all"), (slice(2, 3), "some")]
    for start in range(10):
        for stop in range(start + 1, 11):
            for rows, state in kv.runs(start, stop):
                got = mask[rows, start:stop]
                assert state == ("all" if bool(got.all()) else "none" if not bool(got.any()) else "some")


def test_key_runs_are_the_columns_of_one_state():
    from hf_ring.engine.blocks import KeyValidity

    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :4] = False
    mask[:, 9:] = False
    kv = KeyValidity(mask)
    assert kv.key_runs(0, 12) == [(0, 4, "mixed"), (4, 9, "all"), (9, 12, "none")]
    assert kv.key_runs(5, 10) == [(5, 9, "all"), (9, 10, "none")]
    assert KeyValidity(torch.ones(1, 5, dtype=torch.bool)).key_runs(1, 3) == [(1, 3, "all")]


def test_rows_split_at_positions():
    rows = Progression(2, 10, 6, 2)  # positions 10, 12, ..., 20
    parts = rows.split([13, 17, 30])
    assert [(p.pos, p.count) for p in parts] == [(10, 2), (14, 2), (18, 2)]
    assert [p.local for p in parts] == [2, 6, 10]
    assert rows.split([]) == [rows] and rows.split([5]) == [rows]


def test_padding_parts_keep_a_diagonal_block_one_causal_call():
    """A causal diagonal block whose first keys are padding in every row: the padded keys are skipped and the
    rest stays one unmasked causal call over the queries that can see them; rows padded differently run alone."""
    from hf_ring.engine.blocks import KeyValidity, padding_parts

    n = 20
    rows = Progression(0, 0, n)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[:, :6] = False
    parts = list(padding_parts(rows, rows, "causal", True, None, KeyValidity(mask), mask, None, 8, True))
    assert [(p[0], p[1].pos, p[1].count, p[2].pos, p[2].count, p[3], p[5]) for p in parts] == [
        (slice(None), 6, 14, 6, 14, "causal", None)]
    mask[1, :6] = True  # row 1 unpadded: its first keys run for it alone, unmasked
    parts = list(padding_parts(rows, rows, "causal", True, None, KeyValidity(mask), mask, None, 8, True))
    assert all(p[5] is None for p in parts)
    assert {(p[0].start, p[0].stop) for p in parts if p[0] != slice(None)} == {(1, 2)}
    pairs = {(p[1].pos, p[2].pos, p[3]) for p in parts}
    assert (6, 6, "causal") in pairs and (0, 0, "causal") in pairs and (6, 0, "full") in pairs


def test_a_forward_keeps_its_kv_only_where_every_rank_can_tell_the_backward_sends_none():
    from hf_ring.engine.ring import KEEP_BYTES, keeps
    from hf_ring.engine.schedule import message_budget

    geo = Geometry(256, 4, "zigzag", True, None, ((256, 1),), 4, 2)
    budget = message_budget(256, 4, 2)
    assert keeps(geo, budget, 2 * budget, KEEP_BYTES)  # messages not cut: the forward's steps are the backward's
    assert keeps(geo, 64, None, KEEP_BYTES)  # a message size the caller chose: one plan for both
    assert not keeps(geo, budget, 2 * budget, KEEP_BYTES + 1)  # too large to keep
    assert not keeps(geo, budget, 2 * budget, None)
    assert not keeps(geo, 64, 128, KEEP_BYTES)  # the forward's larger messages make other steps
    assert not keeps(Geometry(256, 1, "contiguous", True, None, ((256, 1),), 4, 2), budget, None, 1)
