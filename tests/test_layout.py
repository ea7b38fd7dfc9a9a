"""Pure index math of the layouts: no processes needed."""
import pytest
import torch

from hf_ring import local_positions, shard_sizes
from hf_ring.engine.layout import chunk_bounds, infer_seq_len, local_runs, owner, totals_before


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 37, 101, 1000])
def test_positions_partition_the_sequence(layout, world, n):
    parts = [local_positions(n, r, world, layout) for r in range(world)]
    for p in parts:
        assert p.dtype == torch.long
        assert torch.all(p[1:] > p[:-1]), "positions must be ascending"
    allpos = torch.cat(parts).sort().values
    assert torch.equal(allpos, torch.arange(n))
    sizes = [len(p) for p in parts]
    assert sizes == shard_sizes(n, world, layout)
    assert max(sizes) - min(sizes) <= 1, "shards may differ by one row at most"


def test_zigzag_holds_chunk_r_and_its_mirror():
    # 16 tokens, 2 ranks -> 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert local_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert local_positions(16, 1, 2, "contiguous").tolist() == list(range(8, 16))


def test_uneven_chunks_put_extra_rows_first():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert local_runs(10, 0, 2) == [(0, 3), (8, 10)]


def test_zigzag_balances_causal_work():
    n, world = 1200, 4
    work = [sum(int(p) + 1 for p in local_positions(n, r, world)) for r in range(world)]
    contiguous = [sum(int(p) + 1 for p in local_positions(n, r, world, "contiguous")) for r in range(world)]
    assert max(work) / min(work) < 1.01
    assert max(contiguous) / min(contiguous) > 5


def test_infer_seq_len_and_rejects_impossible_sizes():
    assert infer_seq_len([33, 34, 34], "zigzag") == 101
    with pytest.raises(ValueError, match="shard sizes"):
        infer_seq_len([10, 30], "zigzag")


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="layout='ring'"):
        local_positions(10, 0, 2, "ring")
    with pytest.raises(ValueError, match="rank"):
        local_positions(10, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        local_positions(10, 0, 0)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n,world", [(1, 1), (5, 3), (37, 2), (101, 4), (7, 4)])
def test_owner_agrees_with_local_positions(layout, n, world):
    for r in range(world):
        for p in local_positions(n, r, world, layout).tolist():
            assert owner(p, n, world, layout) == r
    with pytest.raises(ValueError, match="position must be in"):
        owner(n, n, world, layout)


@pytest.mark.parametrize("world, layout, ulysses", [(2, "zigzag", 1), (3, "zigzag", 1), (4, "contiguous", 1),
                                                    (4, "zigzag", 2)])
def test_totals_before_each_run_are_the_counts_of_every_earlier_row(world, layout, ulysses):
    """A count along the sequence continued across ranks: per run, what every run before it holds."""
    n = 29
    counted = torch.randint(0, 2, (3, n))
    runs = [local_runs(n, r, world, layout, ulysses) for r in range(world)]
    width = max(len(r) for r in runs)
    totals = torch.zeros(world, 3, width, dtype=torch.long)
    for r, mine in enumerate(runs):
        for i, (a, b) in enumerate(mine):
            totals[r, :, i] = counted[:, a:b].sum(1)
    for r, mine in enumerate(runs):
        got = totals_before(runs, totals, r)
        want = torch.stack([counted[:, :a].sum(1) for a, _ in mine], dim=1) if mine else torch.zeros(3, 0)
        assert torch.equal(got, want.long()), (r, got, want)
