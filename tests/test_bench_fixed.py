"""``python -m bench fixed``'s timing fields: medians over all rounds, and each ratio's spread round by round."""
from bench import fixed


def test_timing_fields_pair_the_sides_of_each_round():
    sdpa = [[1.0, 1.0, 1.2], [2.0, 2.0, 2.0]]  # the second round ran on a slower machine, for every side
    ring = [[1.5, 1.5, 1.5], [2.8, 2.8, 2.8]]
    unfused = [[1.8, 1.8, 1.8], [3.0, 3.2, 3.2]]
    one_ring = [[1.1, 1.1, 1.1], [2.2, 2.2, 2.2]]  # ring_dilated in the process that timed sdpa
    got = fixed.timing_fields(sdpa, ring, unfused, one_ring, layers=4)
    assert (got["sdpa_ms"], got["ring_ms"], got["unfused_ms"]) == (1600.0, 2150.0, 2400.0)  # medians of all steps
    assert got["ring_over_sdpa"] == round(2.15 / 1.6, 3) and got["fused_over_unfused"] == round(2.15 / 2.4, 3)
    assert got["ratio_spread"] == "1.400–1.500"  # 2.8 / 2.0 and 1.5 / 1.0: each round against its own sdpa
    assert got["unfused_ratio_spread"] == "1.600–1.800"
    assert got["fused_over_unfused_spread"] == "0.833–0.875"
    assert got["one_process_ring_over_sdpa"] == round(1.65 / 1.6, 3)
    assert got["host_ms_per_layer"] == round(1e3 * (1.65 - 1.6) / 4, 2)
