"""The sharded cache keeps exactly the rows a later query can read, and generation does not change.

The index math is checked against brute force (every future query asked
which rows it reads, under tests/reference.py's masks and under the rules
``cached_blocks`` decodes with); the cache's bookkeeping on simulated ranks;
generation on 1, 2 and 3 gloo ranks against transformers' own ``generate``,
the float64-masked full forward (dilated) and the same run with eviction off.
"""
import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

import hf_ring
from hf_ring.generation.cache import ShardedCache
from hf_ring.generation.slots import EMPTY_SLOT, SlotTable, growth_rows
from hf_ring.engine.decode import cached_blocks
from hf_ring.engine.layout import local_positions
from hf_ring.engine.pattern import DENSE
from hf_ring.generation.retention import KEEP_ALL, last_reader, last_readers, layer_rules, rule_for
from hf_ring.integration.seams import CACHE_KEYWORD
from eviction_cases import evict_case
from helpers import dilated_sdpa_mask, rel_err
from models import load, saved_model_dir
from reference import dense_mask, dilated_multiplicity

BRANCHES = st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 5, 8, 12, 16]), st.sampled_from([1, 2, 3, 4, 8])),
                    min_size=1, max_size=3).map(tuple)


def rules_of(window, branches, hq, hkv):
    return rule_for(window, DENSE if branches is None else branches, hq, hkv)


def reference_reads(t_next, hq, hkv, window, branches):
    """``(hkv, t_next)``: which rows some query at t_next or later reads, per K/V head, from tests/reference.py masks."""
    horizon = t_next + (window or 0) + max([w for w, _ in branches or ()] + [1]) + 1  # every open segment ends before
    g = hq // hkv
    reads = torch.zeros(hkv, t_next, dtype=torch.bool)
    for h in range(hq):
        if branches is None:
            allowed = dense_mask(horizon, True, window)
        else:
            allowed = dilated_multiplicity(horizon, branches, h) > 0
        reads[h // g] |= allowed[t_next:, :t_next].any(0)
    return reads


def decoder_reads(t_next, hq, hkv, window, branches):
    """The same from the kernel calls ``cached_blocks`` makes for each future query."""
    horizon = t_next + (window or 0) + max([w for w, _ in branches or ()] + [1]) + 1
    k_pos = torch.arange(t_next)
    reads = torch.zeros(hkv, t_next, dtype=torch.bool)
    for t in range(t_next, horizon):
        for blk in cached_blocks(torch.tensor([t]), k_pos, hq=hq, hkv=hkv, window=window,
                                 branches=DENSE if branches is None else branches):
            rows = k_pos if blk.k_rows is None else blk.k_rows
            seen = rows if blk.mask is None else rows[blk.mask[0]]
            for u in blk.kv_heads:
                reads[u, seen] = True
    return reads


@settings(max_examples=150, deadline=None)
@given(hkv=st.integers(1, 3), g=st.sampled_from([1, 2, 3, 4]), window=st.one_of(st.none(), st.integers(1, 12)),
       branches=BRANCHES, dilated=st.booleans(), t_next=st.integers(1, 48))
def test_kept_rows_are_exactly_those_a_later_query_reads(hkv, g, window, branches, dilated, t_next):
    hq = hkv * g
    if dilated:
        window = None
    else:
        branches = None
    rule = rules_of(window, branches, hq, hkv)
    ref = reference_reads(t_next, hq, hkv, window, branches)
    assert torch.equal(ref, decoder_reads(t_next, hq, hkv, window, branches))
    for u in range(hkv):
        # A row stays in the cache while its last reader (what the cache's eviction reads) is still to come.
        got = rule.last_readers(torch.arange(t_next), u if rule.sets > 1 else 0) >= t_next
        want = ref[u] if rule.sets > 1 else ref.any(0)
        assert torch.equal(got, want), (u, got, want)
    for u in range(rule.sets):  # the integer version a decoding step uses gives the same
        pos = torch.arange(t_next + 20)
        whole = last_readers(pos, window=rule.window, branches=rule.branches, residues=rule.residues[u])
        assert whole.tolist() == [last_reader(p, window=rule.window, branches=rule.branches,
                                              residues=rule.residues[u]) for p in pos.tolist()]
    if rule.sets == 1:  # one row set for every K/V head only when they read the same rows
        assert all(torch.equal(ref[u], ref[0]) for u in range(hkv))


def test_rules_follow_layer_types_window_and_pattern():
    from transformers import AutoConfig

    gemma = AutoConfig.for_model("gemma3_text", num_hidden_layers=6, sliding_window=512, num_attention_heads=8,
                                 num_key_value_heads=4)
    rules = layer_rules(gemma)
    assert [r.window for r in rules] == [512] * 5 + [None] and rules[5] is KEEP_ALL
    assert layer_rules(gemma, evict=False) == (KEEP_ALL,) * 6
    mistral = AutoConfig.for_model("mistral", num_hidden_layers=3, sliding_window=64)
    assert [r.window for r in layer_rules(mistral)] == [64] * 3
    llama = AutoConfig.for_model("llama", num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)
    assert layer_rules(llama) == (KEEP_ALL, KEEP_ALL)
    hf_ring.configure(llama, pattern=hf_ring.DilatedPattern([8, 16], [1, 8]))
    (rule, _) = layer_rules(llama)
    assert rule.sets == 2 and rule.residues == (((0,), (0, 1, 2, 3)), ((0,), (4, 5, 6, 7)))
    hf_ring.configure(llama, pattern=hf_ring.DilatedPattern([8, 16], [1, 2]))
    assert layer_rules(llama)[0].sets == 1  # each K/V head's 4 query heads cover both residues


def held_after(rule, row_set, t_first, t_end):
    """Positions a row set must hold after a forward of the tokens ``[t_first, t_end)`` (prefill: both n)."""
    pos = torch.arange(t_end)
    last = rule.last_readers(pos, row_set)
    return set(pos[(last >= torch.clamp(pos, min=t_first))].tolist())


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 3), layout=st.sampled_from(["zigzag", "contiguous"]), n=st.integers(1, 60),
       window=st.one_of(st.none(), st.integers(1, 20)), branches=BRANCHES, g=st.sampled_from([1, 2, 4]),
       steps=st.lists(st.integers(1, 3), max_size=25))
def test_ranks_partition_the_visible_rows_and_agree_on_counts(world, layout, n, window, branches, g, steps):
    hkv = 2
    rule = rules_of(window, None if window is not None else branches, hkv * g, hkv)
    for s in range(rule.sets):
        sets = [SlotTable(rule, s, r, world) for r in range(world)]
        for rs in sets:
            rs.begin_prefill(n, local_positions(n, rs.rank, world, layout), layout, rebalance=world > 1)
        forwards = [(n, n)] + [(n + sum(steps[:i]), n + sum(steps[:i + 1])) for i in range(len(steps))]
        for i, (first, end) in enumerate(forwards):
            if i:
                for rs in sets:
                    rs.begin_step(first, end - first)
            held = [rs.held().tolist() for rs in sets]
            union = [p for h in held for p in h]
            assert len(union) == len(set(union)) and set(union) == held_after(rule, s, first, end)
            assert all(rs.counts == [len(h) for h in held] for rs in sets)
            if window is not None:  # each rank holds about its share of the window
                assert max(map(len, held)) <= -(-len(union) // world) + 1
                assert len(union) <= window - 1 + (end - first)


def test_layer_stores_the_rows_of_its_positions_in_bounded_bytes():
    window, b, h, d = 24, 2, 2, 4
    cache = ShardedCache(0, 1, "contiguous")
    cache.set_rules([rule_for(window, DENSE, 2, 2), KEEP_ALL])
    rows = torch.randn(b, h, 400, d)
    cache.begin_prefill(100)
    for layer in range(2):
        cache.update(rows[:, :, :100], -rows[:, :, :100], layer)
    assert cache.layers[0].nbytes() == 2 * b * h * (window - 1) * d * 4  # only the window's rows, no spare room
    for t in range(100, 400):
        cache.begin_step(1)
        keys, values = cache.update(rows[:, :, t:t + 1], -rows[:, :, t:t + 1], 0)
        full, _ = cache.update(rows[:, :, t:t + 1], -rows[:, :, t:t + 1], 1)
        ((pos, k, v),) = cache.layer_rows(0)
        live = pos != EMPTY_SLOT
        assert pos[live].tolist() == list(range(t - window + 1, t + 1))  # in order, whatever was evicted
        assert torch.equal(k[:, :, live], rows[:, :, pos[live]]) and torch.equal(v[:, :, live], -rows[:, :, pos[live]])
        assert torch.equal(keys, k) and cache.local_length(0) == window
        assert cache.layers[0].nbytes() <= 2 * b * h * d * 4 * (window + growth_rows(window))
        assert torch.equal(full, rows[:, :, :t + 1])
    cache.batch_select_indices(torch.tensor([1]))
    cache.begin_step(1)
    keys, _ = cache.update(torch.zeros(1, h, 1, d), torch.zeros(1, h, 1, d), 0)
    cache.update(torch.zeros(1, h, 1, d), torch.zeros(1, h, 1, d), 1)
    ((pos, _, _),) = cache.layer_rows(0)
    old = (pos != EMPTY_SLOT) & (pos < 400)
    assert torch.equal(keys[:, :, old], rows[1:, :, pos[old]])


def test_per_head_rows_and_refusals():
    rule = rule_for(None, ((8, 1), (16, 4)), 4, 4)
    assert rule.sets == 4
    cache = ShardedCache(0, 1, "contiguous")
    cache.set_rules([rule])
    rows = torch.randn(1, 4, 60, 2)
    cache.begin_prefill(50)
    cache.update(rows[:, :, :50], rows[:, :, :50], 0)
    for t in range(50, 60):
        cache.begin_step(1)
        cache.update(rows[:, :, t:t + 1], rows[:, :, t:t + 1], 0)
        for u, (pos, k, _) in enumerate(cache.layer_rows(0)):
            live = pos != EMPTY_SLOT
            assert set(pos[live].tolist()) == held_after(rule, u, t, t + 1)
            assert torch.equal(k[:, :, live], rows[:, u:u + 1, pos[live]])
    with pytest.raises(ValueError, match="another model's attention"):
        cache.set_rules([rule_for(None, ((8, 1), (16, 2)), 4, 4)])
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(-1)
    cache.set_rules([rule])  # the same rules continue


# --- generation ------------------------------------------------------------------------------------------

WINDOW = 8
NEW = 20
GREEDY = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
DILATED = hf_ring.DilatedPattern([8, 16, 32, 64], [1, 2, 4, 8])
ALTERNATING = ["sliding_attention", "full_attention"] * 2
GEMMA = ["sliding_attention"] * 5 + ["full_attention"]


def config_dir(name):
    if name == "mistral":
        return saved_model_dir("mistral", sliding_window=WINDOW)
    if name == "gpt_oss":
        return saved_model_dir("gpt_oss", sliding_window=WINDOW, num_hidden_layers=4, layer_types=ALTERNATING)
    if name == "gemma3":
        return saved_model_dir("gemma3_text", sliding_window=WINDOW, num_hidden_layers=6, layer_types=GEMMA)
    heads = {"dilated_g1": (4, 4), "dilated_g4": (8, 2)}[name]
    return saved_model_dir("llama", num_attention_heads=heads[0], num_key_value_heads=heads[1])


def prompt(name):
    g = torch.Generator().manual_seed(len(name))
    n = 70 if name.startswith("dilated") else 37
    ids = torch.randint(3, 97, (2, n), generator=g)
    mask = None
    if name == "mistral":  # left padding: the padding mask is read at each row set's own positions
        mask = torch.ones_like(ids)
        mask[0, :5], ids[0, :5] = 0, 0
    return ids, mask


@functools.lru_cache(maxsize=None)
def reference(name):
    """transformers' own generate (window families) or the full forward with LongNet masks (dilated)."""
    path, (ids, mask) = config_dir(name), prompt(name)
    if not name.startswith("dilated"):
        return load(path, "sdpa" if name == "mistral" else "eager").generate(ids, attention_mask=mask, **GREEDY)
    return None


def dilated_full_forward(name, seq, n):
    """Logits of the whole generated sequence in one forward, by transformers' sdpa with the reference's multiplicities."""
    model = load(config_dir(name), "sdpa")
    mask = dilated_sdpa_mask(seq.shape[1], DILATED.branches, model.config.num_attention_heads)
    with torch.no_grad():
        return model(input_ids=seq, attention_mask=mask, use_cache=False).logits[:, n - 1:-1]


def run(pools, world, name, **kw):
    path, (ids, mask) = config_dir(name), prompt(name)
    pattern = DILATED if name.startswith("dilated") else None
    if world == 1:
        return [evict_case(path, ids, mask, pattern=pattern, **dict(GREEDY, **kw))]
    return pools(world).run(evict_case, path, ids, mask, pattern=pattern, **dict(GREEDY, **kw))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["mistral", "gpt_oss", "gemma3", "dilated_g1", "dilated_g4"])
def test_generation_with_eviction_equals_generation_without(pools, world, name):
    results = run(pools, world, name)
    ids, _ = prompt(name)
    n = ids.shape[1]
    # rates up to 8 over 4 query heads leave positions unread, which hf_ring says (8 heads read them all)
    assert all(res["unread"] == (name == "dilated_g1") for res in results), [res["unread"] for res in results]
    first = results[0][True]
    for res in results:
        on, off = res[True], res[False]
        assert torch.equal(on["sequences"], first["sequences"]) and torch.equal(off["sequences"], on["sequences"])
        assert rel_err(on["logits"], off["logits"]) <= 1e-6
    ref = reference(name)
    if ref is not None:
        assert torch.equal(first["sequences"], ref)
    else:
        assert rel_err(first["logits"], dilated_full_forward(name, first["sequences"], n)) <= 1e-5
    assert len(set(first["sequences"][0, n:].tolist())) > 2  # the tokens vary: the comparison means something
    check_held(results, world, n, ids.shape[0])


def check_held(results, world, n, batch):
    """Across ranks each row set holds exactly the rows a later query reads; a window's rows are shared out."""
    rules = results[0][True]["rules"]
    assert any(rule.evicts for rule in rules)
    held = [res[True]["held"] for res in results]
    for f in range(len(held[0])):
        first = n if f == 0 else n + f - 1
        end = n if f == 0 else first + 1
        for layer, rule in enumerate(rules):
            for s in range(rule.sets):
                parts = [h[f][layer][0][s].tolist() for h in held]
                union = [p for part in parts for p in part]
                assert len(union) == len(set(union)) and set(union) == held_after(rule, s, first, end), (f, layer, s)
            if rule.window is not None:
                share = -(-rule.window // world) + 1
                assert max(len(h[f][layer][0][0]) for h in held) <= share, (f, layer)
                row_bytes = 2 * batch * results[0][True]["kv_row_bytes"][layer]
                assert max(h[f][layer][1] for h in held) <= row_bytes * (share + growth_rows(share))


def test_continuing_a_returned_cache_evicts_the_same(pools):
    results = run(pools, 2, "gemma3", max_new_tokens=8, continue_with=NEW - 8)
    ids, _ = prompt("gemma3")
    model = load(config_dir("gemma3"), "eager")  # transformers' own cache, continued the same way
    out = model.generate(ids, **dict(GREEDY, max_new_tokens=8, return_dict_in_generate=True))
    ref = model.generate(out.sequences, **{CACHE_KEYWORD: getattr(out, CACHE_KEYWORD)},
                         **dict(GREEDY, max_new_tokens=NEW - 8))
    for res in results:
        assert torch.equal(res[True]["sequences"], ref)
        assert rel_err(res[True]["logits"], res[False]["logits"]) <= 1e-6
    check_held(results, 2, ids.shape[1], ids.shape[0])


def test_a_cache_continues_only_with_its_own_rules():
    ids, _ = prompt("mistral")
    model = load(config_dir("mistral"), "ring_dilated")
    out = hf_ring.generate(model, ids, max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    other = load(saved_model_dir("mistral", sliding_window=WINDOW + 4), "ring_dilated")
    with pytest.raises(ValueError, match="another model's attention"):
        hf_ring.generate(other, out.sequences, max_new_tokens=3, do_sample=False, pad_token_id=0,
                         past_key_values=out.past_key_values)


def test_a_config_that_misstates_the_heads_is_refused():
    """The cache keeps a dilated layer's rows per K/V head from the config's head counts; a config whose counts
    are not the layers' own would keep the wrong rows. (Windows and layer types cannot disagree so: the model
    builds its masks, which ring_dilated follows, from the config at each forward.)"""
    ids, _ = prompt("dilated_g4")
    model = load(config_dir("dilated_g4"), "ring_dilated")
    hf_ring.configure(model, pattern=DILATED)
    model.config.num_attention_heads = 4  # the layers still have 8 query heads
    with pytest.raises(ValueError, match="does not say what its attention does"), \
            pytest.warns(UserWarning, match="with 4 query heads leaves positions unread"):
        hf_ring.generate(model, ids, **GREEDY)
