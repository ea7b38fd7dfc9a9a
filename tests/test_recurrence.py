"""The index math and composition of state passing (hf_ring.engine.recurrence), without processes."""
import pytest
import torch

from hf_ring.engine.recurrence import Pieces, carried, halo_sources

CASES = [(61, 2, "zigzag", 1), (61, 4, "zigzag", 1), (61, 3, "contiguous", 1), (61, 4, "zigzag", 2), (5, 4, "zigzag", 1),
         (3, 4, "contiguous", 1)]


@pytest.mark.parametrize("n, world, layout, ulysses", CASES)
def test_the_runs_in_position_order_cover_the_sequence_once(n, world, layout, ulysses):
    pieces = Pieces.of(n, world, layout, ulysses, 0)
    covered = [p for r, i in pieces.order() for p in range(*pieces.runs[r][i])]
    assert covered == list(range(n))


@pytest.mark.parametrize("width", [1, 3, 6])
@pytest.mark.parametrize("n, world, layout, ulysses", CASES)
def test_a_halo_names_the_rows_just_before_each_run(n, world, layout, ulysses, width):
    """Every source is the row ``width`` before the run's start up to the row before it, read from the run that
    holds it (its tail: its last ``width`` rows, right-aligned); None before position 0."""
    for rank in range(world):
        pieces = Pieces.of(n, world, layout, ulysses, rank)
        for (start, _), sources in zip(pieces.mine, halo_sources(pieces, width)):
            for p, source in zip(range(start - width, start), sources):
                if p < 0:
                    assert source is None
                    continue
                r, i, row = source
                a, b = pieces.runs[r][i]
                assert a <= p < b and b - width + row == p and 0 <= row < width


def test_carried_states_compose_each_run_in_position_order():
    """Scalar affine runs (s -> m s + e): each run starts from the state of everything before it."""
    pieces = Pieces.of(61, 3, "zigzag", 1, 1)
    ends = torch.zeros(3, pieces.width)
    maps = torch.zeros(3, pieces.width)
    torch.manual_seed(0)
    for r, runs in enumerate(pieces.runs):
        for i in range(len(runs)):
            ends[r, i], maps[r, i] = torch.randn(()), torch.rand(())
    starts, end = carried(pieces, ends, maps, lambda m, s: m * s, initial=torch.tensor(0.5))
    state, want = torch.tensor(0.5), {}
    for r, i in pieces.order():
        want[r, i] = state
        state = maps[r, i] * state + ends[r, i]
    assert [float(s) for s in starts] == [float(want[1, i]) for i in range(len(pieces.mine))]
    assert float(end) == float(state)
