"""DilatedPattern: validation, (de)serialisation, cost estimate; and the pattern/window combination."""
import json

import pytest
import torch

import hf_ring
from hf_ring import DilatedPattern
from hf_ring.pattern import head_groups


def test_round_trip_through_json():
    p = DilatedPattern([2048, 4096], [1, 2])
    again = DilatedPattern.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p and again.branches == ((2048, 1), (4096, 2))


@pytest.mark.parametrize(
    "lengths,rates,exc,match",
    [
        ([64, 128], [1], ValueError, "2 entries but dilation_rates has 1"),
        ([], [], ValueError, "at least one"),
        ([0], [1], ValueError, "positive"),
        ([64], [-2], ValueError, "positive"),
        ([64.0], [1], TypeError, "ints"),
        ([64], [True], TypeError, "ints"),
        ("64", [1], TypeError, "list of positive ints"),
    ],
)
def test_validation(lengths, rates, exc, match):
    with pytest.raises(exc, match=match):
        DilatedPattern(lengths, rates)


def test_from_dict_rejects_unknown_and_missing_keys():
    with pytest.raises(ValueError, match="unknown pattern keys"):
        DilatedPattern.from_dict({"segment_lengths": [8], "dilation_rates": [1], "window": 3})
    with pytest.raises(ValueError, match="missing"):
        DilatedPattern.from_dict({"segment_lengths": [8]})


def test_flops_dense_branch_equals_dense_and_dilation_is_linear():
    dense = DilatedPattern([4096], [1]).flops(4096, 8, 64)
    assert dense["ratio"] == pytest.approx(1.0)
    longnet = DilatedPattern([2048, 4096, 8192, 16384, 32768, 65536], [1, 2, 4, 8, 16, 32])
    f64, f256 = longnet.flops(1 << 16, 8, 64)["pattern"], longnet.flops(1 << 18, 8, 64)["pattern"]
    assert f256 / f64 == pytest.approx(4.0, rel=0.05)
    assert longnet.flops(1 << 16, 8, 64)["ratio"] < 0.1


def test_head_groups_pair_each_query_head_with_its_kv_head():
    for hq, hkv in [(8, 8), (4, 2), (6, 2), (12, 4), (8, 1)]:
        g = hq // hkv
        for r in (1, 2, 3, 4, 8):
            for o in range(r):
                seen = []
                for qs, ks in head_groups(hq, hkv, r, o):
                    per = len(qs) // len(ks)
                    assert per * len(ks) == len(qs)
                    for i, h in enumerate(qs):
                        assert h % r == o and ks[i // per] == h // g
                        seen.append(h)
                assert sorted(seen) == list(range(o, hq, r))


def test_pattern_with_window_is_refused():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="pattern and window cannot be combined"):
        hf_ring.ring_attention(q, q, q, window=4, pattern=DilatedPattern([4], [1]))
    with pytest.raises(TypeError, match="pattern must be"):
        hf_ring.ring_attention(q, q, q, pattern=[(4, 1)])
