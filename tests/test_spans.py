"""Bidirectional spans (an image's tokens, a prefix) inside causal rows, against the float64 reference, on 1-3 ranks.

The reference builds its mask as transformers composes it for Gemma 3 and
PaliGemma: causal (with the window) or both rows in one block, inside each
packed document.
"""
import pytest
import torch

import reference as R
from attention_cases import REF_NAMES, assemble, make_qkv, packed_case
from helpers import rel_err
from hf_ring.engine.spans import check_spans, extra_pairs, merged, spans_of_ids, touching, within_documents

FP32_TOL = 1e-5
N = 61


def block_ids(runs_by_row, n=N):
    """``(B, n)`` block ids: -1 outside, each ``(start, stop)`` run its own id."""
    ids = torch.full((len(runs_by_row), n), -1, dtype=torch.long)
    for b, runs in enumerate(runs_by_row):
        for i, (start, stop) in enumerate(runs):
            ids[b, start:stop] = i
    return ids


ROWS = {
    # an image inside one shard, one across every border of 2 and 3 zigzag ranks, one of a single token
    "images": [[(3, 9), (14, 40), (44, 45), (50, 58)]],
    "prefix": [[(0, 23)]],  # PaliGemma's prefix: image and prompt, then the causal suffix
    "two-rows": [[(5, 20)], [(0, 4), (30, 61)]],  # batch 2, different spans per row
}
MODES = {"causal": {}, "window": {"window": 6}}


def reference(args, ids, position_ids=None, pad=0, **mode):
    q, k, v, dout = make_qkv(*args)
    bias = R.block_bias(ids, position_ids, window=mode.get("window"))
    if pad:
        bias[0, :, :, :pad] = float("-inf")
    return dict(zip(REF_NAMES, R.with_grads(lambda q, k, v: R.attention(q, k, v, bias=bias), q, k, v, dout)))


def run(pools, world, args, layout, **kw):
    results = [packed_case(*args, layout=layout, **kw)] if world == 1 else pools(world).run(
        packed_case, *args, layout=layout, **kw)
    return {name: assemble(results, name, args[4]) for name in REF_NAMES}, results


@pytest.mark.parametrize("world,layout", [(1, "contiguous"), (2, "zigzag"), (2, "contiguous"), (3, "zigzag")])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("rows", list(ROWS))
def test_spans_match_reference(pools, world, layout, mode, rows):
    ids = block_ids(ROWS[rows])
    args = (world * 7 + len(rows), ids.shape[0], 4, 2, N, 8)
    got, _ = run(pools, world, args, layout, spans=spans_of_ids(ids), **MODES[mode])
    ref = reference(args, ids, **MODES[mode])
    errs = {name: rel_err(got[name], ref[name]) for name in REF_NAMES}
    assert max(errs.values()) <= FP32_TOL, errs


@pytest.mark.parametrize("world", [1, 2])
def test_spans_with_documents_and_padding(pools, world):
    """A span crossing a document border is cut there; padded keys stay out of every span's softmax."""
    ids = block_ids([[(10, 30)]])
    pos = torch.cat([torch.arange(20), torch.arange(N - 20)])[None]  # documents [0, 20) and [20, 61)
    args = (world + 40, 1, 4, 2, N, 8)
    got, _ = run(pools, world, args, "zigzag", spans=spans_of_ids(ids), position_ids=pos, pad=12)
    ref = reference(args, ids, position_ids=pos, pad=12)
    errs = {name: rel_err(got[name], ref[name]) for name in REF_NAMES}
    assert max(errs.values()) <= FP32_TOL, errs


def test_spans_in_small_messages(pools):
    """Messages cut inside a span carry its extra blocks cut alike."""
    ids = block_ids(ROWS["images"])
    args = (77, 1, 4, 2, N, 8)
    got, _ = run(pools, 2, args, "zigzag", spans=spans_of_ids(ids), message_rows=3)
    ref = reference(args, ids)
    assert max(rel_err(got[name], ref[name]) for name in REF_NAMES) <= FP32_TOL


def test_spans_of_ids():
    ids = torch.tensor([[-1, 0, 0, 0, -1, 1, -1, 2, 2], [5, 5, -1, -1, -1, -1, -1, -1, 7]])
    assert spans_of_ids(ids) == (((1, 4), (7, 9)), ((0, 2),))  # a one-row block adds nothing
    with pytest.raises(ValueError, match="block 0 of batch row 0 is not one run"):
        spans_of_ids(torch.tensor([[0, 0, -1, 0]]))


def test_spans_checked():
    assert check_spans(((), ()), 2, 10) is None
    assert check_spans((((0, 1),),), 1, 10) is None  # one row: causality already lets it see itself
    for bad in [(((3, 2),),), (((0, 4), (2, 6)),), (((0, 11),),), ((("a", 2),),), ([(0, 2)],)]:
        with pytest.raises(ValueError, match="spans"):
            check_spans(bad, 1, 10)


def test_spans_cut_at_documents():
    spans = (((2, 9), (12, 14)),)
    assert within_documents(spans, ((0, 5, 13),), 20) == (((2, 5), (5, 9)),)


def test_merged_and_touching():
    runs = merged((((0, 4), (10, 12)), ((3, 6),)))
    assert runs == [(0, 6), (10, 12)]
    assert touching(runs, 5, 10) == [(0, 6), (10, 12)]
    assert touching(runs, 6, 9) == []


def test_extra_pairs_are_what_causality_leaves_out():
    spans = (((2, 6),),)
    pos = torch.arange(8)
    extra = extra_pairs(spans, pos, pos, causal=True, window=2)[0, 0]
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for q in range(2, 6):
        for k in range(2, 6):
            expected[q, k] = not (k <= q and k > q - 2)
    assert torch.equal(extra, expected)


def test_spans_with_a_dilated_pattern_are_refused():
    import hf_ring

    q, k, v, _ = make_qkv(0, 1, 2, 2, 16, 4)
    with pytest.raises(NotImplementedError, match="spans inside a dilated pattern"):
        hf_ring.ring_attention(q, k, v, spans=(((0, 4),),),
                               pattern={"segment_lengths": [8, 16], "dilation_rates": [1, 2]})
