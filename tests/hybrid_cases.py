"""Rank functions of the hybrid tests (module-level so they pickle)."""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Dict, Tuple

import torch
import torch.distributed as dist

import hf_ring
from hf_ring.integration.seams import CACHE_KEYWORD

N = 61


def kernel_inputs(kind: str, seed: int = 0) -> Tuple[tuple, dict]:
    """Whole-sequence inputs of one kernel kind, in float64, and its keyword arguments."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    def u(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    if kind == "gated delta rule":  # value heads narrower than keys (grouped heads reach the kernel repeated
        # before transformers 5.24: the model-level tests cover them)
        return (r(2, N, 4, 16), r(2, N, 4, 16), r(2, N, 4, 8), -u(2, N, 4) * 2, u(2, N, 4)), \
            {"use_qk_l2norm_in_kernel": True}
    if kind == "KDA":  # a decay per key channel
        return (r(2, N, 2, 8), r(2, N, 2, 8), r(2, N, 2, 8), -u(2, N, 2, 8) * 2, u(2, N, 2)), \
            {"use_qk_l2norm_in_kernel": True}
    if kind == "Mamba2 scan":  # 4 heads in 2 groups, chunks shorter than the runs
        return (r(2, N, 4, 8), r(2, N, 4), -u(4) * 2 - 0.1, r(2, N, 2, 6), r(2, N, 2, 6)), \
            {"chunk_size": 16, "D": r(4), "dt_bias": r(4), "dt_softplus": True, "dt_limit": (0.0, float("inf"))}
    if kind == "Mamba scan":
        return (r(2, 12, N), r(2, 12, N), -u(12, 5) * 2 - 0.1, r(2, 5, N), r(2, 5, N)), \
            {"D": r(12), "z": r(2, 12, N), "delta_bias": r(12), "delta_softplus": True}
    if kind == "RG-LRU":  # decays near 1, so that a state crosses many rows; row 1's second document starts at 40
        reset = torch.zeros(2, N, 1, dtype=torch.bool)
        reset[:, 0] = reset[1, 40] = True
        return (r(2, N, 12), 0.9 + 0.1 * u(2, N, 12), reset), {"recurrent_states": None}
    if kind == "WKV":  # decays per row from e^-0.02 to e^-0.4: a state crosses many rows
        return (r(12) * 0.5 - 2.5, r(12) * 0.5, r(2, N, 12), r(2, N, 12)), {}
    return (r(2, 10, N), r(10, 4)), {"bias": r(10), "activation": "silu"}  # a convolution of width 4


KERNELS = {"gated delta rule": ("qwen3_5", "torch_chunk_gated_delta_rule", "delta rule", "delta_rule"),
           "KDA": ("kimi_linear", "chunk_kimi_delta_attention", "delta rule", "delta_rule"),
           "Mamba2 scan": ("nemotron_h", "mamba2_chunk_scan", "Mamba2 scan", "mamba2_scan"),
           "Mamba scan": ("jamba", "mamba_selective_scan", "Mamba scan", "selective_scan"),
           "RG-LRU": ("recurrent_gemma", "RecurrentGemmaRglru._rnn_scan", "RG-LRU scan", "rg_lru_scan"),
           "WKV": ("rwkv", "rwkv_linear_attention", "WKV", "wkv"),
           "convolution": ("qwen3_5", "causal_conv1d_fn", "convolution", None)}
"""Per kernel: the modeling module whose torch path is hooked, its name there (``Class.method``: a method, which
uses nothing of its instance), the hook's kind, its float64 reference in :mod:`reference` (None: the convolution
itself runs in float64)."""

SEQUENCE_AXIS = {"Mamba scan": -1, "convolution": -1}
"""Where the sequence lies in a kernel's inputs (dim 1 elsewhere); 1-D and constant inputs are not split."""


def _final_key(kind: str) -> Dict[str, bool]:
    if kind in ("convolution", "RG-LRU"):  # RG-LRU's scan returns its end state unasked
        return {}
    return {{"delta rule": "output_final_state", "Mamba2 scan": "return_final_states",
             "Mamba scan": "return_last_state", "WKV": "return_state"}[KERNELS[kind][2]]: True}


def _state(final):
    """A kernel's end state as one tensor: WKV's ``(ratio, weight, log scale)`` as its numerator and denominator."""
    if isinstance(final, (list, tuple)):
        ratio, weight, scale = (t.detach().double() for t in final)
        return torch.stack([ratio * scale.exp(), weight * scale.exp()])
    return None if final is None else final.detach()


def _split(kind: str, t, rows):
    axis = SEQUENCE_AXIS.get(kind, 1)
    if not isinstance(t, torch.Tensor) or t.dim() < 3 or t.shape[axis] != N:
        return t
    return t.index_select(axis % t.dim(), rows)


def whole_kernel(kind: str, real: bool):
    """The kernel on the whole sequence: transformers' torch path (``real``) or the float64 reference."""
    import reference

    from hf_ring.patches.hybrids import kernel_owner

    module, name, _, ref = KERNELS[kind]
    if real or ref is None:
        fn = getattr(*kernel_owner(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name))
    else:
        fn = getattr(reference, ref)
    return functools.partial(fn, None) if "." in name else fn  # a method: its instance unused


def kernel_case(kind: str, scan_rows=None) -> dict:
    """This rank's rows of the hooked real kernel's output, its end state (every rank's), and the gradients;
    ``scan_rows``: the most rows one kernel call runs (None: each run whole)."""
    from hf_ring.integration.context import CONTEXT_KEY
    from hf_ring.patches.recurrent import hooked

    hf_ring.setup_sequence_parallel(None)
    try:
        args, kwargs = kernel_inputs(kind)
        context = hf_ring.shard_batch({"input_ids": torch.zeros(1, N, dtype=torch.long)})[CONTEXT_KEY]
        context.scan_rows = scan_rows
        rows = context.rows(torch.device("cpu"))
        fn = hooked(KERNELS[kind][2], whole_kernel(kind, real=True), context)
        leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]  # a reset mask takes none
        extra = {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        got = fn(*[_split(kind, a, rows) for a in leaves], **{k: _split(kind, v, rows) for k, v in extra.items()},
                 **_final_key(kind))
        out, final = got if isinstance(got, tuple) else (got, None)
        weight = output_weight(kind, out.dtype)
        (out.double() * _split(kind, weight, rows)).sum().backward()
        grads = [a.grad for a in leaves if a.requires_grad] + [v.grad for v in extra.values()
                                                                if isinstance(v, torch.Tensor)]
        for g in grads:
            dist.all_reduce(g)  # each rank's share of every input's gradient
        return {"rows": rows, "out": out.detach(), "final": _state(final), "grads": grads}
    finally:
        hf_ring.clear_sequence_parallel()


def output_weight(kind: str, dtype) -> torch.Tensor:
    """A fixed random weighting of a kernel's whole output: the loss whose gradients are compared."""
    args, kwargs = kernel_inputs(kind)
    out = whole_kernel(kind, real=False)(*args, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def reference_kernel(kind: str) -> dict:
    """The float64 reference on the whole sequence: output, end state and gradients."""
    args, kwargs = kernel_inputs(kind)
    leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    extra = {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    got = whole_kernel(kind, real=False)(*leaves, **extra, **_final_key(kind))
    out, final = got if isinstance(got, tuple) else (got, None)
    (out.double() * output_weight(kind, out.dtype)).sum().backward()
    grads = [a.grad for a in leaves if a.requires_grad] + [v.grad for v in extra.values()
                                                            if isinstance(v, torch.Tensor)]
    return {"out": out.detach(), "final": _state(final), "grads": grads}


FAMILIES = ("qwen3_5_text", "qwen3_next", "kimi_linear", "nemotron_h", "granitemoehybrid", "lfm2", "jamba", "bamba",
            "falcon_h1", "recurrent_gemma", "zamba", "zamba2", "minimax")
"""The hybrid families checked whole on 2 and 4 ranks (every hybrid type is on 2 ranks in the sweep)."""


def padded_batch(seed: int = 4, n: int = N) -> Dict[str, torch.Tensor]:
    """Two rows: the first padded on the left, the second on the right (labels -100 there); ``n`` below 13: no
    padding."""
    import sweep

    ids = sweep.inputs("", batch=2, seed=seed, n=n)["input_ids"]
    mask = torch.ones_like(ids)
    if n >= 13:
        mask[0, :7], mask[1, -5:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


DOCUMENTS = (23, 3, 14, 29)
"""Lengths of the documents one packed row holds: on 2 and 4 ranks they straddle ranks and runs, one lies inside
a run, several share a rank (zigzag gives a rank two runs)."""


def packed_batch(seed: int = 5, lengths=DOCUMENTS) -> Dict[str, torch.Tensor]:
    """One row packing the documents as ``DataCollatorWithFlattening`` does: position ids restarting at each, the
    label of each document's first token -100 (no document predicts the next one's first token)."""
    import sweep

    ids = sweep.inputs("", batch=1, seed=seed, n=sum(lengths))["input_ids"]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, positions[0] == 0] = -100
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def bfd_batch(seed: int = 6, lengths=(23, 3, 14, 29, 10), max_length: int = 40) -> Dict[str, torch.Tensor]:
    """Documents of ``lengths`` as TRL's ``packing=True`` gives them to a model: packed best-fit decreasing into rows
    of ``max_length`` (reordered), two of those rows collated padding-free into one (position ids restarting, the
    first label of each document -100, ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``seq_idx``)."""
    import sweep
    from datasets import Dataset
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    ids = sweep.inputs("", batch=1, seed=seed, n=sum(lengths))["input_ids"][0].tolist()
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    documents = Dataset.from_list([{"input_ids": ids[a:a + n]} for a, n in zip(starts, lengths)])
    rows = pack_dataset(documents, max_length, strategy="bfd")
    assert len(rows) == 2, len(rows)
    return dict(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([rows[0], rows[1]]))


def documents_apart(model, batch) -> torch.Tensor:
    """The loss of a packed batch's documents run one by one (each from a zero state, as a model's own first rows),
    as one process would average its labelled tokens: the sum of every document's, over their count."""
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    total, count = 0.0, 0
    for a, b in zip(starts, starts[1:]):
        if b - a == 1:  # a one-row document predicts nothing (its loss, a mean over no label, is NaN)
            continue
        out = model(input_ids=batch["input_ids"][:, a:b], labels=batch["labels"][:, a:b], use_cache=False)
        total = total + out.loss * (b - a - 1)
        count += b - a - 1
    return total / count


def _step(model, data):
    import hybrid_models

    with hybrid_models.model_in_float64(model):
        out = model(**data)
        out.loss.backward()
    return out.loss.detach()


def family_reference(model_type: str, n: int = N, packed: bool = False, batch=None, pattern: str = "hybrid") -> dict:
    """One process, ``sdpa``, float64: the loss and every gradient of the padded batch (``eager`` fills a padded
    query row that sees no key with NaN, which the recurrent layers' masking, a product by 0, carries on), or of
    the packed batch's documents run one by one (``packed``; ``batch``: another packed batch); ``pattern``: the
    layers' (:mod:`hybrid_models`; ``recurrent``: a model with no attention, on ``eager``)."""
    import hybrid_models
    import sweep

    attn = "eager" if pattern == hybrid_models.RECURRENT else "sdpa"
    model, why = sweep.build(model_type, attn, torch.float64, pattern)
    assert model is not None, why
    if packed:
        with hybrid_models.model_in_float64(model):
            loss = documents_apart(model, packed_batch() if batch is None else batch)
            loss.backward()
        loss = loss.detach()
    else:
        loss = _step(model, padded_batch(n=n))
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def packed_one_process(model_type: str, attn: str = "ring_dilated", batch=None, pattern: str = "hybrid") -> dict:
    """The packed batch (or ``batch``) in one process, as a training loop gives it to a model (no hf_ring call:
    position ids restarting, no mask, no cache), float64: the loss and every gradient."""
    import sweep

    model, why = sweep.build(model_type, attn, torch.float64, pattern)
    assert model is not None, why
    loss = _step(model, dict(packed_batch() if batch is None else batch, use_cache=False))
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def _rows(args: tuple, kwargs: dict) -> int:
    """The rows of a scan kernel's call: its first input of rows by channels or heads (RWKV's are keywords)."""
    return next(t.shape[1] for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 3)


def _tiny(model_type: str, attn: str, pattern: str, rows: int):
    """The type's tiny model in float64 (``pattern``: the layers built, :mod:`hybrid_models`) and one row of
    ``rows`` token ids."""
    import sweep

    model, why = sweep.build(model_type, attn, torch.float64, pattern)
    assert model is not None, why
    return model, sweep.inputs("", batch=1, seed=3, n=rows)["input_ids"]


@contextlib.contextmanager
def _counted_scans(model_type: str):
    """While open, each call the type's layers make to its scan kernels, as ``(rows, in the backward)``: counted
    where the layers look them up (hf_ring's hooks call them too), so open it inside
    :func:`hybrid_models.model_in_float64`, which puts the float64 recurrences there."""
    import hybrid_models
    from hf_ring.patches.hybrids import family as hybrid_family

    family = hybrid_family(model_type)
    module = importlib.import_module(family.modeling)
    scans = {name: getattr(module, name) for name, kind in family.kernels if kind in hybrid_models.REFERENCE_KERNELS}
    calls = []
    for name, scan in scans.items():
        setattr(module, name, functools.wraps(scan)(
            lambda *a, _scan=scan, **k: calls.append((_rows(a, k), torch._C._current_graph_task_id() != -1))
            or _scan(*a, **k)))
    try:
        yield calls
    finally:
        for name, scan in scans.items():
            setattr(module, name, scan)


def long_row(model_type: str, attn: str, rows: int, use_cache: bool = False, pattern: str = "hybrid") -> dict:
    """One row of ``rows`` tokens in one process with no hf_ring call, float64 (the scans' float64 recurrences):
    the loss, every gradient, and the rows of each call the layers made to their scan kernels in the forward
    (``calls``) and in the backward (``recomputed``: a checkpointed piece runs again there). ``use_cache``: the
    model makes a cache and fills it (an evaluation loop's default); ``pattern``: the layers built
    (:mod:`hybrid_models`)."""
    import hybrid_models

    model, ids = _tiny(model_type, attn, pattern, rows)
    with hybrid_models.model_in_float64(model), _counted_scans(model_type) as calls:
        loss = model(input_ids=ids, labels=ids, use_cache=use_cache).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, "calls": [n for n, backward in calls if not backward],
            "recomputed": [n for n, backward in calls if backward]}


def continued(model_type: str, attn: str, pattern: str, name: str, then: int, first: int = 300) -> torch.Tensor:
    """In one process, float64 recurrences, no grad: a call on ``first`` tokens that makes a cache, then a call on
    the next ``then`` tokens given what the first left, under the keyword ``name`` (the state the first output holds
    under it, or its cache): the second call's logits."""
    import hybrid_models

    model, ids = _tiny(model_type, attn, pattern, first + then)
    with hybrid_models.model_in_float64(model), torch.no_grad():
        out = model(input_ids=ids[:, :first], use_cache=True)
        carried = getattr(out, name, None)
        carried = getattr(out, CACHE_KEYWORD) if carried is None else carried
        return model(input_ids=ids[:, first:], use_cache=True, **{name: carried}).logits


def long_prompt(model_type: str, attn: str, rows: int, new_tokens: int = 3) -> dict:
    """``model.generate`` in one process on a prompt of ``rows`` tokens, float64 recurrences: the tokens, every
    step's logits, and the rows of each scan call of the prefill (``calls``)."""
    import hybrid_models

    model, ids = _tiny(model_type, attn, "hybrid", rows)
    with hybrid_models.model_in_float64(model), torch.no_grad(), _counted_scans(model_type) as calls:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return {"tokens": out.sequences[0, rows:].tolist(), "logits": torch.stack(out.logits),
            "calls": [n for n, _ in calls if n > 1]}


PATTERN = {"segment_lengths": [8, 16, 64], "dilation_rates": [1, 2, 4]}
"""A dilated pattern for a hybrid's attention layers: three branches, the last at least as long as the rows."""

REFERENCE_ATTENTION = "float64_dilated_reference"


def _dilated_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention of :data:`PATTERN` as :mod:`reference` computes it (float64, dense, every branch's
    multiplicity as a bias), for one process: transformers' attention-function signature, ``(B, n, H, D)`` out."""
    import reference

    branches = tuple(zip(PATTERN["segment_lengths"], PATTERN["dilation_rates"]))
    out = reference.dilated_attention(query, key, value, branches=branches, scale=scaling)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def dilated_step(model_type: str, n: int = N) -> dict:
    """One row of ``n`` tokens through the hybrid with :data:`PATTERN` on its attention layers, float64 (the scans'
    float64 recurrences): in one process with the reference attention, or split over the pool's ranks with
    ``ring_dilated``; the loss and every gradient."""
    import sweep
    from transformers import AttentionInterface

    split = dist.is_initialized()
    if not split:
        AttentionInterface.register(REFERENCE_ATTENTION, _dilated_reference)
    sp = hf_ring.setup_sequence_parallel(None) if split else None
    try:
        model, why = sweep.build(model_type, "ring_dilated" if split else REFERENCE_ATTENTION, torch.float64, "hybrid")
        assert model is not None, why
        if split:
            hf_ring.configure(model, pattern=PATTERN)
        ids = sweep.inputs("", batch=1, seed=8, n=n)["input_ids"]
        data = {"input_ids": ids, "labels": ids}
        loss = _step(model, hf_ring.shard_batch(data) if split else dict(data, use_cache=False))
        if split:
            hf_ring.sync_gradients(model)
            dist.all_reduce(loss, group=sp.sp_group)
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        return {"loss": loss, "grads": grads}
    finally:
        if split:
            hf_ring.clear_sequence_parallel()


MEMORY_CHUNKS = {"loss_chunk_rows": 5, "row_chunk_rows": 4}
"""Chunks for the tiled loss, MLP and norms of ``family_case(memory=True)``: not dividing a rank's rows."""


def family_case(model_type: str, ulysses: int = 1, n: int = N, packed: bool = False, scan_rows=None,
                memory: bool = False, pattern: str = "hybrid", layout: str = "zigzag", documents=DOCUMENTS) -> dict:
    """The same step with the rows split over the pool's ranks (``ulysses``: head-parallel groups of that size;
    ``layout``: the setup's); ``packed``: of the batch packing ``documents``; ``scan_rows``: the most rows one scan
    kernel call runs (None: the default);
    ``memory``: with what a long step runs with, activation checkpointing with the layer inputs offloaded and the
    loss, MLP and norms tiled over :data:`MEMORY_CHUNKS` (the MLP and norms where the family's are row-wise), and
    how many times the recurrent mixers ran for how many there are (twice each when checkpointing recomputes)."""
    import sweep
    from hf_ring.integration.context import CONTEXT_KEY
    from hf_ring.integration.seams import enable_checkpointing
    from hf_ring.patches.hybrids import family

    sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses, layout=layout)
    try:
        model, why = sweep.build(model_type, "ring_dilated", torch.float64, pattern)
        if layout != "zigzag":
            hf_ring.configure(model, layout=layout)
        if memory:
            model.train()
            enable_checkpointing(model)
            hf_ring.offload_checkpoints(model)
            rows = bool(family(model_type).tiled)
            hf_ring.configure_tiling(model, loss=True, mlp=rows, norm=rows, **MEMORY_CHUNKS)
        hooked = family(model_type).mixers if family(model_type) is not None else ()  # a refused type has none
        mixers = [m for m in model.modules() if type(m).__name__ in hooked]
        calls = []
        for mixer in mixers:
            mixer.register_forward_pre_hook(lambda *_: calls.append(1))
        batch = hf_ring.shard_batch(packed_batch(lengths=documents) if packed else padded_batch(n=n))
        if scan_rows is not None:
            batch[CONTEXT_KEY].scan_rows = scan_rows
        loss = _step(model, batch)
        hf_ring.sync_gradients(model)
        dist.all_reduce(loss, group=sp.sp_group)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return {"loss": loss, "grads": grads if dist.get_rank() == 0 else None, "mixer_runs": (len(calls), len(mixers))}
    finally:
        hf_ring.clear_sequence_parallel()


def packed_or_refused(model_type: str, world: int) -> dict:
    """The packed batch's step in one process (``world`` 1) or over the pool's ranks, or what was raised."""
    try:
        return packed_one_process(model_type) if world == 1 else family_case(model_type, packed=True)
    except (ValueError, NotImplementedError) as err:
        return {"refused": f"{type(err).__name__}: {err}"}


def trainer_case(model_type: str, path: str, sp_size=None, **options) -> dict:
    """transformers.Trainer on the saved hybrid (trainer_cases.trainer_case), its scans float64 in every process."""
    import hybrid_models
    import trainer_cases

    with hybrid_models.float64_kernels(model_type):
        return trainer_cases.trainer_case(path, sp_size, **options)


def sft_case(model_type: str, path: str, sp_size=None, **options) -> dict:
    """TRL's SFTTrainer on the saved hybrid (trainer_cases.sft_case), its scans float64 in every process."""
    import hybrid_models
    import trainer_cases

    with hybrid_models.float64_kernels(model_type):
        return trainer_cases.sft_case(path, sp_size, **options)


def _left_padded(ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of :func:`generate_case`'s prompts: the first row's first 7 tokens are padding."""
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    return mask


def generate_case(model_type: str, path: str, n: int = N, new: int = 5, ring: bool = False,
                  attn: str = "sdpa", logits: bool = False):
    """Greedy tokens of the hybrid saved at ``path``, its prompt's first row left-padded: ``model.generate``
    (``attn``; ``eager`` for a model with no attention, which takes no other) in one process (``hf_ring.generate``
    there too when ``ring``), ``hf_ring.generate`` over the pool's ranks; the scans float64 in all. ``logits``:
    ``(tokens, every step's logits)``, which see a wrong state that happens to leave the tokens alone."""
    import hybrid_models
    from transformers import AutoModelForCausalLM

    ids = padded_batch(n=n)["input_ids"]
    mask = _left_padded(ids)
    settings = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                    output_logits=True)
    ring = ring or dist.is_initialized()
    with hybrid_models.float64_kernels(model_type):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ring_dilated" if ring else attn,
                                                     dtype=torch.float32).eval()
        if not dist.is_initialized():
            out = (hf_ring.generate if ring else type(model).generate)(model, ids, attention_mask=mask, **settings)
        else:
            hf_ring.setup_sequence_parallel(None)
            try:
                out = hf_ring.generate(model, ids, mask, **settings)
            finally:
                hf_ring.clear_sequence_parallel()
    return (out.sequences, torch.stack(out.logits)) if logits else out.sequences


def whole_sequence_logits(model_type: str, path: str, sequences: torch.Tensor, n: int = N,
                          attn: str = "sdpa") -> torch.Tensor:
    """What every generation step's logits should be: the model (``attn``) on the whole generated ``sequences`` in
    one forward, no cache, under :func:`generate_case`'s padding and with the positions ``generate`` gives a
    left-padded row (counted from its first token: RecurrentGemma restarts its recurrence at position 0);
    ``(steps, B, vocab)``."""
    import hybrid_models
    from transformers import AutoModelForCausalLM

    mask = _left_padded(sequences)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with hybrid_models.float64_kernels(model_type), torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()
        found = model(sequences, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return found[:, n - 1:-1].transpose(0, 1)


class HubLayer(torch.nn.Module):
    """What a hub kernel's layer gives a mixer under ``kernels.kernelize``: a forward of its own, bound on the mixer
    (here computing what the mixer's own would, and counting its calls)."""

    calls = 0

    def forward(self, *args, **kwargs):
        HubLayer.calls += 1
        return type(self).forward(self, *args, **kwargs)


def swapped_mixer_case(model_type: str):
    """A sharded step whose mixers' forwards were swapped as by ``kernels.kernelize``: what each rank raised, and how
    often a swapped forward ran."""
    import types

    import sweep
    from helpers import raises_on_rank
    from hf_ring.patches.hybrids import family

    hf_ring.setup_sequence_parallel(None)
    try:
        model, why = sweep.build(model_type, "ring_dilated", torch.float64, "hybrid")
        for m in model.modules():
            if type(m).__name__ in family(model_type).mixers:
                m.forward = types.MethodType(HubLayer.forward, m)
        HubLayer.calls = 0
        raised = raises_on_rank(_step, model, hf_ring.shard_batch(padded_batch()))
        return raised, HubLayer.calls
    finally:
        hf_ring.clear_sequence_parallel()


def lightning_inputs():
    """A float64 MiniMax lightning attention layer (4 heads of 8, blocks of 16 rows: shorter than the sequence) and
    a ``(2, N, 32)`` input."""
    from transformers import AutoConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    config = AutoConfig.for_model("minimax", hidden_size=32, num_attention_heads=4, head_dim=8, num_hidden_layers=2,
                                  block_size=16, layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(3)
    module = MiniMaxLightningAttention(config, 0).double()
    hidden = torch.randn(2, N, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    return module, hidden


def lightning_case(scan_rows=None) -> dict:
    """The layer under its hook on the pool's ranks: this rank's output rows, the end state, and the gradients of
    the input and of every parameter (summed over the ranks) for :func:`lightning_weight`'s loss."""
    from hf_ring.integration.context import CONTEXT_KEY
    from hf_ring.patches.recurrent import LIGHTNING, hooked

    hf_ring.setup_sequence_parallel(None)
    try:
        module, hidden = lightning_inputs()
        context = hf_ring.shard_batch({"input_ids": torch.zeros(1, N, dtype=torch.long)})[CONTEXT_KEY]
        context.scan_rows = scan_rows
        rows = context.rows(torch.device("cpu"))
        hidden.requires_grad_()
        out, final = hooked(LIGHTNING, module.forward, context)(hidden[:, rows], None, None)
        (out * lightning_weight()[:, rows]).sum().backward()
        grads = [hidden.grad] + [p.grad for p in module.parameters()]
        for g in grads:
            dist.all_reduce(g)
        return {"rows": rows, "out": out.detach(), "final": final.detach(), "grads": grads}
    finally:
        hf_ring.clear_sequence_parallel()


def lightning_weight() -> torch.Tensor:
    return torch.randn(2, N, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def lightning_reference() -> dict:
    import reference

    module, hidden = lightning_inputs()
    hidden.requires_grad_()
    out, final = reference.lightning_attention(module, hidden)
    (out * lightning_weight()).sum().backward()
    return {"out": out.detach(), "final": final.detach(), "grads": [hidden.grad] + [p.grad for p in module.parameters()]}


def generate_or_refused(model_type: str, path: str, **kwargs):
    """:func:`generate_case`, or the refusal it raised (a model whose generate hands it no cache to shard)."""
    try:
        return generate_case(model_type, path, **kwargs)
    except NotImplementedError as err:
        return {"refused": str(err)}


def layered_family_case(model_type: str, module_name: str, ulysses: int = 1) -> dict:
    """:func:`family_case` with every kernel function of the family's modeling module (and the float64 delta rule
    that stands in for it) made a ``kernels`` function layer (:func:`kernel_standins.function_layer`), as transformers
    leaves them where the ``kernels`` package is installed; the family found again from them, and put back after."""
    import kernel_standins
    import reference
    import hf_ring.patches.hybrids as hybrids
    from hf_ring.integration.seams import kernel_name

    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    saved = {name: fn for name, fn in vars(module).items() if callable(fn) and kernel_name(fn) is not None}
    delta_rule = reference.delta_rule
    try:
        for name, fn in saved.items():
            setattr(module, name, kernel_standins.function_layer(fn, kernel_name(fn)))
        reference.delta_rule = kernel_standins.function_layer(delta_rule, "chunk_gated_delta_rule")
        hybrids.family.cache_clear()
        hybrids._found_in.cache_clear()  # the family is read again, from the layers
        found = hybrids.family(model_type)
        kernels = sorted(name for name, _ in found.kernels) if found is not None else None
        return {**family_case(model_type, ulysses), "kernels": kernels}
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
        reference.delta_rule = delta_rule
        hybrids.family.cache_clear()
        hybrids._found_in.cache_clear()


REPLACED_WHEN = ("before", "built", "stepped")
"""When a user's replacement of a kernel lands: before hf_ring first reads the modeling module (at the top of the
script), once the model is built, or after a first step."""


def replaceable_kernels(model_type: str) -> Tuple[str, ...]:
    """The kernels of ``model_type``'s family a user can assign in its modeling module (module functions and
    ``Class.method`` ones, not a layer's own modules), a fused one aside (declined over shards)."""
    from hf_ring.patches.hybrids import FUSED, family

    return tuple(name for name, kind in family(model_type).kernels if kind != FUSED and not name.startswith("."))


def replaced_kernel_case(model_type: str, name: str, when: str = "before", ulysses: int = 1,
                         packed: bool = True) -> dict:
    """One step of the packed batch (``packed``) or of the padded one with the modeling module's kernel ``name``
    replaced by an undecorated float64 copy of itself (:func:`hybrid_models.undecorated_copy`), as a user swaps in
    their own kernel, ``when`` (:data:`REPLACED_WHEN`; 'before': hf_ring's reading of the module forgotten too, as
    in a process where the assignment came first); the other scans float64 recurrences, as everywhere here. Over
    the pool's ranks with ``shard_batch``, or in one process as a training loop calls a ``ring_dilated`` model (no
    hf_ring call; the packed batch's documents then apart only through hf_ring's pieces): the loss and every
    gradient, or what was raised (``refused``)."""
    import hybrid_models
    import sweep
    import hf_ring.patches.hybrids as hybrids

    split = dist.is_initialized()
    module = importlib.import_module(hybrids.family(model_type).modeling)
    owner, attr = hybrids.kernel_owner(module, name)
    own = vars(owner)[attr]
    copy = hybrid_models.undecorated_copy(module, name)
    data = packed_batch() if packed else padded_batch()

    def put():
        setattr(owner, attr, copy)
        if when == "before":
            hybrids.family.cache_clear()
            hybrids._found_in.cache_clear()

    def step(model):
        model.zero_grad(set_to_none=True)
        out = model(**(hf_ring.shard_batch(data) if split else dict(data, use_cache=False)))
        out.loss.backward()
        return out.loss.detach()

    with hybrid_models.float64_kernels(model_type):
        if when == "before":
            put()
        sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses) if split else None
        try:
            model, why = sweep.build(model_type, "ring_dilated", torch.float64, "hybrid")
            assert model is not None, why
            if when == "built":
                put()
            if when == "stepped":
                step(model)
                put()
            loss = step(model)
            if split:
                hf_ring.sync_gradients(model)
                dist.all_reduce(loss, group=sp.sp_group)
        except (ValueError, NotImplementedError) as err:
            return {"refused": f"{type(err).__name__}: {err}"}
        finally:
            setattr(owner, attr, own)
            hybrids.family.cache_clear()
            hybrids._found_in.cache_clear()
            if split:
                hf_ring.clear_sequence_parallel()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss, "grads": grads if not split or dist.get_rank() == 0 else None}


@functools.lru_cache(maxsize=None)
def replaced_kernel_reference(model_type: str, name: str, packed: bool = True) -> dict:
    """:func:`replaced_kernel_case`'s step in one process without hf_ring (``sdpa``; the packed batch's documents run
    one by one), the same replacement in place."""
    import hybrid_models
    import sweep
    import hf_ring.patches.hybrids as hybrids

    module = importlib.import_module(hybrids.family(model_type).modeling)
    owner, attr = hybrids.kernel_owner(module, name)
    own = vars(owner)[attr]
    with hybrid_models.float64_kernels(model_type):
        setattr(owner, attr, hybrid_models.undecorated_copy(module, name))
        try:
            model, why = sweep.build(model_type, "sdpa", torch.float64, "hybrid")
            assert model is not None, why
            loss = documents_apart(model, packed_batch()) if packed else model(**padded_batch()).loss
            loss.backward()
        finally:
            setattr(owner, attr, own)
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                             if p.grad is not None}}


def _narrow_delta_rule(query, key, value, g, beta):
    """A user's delta rule that takes no state to start from or to return: what the hook cannot run a piece with."""
    raise AssertionError("never called: refused before the layer computes")


def refused_kernel_case(how: str, model_type: str = "qwen3_5_text", packed: bool = False):
    """A step of the padded batch (``packed``: the packed one) over the pool's ranks, or in one process, with the
    delta rule of ``model_type`` made unusable to the hooks ``how``: ``signature`` (a replacement that takes none
    of the state keywords), ``kernelized`` (each mixer's own copy of it replaced as ``kernels.kernelize`` replaces
    one, with a forward of its own), ``unhooked`` (the mixer's forward runs it outside the hook, as a kernel called
    under another name would). What each rank raised, and the calls the layers made to a replaced kernel."""
    import types

    import hybrid_models
    import kernel_standins
    import sweep
    from helpers import raises_on_rank
    import hf_ring.patches.hybrids as hybrids

    split = dist.is_initialized()
    hybrid = hybrids.family(model_type)
    module = importlib.import_module(hybrid.modeling)
    name = next(n for n, kind in hybrid.kernels if kind == hybrids.DELTA)
    mixer_class = getattr(module, hybrid.mixers[0])
    own_kernel, own_forward = vars(module)[name], vars(mixer_class)["forward"]
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return hybrid_models.undecorated_copy(module, name)(*args, **kwargs)

    class KernelizedLayer(torch.nn.Module):  # what kernelize binds on a mixer's copy of a kernel function
        def forward(self, *args, **kwargs):
            return counted(*args, **kwargs)

    def unhooked(self, *args, **kwargs):
        hooked = getattr(module, name)
        setattr(module, name, counted)  # what the layer calls is no longer the hook
        try:
            return own_forward(self, *args, **kwargs)
        finally:
            setattr(module, name, hooked)

    sp = hf_ring.setup_sequence_parallel(None) if split else None
    try:
        with hybrid_models.float64_kernels(model_type):
            model, why = sweep.build(model_type, "ring_dilated", torch.float64, "hybrid")
            assert model is not None, why
            if how == "signature":
                setattr(module, name, _narrow_delta_rule)
            elif how == "kernelized":
                for m in model.modules():
                    if type(m) is mixer_class:
                        held = kernel_standins.function_layer(own_kernel, name)
                        held.forward = types.MethodType(KernelizedLayer.forward, held)
                        m.__dict__.setdefault("_kernel_funcs", {})[name] = held
            else:
                mixer_class.forward = unhooked
            data = packed_batch() if packed else padded_batch()
            raised = raises_on_rank(lambda: model(**(hf_ring.shard_batch(data) if split else
                                                     dict(data, use_cache=False))).loss.backward())
            return raised, len(calls)
    finally:
        setattr(module, name, own_kernel)
        mixer_class.forward = own_forward
        if split:
            hf_ring.clear_sequence_parallel()
