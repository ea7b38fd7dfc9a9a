"""Packed documents (position ids restarting inside a row) against the float64 reference, on 1-3 ranks.

The reference attends each document alone: its own dense (or dilated) mask in
the document's diagonal block, nothing across documents.
"""
import pytest
import torch

import hf_ring
import reference as R
from attention_cases import assemble, make_qkv, packed_case
from attention_cases import packed_reference as reference
from helpers import close, rel_err
from hf_ring.engine.documents import check_documents, document_starts, key_span, longest

FP32_TOL = 1e-5
NAMES = ("out", "dq", "dk", "dv")


def packed(lengths_by_row, n):
    """Global position ids ``(B, n)`` restarting at each document; the last document takes the rest of the row."""
    rows = []
    for lengths in lengths_by_row:
        lengths = list(lengths) + [n - sum(lengths)]
        rows.append(torch.cat([torch.arange(length) for length in lengths if length > 0]))
    return torch.stack(rows)


N = 101
SPLITS = {
    # many documents, one of a single token, several shorter than a shard, several crossing shard borders
    "many": [[9, 1, 23, 4, 30, 2, 11]],
    "two-rows": [[40, 1, 33], [5, 5, 70, 1]],  # batch 2, different splits per row
    "one-token-first": [[1, 60], [50]],
}
MODES = {
    "causal": {"causal": True},
    "window": {"causal": True, "window": 6},
    "full": {"causal": False},
    "dilated": {"causal": True, "pattern": ((8, 1), (16, 2), (32, 4))},
}


def pat(branches):
    return {"segment_lengths": [w for w, _ in branches], "dilation_rates": [r for _, r in branches]}


def run(pools, world, args, **kw):
    n = args[4]
    results = [packed_case(*args, **kw)] if world == 1 else pools(world).run(packed_case, *args, **kw)
    got = {name: assemble(results, name, n) for name in NAMES}
    if results[0]["dsinks"] is not None:
        got["dsinks"] = sum(r["dsinks"] for r in results)  # each rank returns its rows' share
    return got, results


def check(got, ref):
    errs = {name: rel_err(got[name], ref[name]) for name in ref}
    assert close(max(errs.values()), FP32_TOL), errs
    return errs


def engine_kw(mode):
    kw = dict(mode)
    if "pattern" in kw:
        kw["pattern"] = pat(kw["pattern"])
    return kw


def ref_kw(mode):
    return {"causal": mode["causal"], "window": mode.get("window"), "branches": mode.get("pattern")}


@pytest.mark.parametrize("world,layout", [(1, "contiguous"), (2, "zigzag"), (2, "contiguous"), (3, "zigzag"),
                                          (3, "contiguous")])
@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
def test_documents_match_reference(pools, world, layout, mode, split):
    pos = packed(SPLITS[split], N)
    args = (world * 10 + len(split), pos.shape[0], 4, 2, N, 8)
    got, _ = run(pools, world, args, position_ids=pos, layout=layout, **engine_kw(MODES[mode]))
    check(got, reference(args, pos, **ref_kw(MODES[mode])))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["causal", "dilated"])
def test_documents_with_key_padding(pools, world, mode):
    pos = packed(SPLITS["two-rows"], N)
    args = (3, 2, 4, 2, N, 8)
    got, _ = run(pools, world, args, position_ids=pos, pad=13, **engine_kw(MODES[mode]))
    check(got, reference(args, pos, pad=13, **ref_kw(MODES[mode])))


def test_dilated_non_causal_documents(pools):
    pos = packed(SPLITS["many"], N)
    args = (13, 1, 4, 2, N, 8)
    branches = ((8, 1), (16, 2), (32, 4))
    got, _ = run(pools, 2, args, position_ids=pos, causal=False, pattern=pat(branches))
    check(got, reference(args, pos, causal=False, branches=branches))


def test_documents_in_small_messages_and_tiles(pools):
    """Messages cut across tiles: a cut tile that shares no document any more is skipped, not miscomputed."""
    pos = packed([[17, 3, 40, 1, 9]], N)
    args = (8, 1, 4, 2, N, 8)
    for mode in ("window", "dilated"):
        got, _ = run(pools, 3, args, position_ids=pos, message_rows=5, **engine_kw(MODES[mode]))
        check(got, reference(args, pos, **ref_kw(MODES[mode])))


@pytest.mark.parametrize("mode", ["causal", "dilated"])
def test_known_starts_on_ranks_need_no_gather(pools, mode):
    """ring_attention(documents=global starts), what the transformers backend knows, on 2 ranks."""
    pos = packed(SPLITS["two-rows"], N)
    args = (12, 2, 4, 2, N, 8)
    got, _ = run(pools, 2, args, position_ids=pos, known_starts=True, **engine_kw(MODES[mode]))
    check(got, reference(args, pos, **ref_kw(MODES[mode])))


def test_one_document_per_row_is_the_unpacked_path():
    """position_ids without a restart change nothing: bit for bit the same as no position_ids."""
    q, k, v, _ = make_qkv(1, 2, 4, 2, 64, 8)
    plain = hf_ring.ring_attention(q, k, v)
    same = hf_ring.ring_attention(q, k, v, position_ids=torch.arange(5, 69).expand(2, 64))
    assert torch.equal(plain, same)


def test_known_documents_without_position_ids():
    pos = packed(SPLITS["two-rows"], N)
    q, k, v, _ = make_qkv(2, 2, 4, 2, N, 8)
    by_ids = hf_ring.ring_attention(q, k, v, position_ids=pos)
    by_starts = hf_ring.ring_attention(q, k, v, documents=document_starts(pos))
    assert torch.equal(by_ids, by_starts)


def test_document_index_math():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6], [3, 4, 5, 6, 7, 8, 9, 10]])
    docs = document_starts(pos)
    assert docs == ((0, 3, 4, 6), (0,))
    assert longest(docs, 8) == 8 and longest(((0, 3, 4, 6),), 8) == 3
    assert check_documents(((0,), (0,)), 2, 8) is None  # nothing to mask
    # rows 0-2 and 3: different documents in row 0, one document in row 1: they share
    assert key_span(docs, 8, 3, 3, 0, 2, True, None) == (0, 2)
    assert key_span(((0, 3), (0, 3)), 8, 3, 5, 0, 2, True, None) is None
    assert key_span(((0, 4),), 8, 2, 3, 0, 1, True, 1) is None  # the window excludes the only same-document keys
    assert key_span(((0, 2, 5),), 8, 5, 7, 0, 7, True, 2) == (5, 7)  # keys of the query's own document only
    assert key_span(((0, 2, 5),), 8, 3, 4, 0, 7, False, None) == (2, 4)  # non-causal: the whole document
    for bad in [((1, 3),), ((0, 3, 3),), ((0, 9),), [(0,)], ((0,), (0,))]:
        with pytest.raises(ValueError, match="documents"):
            check_documents(bad, 1, 8)


def test_packed_batch_computes_and_sends_less(pools):
    """Documents of 256 rows in 2048: fewer kernel pairs than one document, and, sharded, fewer bytes sent."""
    n, doc = 2048, 256
    pos = packed([[doc] * (n // doc - 1)], n)
    one = torch.arange(n)[None]
    args = (5, 1, 2, 1, n, 8)
    for world, layout in [(1, "contiguous"), (2, "zigzag"), (2, "contiguous")]:
        got, res_p = run(pools, world, args, position_ids=pos, layout=layout, spy=True)
        _, res_1 = run(pools, world, args, position_ids=one, layout=layout, spy=True)
        check(got, reference(args, pos))
        pairs_p, pairs_1 = sum(r["pairs"] for r in res_p), sum(r["pairs"] for r in res_1)
        # each 256-row causal document in 128-row tiles is 3 tiles: exactly its triangle
        assert pairs_p == (n // doc) * 3 * 128 * 128 * 2 and pairs_1 >= n * (n + 1) // 2 * 2
        if world > 1:
            sent_p, sent_1 = sum(r["sent_bytes"] for r in res_p), sum(r["sent_bytes"] for r in res_1)
            assert sent_1 > 0 and sent_p == 0  # no document crosses a shard border here


def test_document_crossing_a_border_sends_only_its_rows(pools):
    n = 512
    pos = packed([[200, 100]], n)  # documents [0, 200), [200, 300), [300, 512); rank 1 of 2 holds [256, 512)
    args = (6, 1, 2, 1, n, 8)
    got, res = run(pools, 2, args, position_ids=pos, layout="contiguous", spy=True)
    check(got, reference(args, pos))
    # Rank 0 sends rank 1 only its K/V rows [200, 256) of the document that crosses (once: a sequence this short
    # is kept by the forward for the backward, ring.KEEP_BYTES), and rank 1 returns their gradients; K and V in
    # fp32, one head.
    row_bytes = 8 * 4
    assert res[0]["sent_bytes"] == 2 * 56 * row_bytes and res[1]["sent_bytes"] == 2 * 56 * row_bytes


@pytest.mark.parametrize("kw,exc,match", [
    ({"position_ids": torch.zeros(1, 7, dtype=torch.long)}, ValueError, r"position_ids must have shape \(batch, local rows\)"),
    ({"position_ids": torch.zeros(8, dtype=torch.long)}, ValueError, "position_ids must have shape"),
    ({"position_ids": torch.zeros(1, 8)}, TypeError, "position_ids must be an integer tensor"),
    ({"position_ids": [[0] * 8]}, TypeError, "position_ids must be an integer tensor"),
])
def test_bad_position_ids(kw, exc, match):
    q, k, v, _ = make_qkv(0, 1, 2, 2, 8, 4)
    with pytest.raises(exc, match=match):
        hf_ring.ring_attention(q, k, v, **kw)


def test_position_ids_and_documents_together_are_refused():
    q, k, v, _ = make_qkv(0, 1, 2, 2, 8, 4)
    with pytest.raises(ValueError, match="either position_ids"):
        hf_ring.ring_attention(q, k, v, position_ids=torch.arange(8)[None], documents=((0,),))
    with pytest.raises(ValueError, match="documents"):
        hf_ring.ring_attention(q, k, v, documents=((0, 3), (0,)))  # two rows for a batch of one


def test_ranks_disagreeing_on_documents_fail_alike(pools):
    from attention_cases import options_case

    ids = torch.arange(8)[None]
    for per_rank, word in [([{"position_ids": ids}, {}], "position_ids"),
                           ([{"documents": ((0, 3),)}, {"documents": ((0, 4),)}], "documents"),
                           ([{"documents": ((0, 3),)}, {}], "documents")]:
        res = pools(2).run(options_case, per_rank)
        assert res[0] == res[1] and res[0][0] == "ValueError" and word in res[0][1], res


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("mode", ["causal", "window", "full"])
@pytest.mark.parametrize("budget", [None, 3])
def test_plan_covers_each_same_document_pair_once(world, layout, mode, budget):
    """Pure index math: the blocks of every rank, restricted to what the reference allows, cover each pair once."""
    from hf_ring import local_positions
    from hf_ring.engine.documents import document_tile
    from hf_ring.engine.schedule import Geometry, rank_plan

    n, hq, hkv = N, 4, 2
    pos = packed(SPLITS["two-rows"], n)
    causal, window = MODES[mode]["causal"], MODES[mode].get("window")
    allowed = torch.isfinite(R.packed_bias(pos, 1, causal=causal, window=window))[:, 0]  # (B, n, n)
    docs = document_starts(pos)
    tile = document_tile(docs, n, False)
    cover = torch.zeros(pos.shape[0], hq, n, n, dtype=torch.long)
    for rank in range(world):
        qpos = local_positions(n, rank, world, layout)
        geo = Geometry(n, world, layout if world > 1 else "contiguous", causal, window, ((n, 1),), hq, hkv, tile, docs)
        plan = rank_plan(geo, rank, budget)
        for step in plan.steps:
            kpos = local_positions(n, step.src, world, layout)
            for blk in step.recv.blocks:
                piece = step.recv.pieces[blk.piece]
                t = qpos[blk.q.slice]
                ks = kpos[piece.rows.slice][blk.k_off:blk.k_off + blk.nk]
                assert torch.equal(ks, torch.arange(blk.k_pos, blk.k_pos + blk.nk))
                sub = allowed[:, t[:, None], ks[None, :]]
                # (messages cut blocks after planning; a cut part may share nothing and is skipped when it runs)
                assert budget is not None or bool(sub.any()), "a block with no same-document pair was planned"
                for h in blk.q_heads:
                    cover[:, h, t[:, None], ks[None, :]] += sub.long()
    assert torch.equal(cover, allowed[:, None].long().expand_as(cover))
