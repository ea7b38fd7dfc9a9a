"""The block planner: every allowed (query, key) pair is computed exactly once, nothing else."""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ring import local_positions
from hf_ring.blocks import Block, allowed, ring_plan, split_block


def covered_pairs(n, world, layout, causal, window, tile=None):
    """Map (query pos, key pos) -> count over the plans of all ranks; checks block kinds on the way."""
    seen = {}
    for rank in range(world):
        plan = ring_plan(n, rank, world, layout, causal, window)
        qpos = local_positions(n, rank, world, layout).tolist()
        for step, blocks in enumerate(plan.steps):
            kpos = local_positions(n, plan.source(step), world, layout).tolist()
            for big in blocks:
                for b in ([big] if tile is None else split_block(big, tile, causal, window)):
                    for i in range(b.nq):
                        for j in range(b.nk):
                            t, k = qpos[b.q0 + i], kpos[b.k0 + j]
                            ok = allowed(t, k, causal, window)
                            if b.kind == "full":
                                assert ok, (b, t, k)
                            if b.kind == "causal":
                                assert t - i == k - j and ok == (j <= i), (b, t, k)
                            if ok:
                                seen[(t, k)] = seen.get((t, k), 0) + 1
    return seen


def expected_pairs(n, causal, window):
    return {(t, k) for t in range(n) for k in range(n) if allowed(t, k, causal, window)}


CASES = [
    (n, w, layout, causal, window)
    for n, w, layout, (causal, window) in itertools.product(
        [1, 5, 37, 101], [1, 2, 3, 4], ["zigzag", "contiguous"],
        [(True, None), (False, None), (True, 1), (True, 3), (True, 16), (True, 300)],
    )
]


@pytest.mark.parametrize("n,world,layout,causal,window", CASES)
def test_each_allowed_pair_once(n, world, layout, causal, window):
    seen = covered_pairs(n, world, layout, causal, window)
    assert set(seen) == expected_pairs(n, causal, window)
    assert all(c == 1 for c in seen.values())


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 90), world=st.integers(1, 5), layout=st.sampled_from(["zigzag", "contiguous"]),
       window=st.one_of(st.none(), st.integers(1, 100)), tile=st.integers(1, 40))
def test_tiled_blocks_cover_the_same_pairs(n, world, layout, window, tile):
    seen = covered_pairs(n, world, layout, True, window, tile=tile)
    assert set(seen) == expected_pairs(n, True, window)
    assert all(c == 1 for c in seen.values())


def test_future_blocks_are_skipped():
    # Contiguous causal: rank 0 never needs another rank's keys.
    plan0 = ring_plan(64, 0, 4, "contiguous", True, None)
    assert [len(s) for s in plan0.steps] == [1, 0, 0, 0]
    # Zigzag: every off-diagonal step computes exactly half of the local rows x shard rows.
    plan = ring_plan(64, 1, 4, "zigzag", True, None)
    for step in plan.steps[1:]:
        assert sum(b.nq * b.nk for b in step) == 16 * 16 // 2


def test_window_stops_the_ring_early_and_keeps_masks_small():
    plan = ring_plan(4096, 0, 4, "contiguous", True, 100)
    assert plan.num_steps == 2  # keys further than one shard back are out of the window
    big = ring_plan(1 << 16, 0, 1, "contiguous", True, 512)
    masked = [b for b in big.steps[0] if b.kind == "mask"]
    assert masked and max(b.nq * b.nk for b in masked) <= 512 * 512


def test_split_block_drops_future_tiles():
    diag = Block(0, 10, 0, 10, 0, 0, "causal")
    tiles = split_block(diag, 4, True, None)
    assert sum(b.kind == "causal" for b in tiles) == 3
    assert all(b.k0 <= b.q0 for b in tiles)
