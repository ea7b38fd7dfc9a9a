"""Hybrid models (linear attention, Mamba, convolutions beside attention) with their sequence split: exact.

The hooks on transformers' own kernels are checked twice: at the kernel's level, the real torch path under the
hooks on 2 ranks against a float64 recurrence on the whole sequence (tests/reference.py); and whole models of
every hybrid family on 2 and 4 ranks, padded, with head parallelism, against one process, the scans of both runs
replaced by the float64 recurrences (hybrid_models.float64_kernels says why).
"""
import functools

import pytest
import torch

import hybrid_cases
from helpers import close, rel_err

TOL = 1e-5
COMPAT = pytest.mark.compat  # also run on the floor release and the newest unpinned ones (.ci/run)
RANKS = [pytest.param(2, 1, id="2-ranks", marks=COMPAT), pytest.param(4, 2, id="4-ranks-heads2")]
# The scans run in float64 (their float64 recurrences) and so do hf_ring's state corrections; the models around them
# are float32 (norms, projections, attention): worst 2.6e-6 over three roundings (AVX-512 with one thread, scalar
# kernels ATEN_CPU_CAPABILITY=default, AVX2 with two threads), Nemotron-H under the Trainer.


@pytest.mark.parametrize("scan_rows", [None, 7], ids=["runs-whole", "runs-of-7"])
@pytest.mark.parametrize("kind", list(hybrid_cases.KERNELS))
def test_a_hooked_kernel_over_two_ranks_equals_the_float64_recurrence(pools, kind, scan_rows):
    """transformers' torch path of each kernel under its hook on 2 ranks, each run whole or cut into pieces of at
    most 7 rows whose states compose (as long runs are): output, end state and every gradient."""
    want = hybrid_cases.reference_kernel(kind)
    got = pools(2).run(hybrid_cases.kernel_case, kind, scan_rows)
    out = torch.zeros_like(want["out"])
    for res in got:
        index = [slice(None)] * out.dim()
        index[hybrid_cases.SEQUENCE_AXIS.get(kind, 1)] = res["rows"]
        out[tuple(index)] = res["out"].double()
    errs = {"out": rel_err(out, want["out"])}
    errs.update({f"grad {i}": rel_err(g, w) for i, (g, w) in enumerate(zip(got[0]["grads"], want["grads"]))})
    if want["final"] is not None:  # every rank ends with the whole sequence's state
        errs.update({f"final on rank {r}": rel_err(res["final"], want["final"]) for r, res in enumerate(got)})
    worst = max(errs, key=errs.get)
    assert close(errs[worst], TOL), (worst, errs[worst])


@pytest.mark.parametrize("scan_rows", [None, 7], ids=["runs-whole", "runs-of-7"])
def test_lightning_attention_over_two_ranks_equals_the_float64_recurrence(pools, scan_rows):
    """MiniMax's lightning attention layer (its own forward, the kernel hooked) on 2 ranks, each run whole or cut into
    pieces of at most 7 rows, against its recurrence one row at a time on the whole sequence: output, end state on
    every rank, and the gradients of the input and every parameter."""
    want = hybrid_cases.lightning_reference()
    got = pools(2).run(hybrid_cases.lightning_case, scan_rows)
    out = torch.zeros_like(want["out"])
    for res in got:
        out[:, res["rows"]] = res["out"]
    errs = {"out": rel_err(out, want["out"])}
    errs.update({f"final on rank {r}": rel_err(res["final"], want["final"]) for r, res in enumerate(got)})
    errs.update({f"grad {i}": rel_err(g, w) for i, (g, w) in enumerate(zip(got[0]["grads"], want["grads"]))})
    worst = max(errs, key=errs.get)
    assert close(errs[worst], TOL), (worst, errs[worst])


def check_family(got, want):
    errs = {"loss": rel_err(got["loss"], want["loss"]),
            **{name: rel_err(got["grads"][name], g) for name, g in want["grads"].items()}}
    assert set(got["grads"]) == set(want["grads"])
    worst = max(errs, key=errs.get)
    assert close(errs[worst], TOL), (worst, errs[worst])


@pytest.mark.parametrize("world, ulysses", RANKS)
@pytest.mark.parametrize("model_type", hybrid_cases.FAMILIES)
def test_a_hybrid_family_step_with_padded_rows_equals_one_process(pools, model_type, world, ulysses):
    """Three recurrent layers then one attention layer; a left- and a right-padded row; on 4 ranks the attention
    runs head-parallel in groups of 2 with the ring across them, the recurrent layers pass their state over all 4."""
    want = hybrid_cases.family_reference(model_type)
    check_family(pools(world).run(hybrid_cases.family_case, model_type, ulysses)[0], want)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "kimi_linear", "nemotron_h", "jamba"])
def test_runs_cut_into_short_pieces_equal_one_process(pools, model_type, packed):
    """Each rank's runs cut every 5 rows (as a long sequence's are, every SCAN_ROWS rows), beside the document
    starts of a packed row: every piece's state composed with the others', equal to one process (the padded
    batch) or to the documents run one by one (the packed row); one layer kind each: delta rule, KDA, Mamba2,
    Mamba."""
    want = documents_apart(model_type) if packed else hybrid_cases.family_reference(model_type)
    check_family(pools(2).run(hybrid_cases.family_case, model_type, packed=packed, scan_rows=5)[0], want)


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache-made"])
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_a_long_row_in_one_process_runs_its_scans_in_pieces(model_type, use_cache):
    """A row longer than SCAN_ROWS given to a ring_dilated hybrid in one process (no hf_ring call; no cache, or a new
    one the model makes and fills): every scan runs in pieces of at most SCAN_ROWS rows, each from the state the one
    before ended in, each piece run again in the backward (checkpointed: what the kernel keeps exists for one piece
    at a time), and the loss and every gradient equal transformers' own forward over the whole row."""
    from hf_ring.engine.recurrence import SCAN_ROWS

    rows = SCAN_ROWS + 37
    want = hybrid_cases.long_row(model_type, "sdpa", rows, use_cache)
    got = hybrid_cases.long_row(model_type, "ring_dilated", rows, use_cache)
    assert want["calls"] and set(want["calls"]) == {rows} and not want["recomputed"], want
    assert got["calls"] == [SCAN_ROWS, 37] * len(want["calls"]), got["calls"]  # two pieces per scan call
    assert sorted(got["recomputed"]) == sorted(got["calls"]), got["recomputed"]
    check_family(got, want)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_model_generate_in_one_process_runs_a_long_prompt_in_pieces(model_type):
    """transformers' own generate on a ring_dilated hybrid, a prompt longer than SCAN_ROWS: its prefill (a new cache,
    filled) runs every scan in pieces, the states it leaves in the cache are the whole prompt's (each later step's
    logits equal those of the same generate with sdpa, whose scans run the prompt whole), and the tokens are the
    same."""
    from hf_ring.engine.recurrence import SCAN_ROWS

    rows = SCAN_ROWS + 37
    want = hybrid_cases.long_prompt(model_type, "sdpa", rows)
    got = hybrid_cases.long_prompt(model_type, "ring_dilated", rows)
    assert want["calls"] and set(want["calls"]) == {rows}, want["calls"]
    assert got["calls"] == [SCAN_ROWS, 37] * len(want["calls"]), got["calls"]
    assert got["tokens"] == want["tokens"]
    assert rel_err(got["logits"], want["logits"]) <= TOL, rel_err(got["logits"], want["logits"])


def _mamba_state_name() -> str:
    """What Mamba2's forward takes its carried state by in this release: ``cache_params`` (before 5.25, where the
    name is deprecated), or the cache's own name."""
    import inspect

    from transformers import Mamba2ForCausalLM

    from hf_ring.integration.seams import CACHE_KEYWORD

    return "cache_params" if "cache_params" in inspect.signature(Mamba2ForCausalLM.forward).parameters \
        else CACHE_KEYWORD


@pytest.mark.parametrize("model_type, pattern, name", [
    ("qwen3_5_text", "hybrid", hybrid_cases.CACHE_KEYWORD), ("mamba2", "recurrent", _mamba_state_name()),
    ("rwkv", "recurrent", "state")], ids=["qwen3_5-cache", "mamba2-state", "rwkv-state"])
def test_a_long_call_continuing_a_cache_in_one_process_equals_transformers(model_type, pattern, name):
    """A call longer than SCAN_ROWS given what an earlier call left, under whatever name the model takes it (the
    cache, Mamba's cache_params, RWKV's state list): it continues from that state as transformers' own path does,
    not from zero in pieces."""
    from hf_ring.engine.recurrence import SCAN_ROWS

    want = hybrid_cases.continued(model_type, "sdpa" if pattern == "hybrid" else "eager", pattern, name,
                                  then=SCAN_ROWS + 20)
    got = hybrid_cases.continued(model_type, "ring_dilated", pattern, name, then=SCAN_ROWS + 20)
    assert rel_err(got, want) <= TOL, rel_err(got, want)


def test_model_generate_in_one_process_on_minimax():
    """transformers' own generate on a ring_dilated MiniMax: its cache reports no rows to the mask sizes, so each
    decoding step's mask is made for the new row alone; the step attends every cached row (as sdpa's does), giving
    sdpa's tokens and logits, where it was refused."""
    want = hybrid_cases.long_prompt("minimax", "sdpa", 20)
    got = hybrid_cases.long_prompt("minimax", "ring_dilated", 20)
    assert got["tokens"] == want["tokens"]
    assert rel_err(got["logits"], want["logits"]) <= TOL, rel_err(got["logits"], want["logits"])


def test_rwkv_filling_its_state_list_under_gradients_equals_eager():
    """RWKV in evaluation mode with gradients on and its cache on (it then writes the state list's row over each time
    shift's first row, in place): a row longer than SCAN_ROWS in one process gives eager's loss and gradients."""
    from hf_ring.engine.recurrence import SCAN_ROWS

    rows = SCAN_ROWS + 37
    want = hybrid_cases.long_row("rwkv", "eager", rows, True, "recurrent")
    check_family(hybrid_cases.long_row("rwkv", "ring_dilated", rows, True, "recurrent"), want)


def test_a_scan_given_a_state_in_one_process_runs_whole_from_it():
    """A state to start from, given to a scan in one process (a layer that keeps its state on the module, called
    again): the kernel runs whole from it, as without hf_ring, not in pieces from zero (over shards it is refused)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    from hf_ring.integration.context import ShardedForward
    from hf_ring.patches.recurrent import DELTA, hooked

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    gate = -torch.rand(1, 20, 2, generator=g, dtype=torch.float64)
    beta = torch.rand(1, 20, 2, generator=g, dtype=torch.float64)
    state = torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64)
    kernel = qn.torch_chunk_gated_delta_rule
    want = kernel(q, k, v, gate, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    got = hooked(DELTA, kernel, ShardedForward.over(None, 20, "contiguous", scan_rows=7))(
        q, k, v, gate, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(got[0], want[0]) <= TOL and rel_err(got[1], want[1]) <= TOL


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_a_hybrid_step_with_tiling_checkpointing_and_offload_equals_one_process(pools, model_type):
    """What a long step runs with: the loss (both), the MLP and norms (Qwen3.5) tiled over chunks that do not divide
    a rank's rows, checkpointed layers recomputing their recurrent layers' exchanges, their inputs offloaded."""
    want = hybrid_cases.family_reference(model_type)
    got = pools(2).run(hybrid_cases.family_case, model_type, memory=True)[0]
    check_family(got, want)
    runs, mixers = got["mixer_runs"]
    assert mixers and runs == 2 * mixers, got["mixer_runs"]  # each recurrent layer recomputed in the backward


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_a_hybrid_with_dilated_attention_on_two_ranks_equals_the_reference(pools, model_type):
    """A dilated pattern on the hybrid's attention layers (three branches), its recurrent layers exact beside them:
    on 2 ranks, the loss and every gradient equal one process whose attention is the float64 dilated reference."""
    want = hybrid_cases.dilated_step(model_type)
    check_family(pools(2).run(hybrid_cases.dilated_step, model_type)[0], want)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "jamba"])
def test_a_sequence_shorter_than_the_ranks_equals_one_process(pools, model_type):
    """3 tokens on 4 ranks: one rank holds no row and runs a placeholder row; it still joins every exchange."""
    want = hybrid_cases.family_reference(model_type, n=3)
    check_family(pools(4).run(hybrid_cases.family_case, model_type, 1, 3)[0], want)


@functools.lru_cache(maxsize=None)
def documents_apart(model_type):
    return hybrid_cases.family_reference(model_type, packed=True)


@pytest.mark.parametrize("model_type", hybrid_cases.FAMILIES)
def test_packed_rows_in_one_process_keep_their_documents_apart(model_type):
    """A row packing four documents (position ids restarting, no mask, no cache) given to a ring_dilated hybrid in
    one process, as a padding-free training loop gives it: every recurrent layer starts each document from a zero
    state and its convolution sees no row of the document before; the loss and every gradient equal the documents'
    run one by one. transformers' own path (sdpa) mixes them, so the comparison can fail."""
    want = documents_apart(model_type)
    check_family(hybrid_cases.packed_one_process(model_type), want)
    mixed = hybrid_cases.packed_one_process(model_type, attn="sdpa")
    assert rel_err(mixed["loss"], want["loss"]) > 1e3 * TOL or \
        max(rel_err(mixed["grads"][k], g) for k, g in want["grads"].items()) > 1e3 * TOL


@pytest.mark.parametrize("world, ulysses", RANKS)
@pytest.mark.parametrize("model_type", hybrid_cases.FAMILIES)
def test_packed_rows_over_ranks_keep_their_documents_apart(pools, model_type, world, ulysses):
    """The packed row split over 2 ranks (zigzag: documents across ranks and runs, several on one rank, one inside
    a run) and over 4 with head parallelism: equal to the documents run one by one."""
    check_family(pools(world).run(hybrid_cases.family_case, model_type, ulysses, packed=True)[0],
                 documents_apart(model_type))


SKEWED = (40, 3, 1, 5, 2, 6, 4, 3, 7)
"""One long document, then short ones (one of a single row): ``balanced`` cuts the long one over every rank and
deals the short ones whole, so a rank holds many runs and documents start inside them."""


@pytest.mark.parametrize("world, ulysses", RANKS)
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_packed_rows_balanced_by_document_keep_their_documents_apart(pools, model_type, world, ulysses):
    """``layout="balanced"`` on a skewed packing: the recurrent layers' runs and state passing, their
    convolutions' halos and attention follow the plan; equal to the documents run one by one."""
    want = hybrid_cases.family_reference(model_type, packed=True, batch=hybrid_cases.packed_batch(lengths=SKEWED))
    check_family(pools(world).run(hybrid_cases.family_case, model_type, ulysses, packed=True, layout="balanced",
                                  documents=SKEWED)[0], want)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_trainer_with_prepare_trainer_equals_one_process(pools, model_type):
    """Two optimizer steps of transformers.Trainer on 2 ranks: every logged loss and every step's gradients."""
    from test_trainer import check_steps

    import hybrid_models

    path = hybrid_models.saved(model_type)
    res = pools(2).run(hybrid_cases.trainer_case, model_type, path, 2, predict_rows=0)[0]
    check_steps(res, hybrid_cases.trainer_case(model_type, path, predict_rows=0))


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2"])
def test_sft_trainer_with_prepare_trainer_equals_one_process(pools, model_type):
    pytest.importorskip("trl")
    import hybrid_models
    from test_trainer import check_steps
    from trainer_cases import example

    sft = example("sft")
    path = hybrid_models.saved(model_type, vocab_size=len(sft.char_tokenizer()))
    res = pools(2).run(hybrid_cases.sft_case, model_type, path, 2)[0]
    check_steps(res, hybrid_cases.sft_case(model_type, path))


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h", "lfm2"])
def test_sft_trainer_padding_free_keeps_a_hybrids_rows_apart(pools, model_type):
    """TRL's SFTTrainer with padding_free=True (each batch one packed row, position ids restarting): in one process
    (as TRL runs it, and through prepare_trainer) and on 2 ranks through prepare_trainer, every logged loss and every
    step's gradient equal the same rows padded apart."""
    pytest.importorskip("trl")
    import hybrid_models
    from test_trainer import check_steps
    from trainer_cases import example

    path = hybrid_models.saved(model_type, vocab_size=len(example("sft").char_tokenizer()))
    apart = hybrid_cases.sft_case(model_type, path)
    check_steps(hybrid_cases.sft_case(model_type, path, padding_free=True, attn="ring_dilated"), apart)
    check_steps(hybrid_cases.sft_case(model_type, path, 1, padding_free=True), apart)
    check_steps(pools(2).run(hybrid_cases.sft_case, model_type, path, 2, padding_free=True)[0], apart)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_trl_packing_keeps_a_hybrids_documents_apart_in_one_process(model_type):
    """TRL's packing=True (best-fit decreasing, documents reordered into rows, two rows collated padding-free with
    cu_seq_lens and seq_idx) handed to a ring_dilated hybrid in one process: the loss and every gradient equal the
    documents run one by one."""
    pytest.importorskip("trl")
    batch = hybrid_cases.bfd_batch()
    want = hybrid_cases.family_reference(model_type, packed=True, batch=batch)
    check_family(hybrid_cases.packed_one_process(model_type, batch=batch), want)


@pytest.mark.parametrize("world, ulysses", [(2, 1), (4, 2)], ids=["2-ranks", "4-ranks-heads2"])
def test_qwen3_5_with_images_splits_its_hybrid_language_model(pools, world, ulysses):
    """Qwen3.5 as an image-text-to-text model: the towers see whole images, the hybrid language model is split
    after they merge; the loss and every gradient (tower and projector included) equal one process's."""
    from vlm import HYBRIDS
    from vlm_cases import step, worst

    path = HYBRIDS["qwen3_5"].build()
    want = step("qwen3_5", path)
    for rank, result in enumerate(pools(world).run(step, "qwen3_5", path, ulysses=ulysses)):
        key, err, _ = worst(result, want)
        assert close(err, TOL), (rank, key, err)


GENERATED = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h", "granitemoehybrid", "jamba", "bamba",
             "falcon_h1", "lfm2", "lfm2_moe", "olmo_hybrid", "bailing_hybrid", "kimi_linear", "recurrent_gemma", "zamba", "zamba2", "minimax",
             # multi-head latent attention without a recurrence: value heads narrower than the query and key heads
             "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "longcat_flash", "youtu")
"""Every hybrid type the training path takes, and every type of multi-head latent attention that builds tiny."""


def saved_here(model_type: str) -> str:
    """The type's tiny hybrid, saved; skipped where this transformers does not ship the type, or, below the newest
    release tested (the compatibility runs), cannot build it tiny; on that release and every newer one (what pip
    gives a newcomer) a type that does not build fails."""
    import hybrid_models
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from hf_ring.versions import NEWEST_TESTED, parse

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    try:
        return hybrid_models.saved(model_type)
    except AssertionError as err:
        if parse(transformers.__version__)[:2] >= parse(NEWEST_TESTED["transformers"])[:2]:
            raise
        pytest.skip(f"transformers {transformers.__version__} does not build a tiny {model_type}: {err}")


@pytest.mark.parametrize("world", [pytest.param(1, marks=COMPAT), pytest.param(2, marks=COMPAT), 4])
@pytest.mark.parametrize("model_type", GENERATED)
def test_generate_gives_model_generate_tokens(pools, model_type, world):
    """The prefill split over the ranks, each recurrent layer's end state (its convolution's last rows, its scan's
    state) on every rank, the attention's cache sharded; then every rank decodes the same tokens. Kimi Linear's
    attention layers are multi-head latent attention: value heads narrower than its query and key heads. Falcon-H1's
    decoder layers run attention and a Mamba mixer side by side: one cache layer holds both. The tokens are
    ``model.generate``'s; every step's logits those of ``model.generate`` or of the model on the whole generated
    sequence in one forward without a cache: on a left-padded row transformers' two part ways (by 0.4% on MiniMax,
    whose cache class of its own hf_ring.generate's agrees with the whole sequence; by 5e-4 on RecurrentGemma, whose
    generate hf_ring's agrees with)."""
    path = saved_here(model_type)
    want, generated = hybrid_cases.generate_case(model_type, path, logits=True)
    whole = hybrid_cases.whole_sequence_logits(model_type, path, want)
    if world == 1:  # hf_ring.generate in one process: the layers as they are, its cache holding their states
        found = [hybrid_cases.generate_case(model_type, path, ring=True, logits=True)]
    else:
        found = pools(world).run(hybrid_cases.generate_case, model_type, path, logits=True)
    for rank, (got, logits) in enumerate(found):
        assert torch.equal(got, want), (rank, got, want)
        errs = {name: max(rel_err(logits[i], ref[i]) for i in range(len(ref)))  # every step's, every rank's
                for name, ref in (("model.generate", generated), ("whole sequence", whole))}
        assert close(min(errs.values()), TOL), (rank, errs)


STATE_SPACE = ("mamba", "falcon_mamba", "mamba2", "rwkv")
"""Models with no attention: every layer mixes by its scan (RWKV: its WKV and two row shifts), which hf_ring computes
over shards."""


@pytest.mark.parametrize("world", [pytest.param(2, marks=COMPAT), 4])
@pytest.mark.parametrize("model_type", STATE_SPACE)
def test_a_state_space_model_over_ranks_equals_one_process_and_generates_its_tokens(pools, model_type, world):
    """Two Mamba, Mamba2 or RWKV layers and nothing else (their own model classes, which hand the layers none of
    model(...)'s keyword arguments; on 4 ranks under a setup with head-parallel groups of 2, which they have no
    attention for): a step on a left- and a right-padded row, and one on a row packing four documents (each from a
    zero state, also in one process), loss and every gradient against one process (``eager``, the documents run one
    by one); ``hf_ring.generate``'s tokens and every step's logits (over the ranks, and in one process) against
    ``model.generate``'s from a left-padded prompt."""
    import hybrid_models
    from transformers import AutoModelForCausalLM

    from hf_ring.integration.seams import generate_cache_problem

    recurrent, ulysses = hybrid_models.RECURRENT, world // 2
    want = hybrid_cases.family_reference(model_type, pattern=recurrent)
    check_family(pools(world).run(hybrid_cases.family_case, model_type, ulysses, pattern=recurrent)[0], want)
    want = hybrid_cases.family_reference(model_type, packed=True, pattern=recurrent)
    check_family(pools(world).run(hybrid_cases.family_case, model_type, ulysses, packed=True, pattern=recurrent)[0],
                 want)
    if world == 2:
        check_family(hybrid_cases.packed_one_process(model_type, pattern=recurrent), want)
    path = hybrid_models.saved(model_type, pattern=recurrent)
    tokens, generated = hybrid_cases.generate_case(model_type, path, attn="eager", logits=True)
    found = pools(world).run(hybrid_cases.generate_or_refused, model_type, path, logits=True)
    if world == 2:  # and in one process, where hf_ring.generate keeps the layers' states in its cache
        found.append(hybrid_cases.generate_case(model_type, path, ring=True, logits=True))
    problem = generate_cache_problem(AutoModelForCausalLM.from_pretrained(path))
    if problem is not None:  # transformers 5.17's Mamba keeps its state in cache_params: refused on every rank alike
        assert all(f == {"refused": f"hf_ring.generate shards the cache generate hands the model: {problem}"}
                   for f in found[:world]), found
        found = found[world:]  # in one process: handed to model.generate
    for rank, (sequences, logits) in enumerate(found):
        assert torch.equal(sequences, tokens), (rank, sequences, tokens)
        worst = max(rel_err(logits[i], generated[i]) for i in range(len(generated)))
        assert close(worst, TOL), (rank, worst)


def test_a_family_is_found_by_the_kernels_its_modeling_module_calls():
    """No table entry: LFM3's short convolution is found as the module-level function transformers resolves to
    causal_conv1d_fn, the class whose forward calls it, and the decoder layer that builds that class; a model with
    no such kernel (Llama) is no hybrid."""
    from hf_ring.patches.hybrids import CONV, HYBRIDS, family, found_family

    assert "lfm3" not in HYBRIDS
    lfm3 = family("lfm3")
    assert lfm3 is not None and lfm3 == found_family("lfm3")
    assert (lfm3.layers, lfm3.mixers, lfm3.kernels) == (("Lfm3DecoderLayer",), ("Lfm3ShortConv",),
                                                        (("causal_conv1d_fn", CONV),))
    assert family("llama") is None


def test_the_table_lists_layers_mixers_and_kernels_only_where_they_cannot_be_found():
    """Every listed family's layers, mixers and kernels are found from its modeling code, but where the table lists
    them (Nemotron-H, whose block builds its mixer through a mapping; RecurrentGemma, whose recurrence is a method and
    its convolution a module): a listing that could be found is a second copy that could go stale."""
    from hf_ring.patches.hybrids import HYBRIDS, family, found_family

    for model_type, listed in HYBRIDS.items():
        found = found_family(model_type, listed.module)
        assert (found is None) == bool(listed.layers), model_type
        assert family(model_type) is not None and family(model_type).mixers, model_type


@pytest.mark.parametrize("world", [2, 4])
def test_a_family_found_by_its_kernels_over_ranks_equals_one_process(pools, world):
    """LFM3, found and not listed: a step's loss and every gradient on 2 and 4 ranks against one-process ``eager``."""
    import sweep
    from helpers import gradient_errors

    want = sweep.eager_step("lfm3")
    got = pools(world).run(sweep.sharded_step_case, "lfm3", dtype=torch.float64)
    assert not got[0].get("refused") and not got[0].get("unbuilt"), got[0]
    errs = {"loss": rel_err(got[0]["loss"], want["loss"]), **gradient_errors(got[0]["grads"], want["grads"])}
    worst = max(errs, key=errs.get)
    assert close(errs[worst], TOL), (worst, errs[worst])


@pytest.mark.parametrize("world", [2, 4])
def test_a_hybrid_type_transformers_does_not_ship_runs_with_no_change_to_hf_ring(pools, world):
    """Qwen3.5's text model copied under another type and class names, its modeling code a module outside
    transformers, registered with the auto classes (tests/unshipped_hybrid.py): found by the kernels its code calls,
    its attention classes seen to call the interface; a step's loss and every gradient on 2 and 4 ranks against
    one-process ``eager``, and ``hf_ring.generate``'s tokens against ``model.generate``'s."""
    import hybrid_models
    import sweep
    import unshipped_hybrid
    from helpers import gradient_errors
    from hf_ring.patches.hybrids import HYBRIDS, family

    model_type = unshipped_hybrid.register()
    assert model_type not in HYBRIDS and family(model_type).modeling == unshipped_hybrid.MODELING
    want = sweep.eager_step(model_type)
    got = pools(world).run(unshipped_hybrid.step_case)
    assert not got[0].get("refused") and not got[0].get("unbuilt"), got[0]
    errs = {"loss": rel_err(got[0]["loss"], want["loss"]), **gradient_errors(got[0]["grads"], want["grads"])}
    worst = max(errs, key=errs.get)
    assert close(errs[worst], TOL), (worst, errs[worst])
    path = hybrid_models.saved(model_type)
    tokens = hybrid_cases.generate_case(model_type, path)
    for found in pools(world).run(unshipped_hybrid.generate_case, path):
        assert torch.equal(found, tokens), (found, tokens)


def test_a_mixer_whose_forward_a_hub_kernel_replaced_is_refused_before_it_computes(pools):
    """``use_kernels=True`` (``kernels.kernelize``) binds a hub layer's forward on each mixer, which calls none of
    the kernels hf_ring computes over shards: every rank raises the same error naming it, before that forward runs."""
    got = pools(2).run(hybrid_cases.swapped_mixer_case, "qwen3_5_text")
    assert got[0] == got[1], got
    (kind, message), calls = got[0]
    assert kind == "ValueError" and "HubLayer.forward" in message and "use_kernels" in message, message
    assert calls == 0, calls


def test_a_swapped_forward_is_told_from_accelerates_hooks():
    """What is refused: a forward bound on the mixer from elsewhere, also under accelerate's hooks; not accelerate's
    hooks alone, which wrap the mixer's own forward (``device_map`` offloading)."""
    import types

    from accelerate.hooks import ModelHook, add_hook_to_module

    from hf_ring.patches.hybrids import swapped_forward

    def mixer():
        return torch.nn.Linear(2, 2)

    plain, swapped, offloaded, both = mixer(), mixer(), mixer(), mixer()
    swapped.forward = types.MethodType(hybrid_cases.HubLayer.forward, swapped)
    add_hook_to_module(offloaded, ModelHook())
    both.forward = types.MethodType(hybrid_cases.HubLayer.forward, both)
    add_hook_to_module(both, ModelHook())
    assert swapped_forward(plain) is None and swapped_forward(offloaded) is None
    assert swapped_forward(swapped) is swapped_forward(both) is hybrid_cases.HubLayer.forward


def test_qwen3_5_with_images_generates_model_generate_tokens(pools):
    from vlm import HYBRIDS
    from vlm_cases import generate

    path = HYBRIDS["qwen3_5"].build()
    want = generate("qwen3_5", path)
    for got in pools(2).run(generate, "qwen3_5", path):
        assert torch.equal(got, want), (got, want)


def test_rwkv_under_gradients_runs_its_torch_path_where_the_cuda_kernel_is_loaded(monkeypatch):
    """transformers' RWKV CUDA kernel passes no gradient to a start or an end state, which a run over shards needs:
    with it loaded, a step with gradients runs the modeling module's torch path; decoding keeps the kernel."""
    import transformers.models.rwkv.modeling_rwkv as rwkv

    from hf_ring.patches.recurrent_wkv import wkv_kernel

    assert wkv_kernel(rwkv.rwkv_linear_attention, True) is rwkv.rwkv_linear_attention  # not loaded: as it is
    monkeypatch.setattr(rwkv, "rwkv_cuda_kernel", object())
    assert wkv_kernel(rwkv.rwkv_linear_attention, True) is rwkv.rwkv_linear_attention_cpu
    assert wkv_kernel(rwkv.rwkv_linear_attention, False) is rwkv.rwkv_linear_attention


def test_kernel_functions_that_the_kernels_package_made_layers_are_seen_through(monkeypatch):
    """With the ``kernels`` package installed, transformers' kernel functions are ``nn.Module`` instances whose
    forward calls the resolved function (kernel_standins.function_layer, from the package's source): the name they
    resolve under, the function they run and the arguments a call binds are those of the function inside."""
    import transformers.integrations.hub_kernels as hub_kernels
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

    import kernel_standins
    from hf_ring.integration import seams
    from hf_ring.patches.recurrent_runs import kernel_arguments

    for fn in (qwen3_5.torch_chunk_gated_delta_rule, qwen3_5.causal_conv1d_fn):
        layer = kernel_standins.function_layer(fn, seams.kernel_name(fn))
        assert seams.kernel_name(layer) == seams.kernel_name(fn) is not None
        assert seams.kernel_implementation(layer) is seams.kernel_implementation(fn)
    args, kwargs = hybrid_cases.kernel_inputs("gated delta rule")
    layer = kernel_standins.function_layer(qwen3_5.torch_chunk_gated_delta_rule, "chunk_gated_delta_rule")
    leading, rest = kernel_arguments(layer, args, dict(kwargs, output_final_state=True), 5)
    assert all(a is b for a, b in zip(leading, args)) and rest["output_final_state"] and rest["chunk_size"] == 64
    # the wrapper transformers makes is recognised when the kernels package turns it into a layer too
    layered = lambda name: lambda fn: kernel_standins.function_layer(fn, name)  # noqa: E731
    monkeypatch.setattr(hub_kernels, "use_kernel_forward_from_hub", layered)
    assert seams._kernel_resolver() is seams.KERNEL_RESOLVER is not None


@pytest.mark.parametrize("world, ulysses", [(2, 1), (4, 2)], ids=["2-ranks", "4-ranks-heads2"])
def test_a_hybrid_whose_kernels_the_kernels_package_made_layers_equals_one_process(pools, world, ulysses):
    """Qwen3.5 with its convolution and delta rule as ``kernels`` function layers (as transformers leaves them where
    that package is installed): the family is found from them, and the step equals one process's."""
    want = hybrid_cases.family_reference("qwen3_5_text")
    got = pools(world).run(hybrid_cases.layered_family_case, "qwen3_5_text", "qwen3_5", ulysses)[0]
    assert got["kernels"] == ["causal_conv1d_fn", "torch_chunk_gated_delta_rule"], got["kernels"]
    check_family(got, want)


# ---- a kernel replaced in its modeling module -------------------------------------------------------------------

REPLACED = [(t, name) for t in hybrid_cases.FAMILIES for name in hybrid_cases.replaceable_kernels(t)]
"""Every kernel of every family checked whole that a user can assign in its modeling module."""


def _exact_or_refused_alike(got, want):
    """Every rank refused with the same reason, or the step (rank 0's) exact: never a silent difference."""
    if any("refused" in g for g in got):
        assert all(g.get("refused") == got[0].get("refused") for g in got), got
        return got[0]["refused"]
    check_family(got[0], want)
    return None


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("model_type, name", REPLACED, ids=[f"{t}-{n}" for t, n in REPLACED])
def test_a_kernel_a_user_replaced_before_the_setup_is_computed_exactly(pools, model_type, name, packed):
    """The kernel, assigned in the modeling module before hf_ring first read it, as an undecorated float64 copy of
    itself (no mark of transformers' resolution): the padded batch, and the packed row, in one process and on 2
    and 4 ranks equal one process without hf_ring (the packed row's documents run one by one) with the same kernel,
    loss and every gradient within 1e-5; its kind comes from the modeling file, not from what the name holds."""
    want = hybrid_cases.replaced_kernel_reference(model_type, name, packed=packed)
    case = hybrid_cases.replaced_kernel_case
    assert _exact_or_refused_alike([case(model_type, name, packed=packed)], want) is None
    for world in (2, 4):
        assert _exact_or_refused_alike(pools(world).run(case, model_type, name, packed=packed), want) is None, world


QWEN_REPLACED = [(t, n) for t, n in REPLACED if t in ("qwen3_5_text", "qwen3_next")]


@pytest.mark.parametrize("model_type, name", QWEN_REPLACED, ids=[f"{t}-{n}" for t, n in QWEN_REPLACED])
def test_a_replaced_kernel_on_four_ranks_with_heads_is_exact(pools, model_type, name):
    """The packed row on 4 ranks as head-parallel pairs with the ring across them."""
    want = hybrid_cases.replaced_kernel_reference(model_type, name, packed=True)
    got = pools(4).run(hybrid_cases.replaced_kernel_case, model_type, name, ulysses=2, packed=True)
    assert _exact_or_refused_alike(got, want) is None


@pytest.mark.parametrize("when", ["built", "stepped"])
@pytest.mark.parametrize("name", ["causal_conv1d_fn", "torch_chunk_gated_delta_rule"])
def test_a_kernel_replaced_after_the_model_is_built_or_has_stepped_is_computed_exactly(pools, name, when):
    """The replacement made once the model exists, or after a first step (hf_ring has read the module by then):
    the name is hooked as its kind whatever it holds at each call."""
    want = hybrid_cases.replaced_kernel_reference("qwen3_5_text", name)
    got = pools(2).run(hybrid_cases.replaced_kernel_case, "qwen3_5_text", name, when)
    assert _exact_or_refused_alike(got, want) is None


@pytest.mark.parametrize("how, says", [
    ("signature", "does not take the parameters of the delta rule kernel its modeling file defines"),
    ("kernelized", "torch_chunk_gated_delta_rule was replaced by"),
    ("unhooked", "ran its mixer without calling its delta rule kernel through hf_ring")])
def test_a_kernel_the_hooks_cannot_compute_is_refused_on_every_rank(pools, how, says):
    """A replacement that takes none of the delta rule's state keywords, a mixer's copy of the kernel that
    kernelize replaced, a mixer that calls its delta rule outside the hook: each refused with the same error on
    every rank, naming the kernel and the fix; the first two before the layer computes. In one process the packed
    row is refused alike (its documents would mix)."""
    got = pools(2).run(hybrid_cases.refused_kernel_case, how)
    assert got[0] == got[1], got
    (kind, message), calls = got[0]
    assert kind == "ValueError" and says in message, message
    assert calls == (1 if how == "unhooked" else 0), calls  # the unhooked call is found once it ran
    (kind, message), _ = hybrid_cases.refused_kernel_case(how, packed=True)
    assert kind == "ValueError" and says in message, message
