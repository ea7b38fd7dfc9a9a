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


DOCUMENTS = ((0, 23, 26, 40), (0, 7, 50))
"""Two batch rows, each its own documents (packed rows), over 61 rows."""


@pytest.mark.parametrize("limit", [None, 1, 5, 16])
@pytest.mark.parametrize("n, world, layout, ulysses", CASES[:4])
def test_segments_cut_the_runs_at_every_document_start_and_know_each_rows_document(n, world, layout, ulysses, limit):
    """Every segment lies in one run and holds no document start of any batch row but at its first row; its
    origin per batch row is the start of the document holding its first row; the segments cover each run once;
    with a ``limit``, none is longer, and only a document start or the limit cuts a run."""
    from hf_ring.engine.recurrence import segments

    for rank in range(world):
        pieces = Pieces.of(n, world, layout, ulysses, rank)
        found = segments(pieces, DOCUMENTS, 2, limit=limit)
        covered = {}
        for seg in found:
            offset, length = pieces.local()[seg.run]
            run_start = pieces.mine[seg.run][0]
            assert seg.start == run_start or seg.start in {s for row in DOCUMENTS for s in row} or \
                (limit is not None and (seg.start - run_start) % limit == 0)
            assert limit is None or seg.length <= limit
            assert offset <= seg.offset and seg.offset + seg.length <= offset + length
            assert seg.start == pieces.mine[seg.run][0] + seg.offset - offset
            for row, starts in enumerate(DOCUMENTS):
                assert not any(seg.start < s < seg.start + seg.length for s in starts)
                assert seg.origins[row] == max(s for s in starts if s <= seg.start)
                assert seg.fresh[row] == (seg.start in starts)
            covered.setdefault(seg.run, []).extend(range(seg.offset, seg.offset + seg.length))
        assert all(covered[i] == list(range(o, o + length)) for i, (o, length) in enumerate(pieces.local()))


def test_a_runs_segments_fold_into_its_state_passing_with_documents_restarting():
    """Diagonal affine segments per batch row (s -> m * (k s) + e, k 0 where a row's document starts): the run's
    folded (end, transition) and each segment's start state equal the segments walked one by one."""
    from hf_ring.engine.recurrence import fold, segment_starts

    torch.manual_seed(0)
    ends, maps = [torch.randn(2, 3) for _ in range(4)], [torch.rand(2, 3) for _ in range(4)]
    kept = [None, torch.tensor([1.0, 0.0]), None, torch.tensor([0.0, 0.0])]
    step, chain = (lambda m, s: m * s), (lambda m2, m1: m2 * m1)
    start = torch.randn(2, 3)
    walked, state = [], start
    for e, m, k in zip(ends, maps, kept):
        state = state if k is None else state * k[:, None]
        walked.append(state)
        state = m * state + e
    end, transition = fold(ends, maps, kept, step, chain)
    assert torch.allclose(step(transition, start) + end, state)
    assert all(torch.equal(a, b) for a, b in zip(segment_starts(start, ends, maps, kept, step), walked))
    assert torch.equal(transition, torch.zeros_like(transition))  # the last segment starts both rows' documents
