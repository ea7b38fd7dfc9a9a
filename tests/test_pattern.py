"""DilatedPattern: validation, (de)serialisation, cost estimate; and the pattern/window combination."""
import json

import pytest
import torch

import hf_ring
from hf_ring import DilatedPattern
from hf_ring.engine.pattern import head_groups


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


def test_geometric_pattern_costs_linearly_and_every_residue_is_a_heads():
    """The linear preset (``finetune.py --dilated linear``: base 1024, 16 heads): twice the length costs about twice
    as much while n <= base × heads, and no position is unread by every head."""
    costs = {}
    for n in (1 << 14, 1 << 15, 1 << 16):
        pattern = DilatedPattern.geometric(n, 1024, 16)
        assert pattern.segment_lengths[0] == 1024 and pattern.segment_lengths[-1] == n
        assert max(pattern.dilation_rates) <= 16 and pattern.coverage_gaps(16) == []
        costs[n] = pattern.flops(n, 16, 16)
    assert costs[1 << 15]["pattern"] / costs[1 << 14]["pattern"] == pytest.approx(2.0, rel=0.1)
    assert costs[1 << 16]["pattern"] / costs[1 << 15]["pattern"] < 2.5  # dense: 4
    assert costs[1 << 15]["ratio"] < 0.1 and costs[1 << 16]["ratio"] < 0.05
    # the preset's 32K pattern (base 2048): linear up to base × heads = 32K, fully covered
    at32, at16 = DilatedPattern.geometric(1 << 15, 2048, 16), DilatedPattern.geometric(1 << 14, 2048, 16)
    assert at32.dilation_rates == (1, 2, 4, 8, 16) and at32.coverage_gaps(16) == []
    growth = at32.flops(1 << 15, 16, 16)["pattern"] / at16.flops(1 << 14, 16, 16)["pattern"]
    assert growth == pytest.approx(2.0, rel=0.1)
    assert at32.flops(1 << 15, 16, 16)["ratio"] < 0.2
    # the preset at 64K (base 4096 = n / heads): all five branches within base × heads, an eighth of dense
    at64 = DilatedPattern.geometric(1 << 16, 4096, 16)
    assert at64.dilation_rates == (1, 2, 4, 8, 16) and at64.coverage_gaps(16) == []
    assert at64.flops(1 << 16, 16, 16)["ratio"] == pytest.approx(at32.flops(1 << 15, 16, 16)["ratio"], rel=0.01)
    assert at64.flops(1 << 16, 16, 16)["ratio"] < 0.13


def test_geometric_pattern_edges():
    assert DilatedPattern.geometric(16384, 2048, 16) == DilatedPattern([2048, 4096, 8192, 16384], [1, 2, 4, 8])
    assert DilatedPattern.geometric(100, 64, 4) == DilatedPattern([64, 100], [1, 2])  # the last segment is n
    assert DilatedPattern.geometric(32, 1024, 4) == DilatedPattern([32], [1])  # shorter than the base: dense
    assert DilatedPattern.geometric(4096, 512, 2).dilation_rates == (1, 2, 2, 2)  # capped at max_rate
    for bad in ({"seq_len": 0}, {"base_segment": -1}, {"max_rate": 0}):
        kwargs = {"seq_len": 64, "base_segment": 8, "max_rate": 4, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            DilatedPattern.geometric(**kwargs)


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


def _reading_positions(pattern, heads, n, start, end):
    """Positions that read some key at a distance in [start, end) through some head, by brute force over the
    float64 reference's multiplicities (independent of the coverage arithmetic)."""
    import reference as R

    seen = torch.zeros(n, n, dtype=torch.bool)
    for h in range(heads):
        seen |= R.dilated_multiplicity(n, pattern.branches, h) > 0
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    return int((seen & (d >= start) & (d < end)).any(1).sum())


@pytest.mark.parametrize("lengths,rates,heads", [
    ([8, 16, 32, 64], [1, 2, 4, 8], 4),
    ([8, 16, 32, 64], [1, 2, 4, 8], 2),
    ([8, 16, 32, 64], [1, 2, 4, 8], 1),
    ([12, 24, 48], [1, 3, 4], 2),
    ([12, 24, 48], [1, 3, 4], 3),
    ([16, 64], [1, 4], 4),
    ([64, 16], [1, 8], 2),  # the dense-enough branch is the longer one: nothing is blind
])
def test_coverage_gaps_match_brute_force(lengths, rates, heads):
    pattern = DilatedPattern(lengths, rates)
    n = 2 * max(lengths)
    gaps = {(g.start, g.end): g.share for g in pattern.coverage_gaps(heads)}
    enough = max(rates)  # every residue of every branch is some head's offset
    edges = sorted(set(lengths) | {0})
    for start, end in zip(edges, edges[1:]):
        full = _reading_positions(pattern, enough, n, start, end)
        got = _reading_positions(pattern, heads, n, start, end)
        share = gaps.get((start, end), 0.0)
        assert got == pytest.approx(full * (1 - share)), (start, end, full, got, share)


def test_coverage_message_names_the_distances_the_share_and_the_fix():
    pattern = DilatedPattern([512, 1024, 2048, 4096], [1, 2, 4, 8])
    message = hf_ring.engine.pattern.coverage_message(pattern, 4)
    assert "50% at distances 2048-4095" in message and "rates [8] read offsets 0-3" in message, message
    assert "dilation rates of at most 4" in message
    assert hf_ring.engine.pattern.coverage_message(pattern, 8) is None
    assert hf_ring.engine.pattern.coverage_message(DilatedPattern([1024, 2048, 4096], [1, 2, 4]), 4) is None
    # rates above the heads cost positions near segment starts even below the longest fully read segment
    gaps = DilatedPattern([12, 24, 48], [1, 3, 4]).coverage_gaps(3)
    assert [(g.start, g.end, g.rates) for g in gaps][:1] == [(12, 24, (4,))]
    with pytest.raises(ValueError, match="num_heads"):
        pattern.coverage_gaps(0)


def test_configure_warns_when_the_heads_leave_positions_unread(recwarn):
    import warnings

    from models import tiny_config

    config = tiny_config()  # 4 query heads
    with pytest.warns(UserWarning, match=r"with 4 query heads leaves positions unread.*50% at distances 32-63"):
        hf_ring.configure(config, DilatedPattern([16, 32, 64], [1, 2, 8]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_ring.configure(config, DilatedPattern([16, 32, 64], [1, 2, 4]))


def test_a_model_whose_saved_pattern_leaves_positions_unread_warns_at_its_forward(tmp_path):
    from transformers import AutoModelForCausalLM

    from models import tiny_config

    config = tiny_config()
    config.ring_dilated = {"segment_lengths": [8, 16, 32], "dilation_rates": [1, 2, 8], "layout": "zigzag"}
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="ring_dilated")
    with pytest.warns(UserWarning, match=r"with 4 query heads leaves positions unread.*at distances 16-31"):
        model(input_ids=torch.arange(40).view(1, 40))
