"""``python -m bench hybrid``: a training step of a Qwen3.5-like hybrid with its sequence split over 2 ranks.

The model has the tiny-benchmark width of ``bench scale`` (hidden 256, 8 heads,
4 K/V heads, vocabulary 32000, fp32) and Qwen3.5's layer pattern: three gated
delta rule layers (4 key heads and 8 value heads of 32 channels, a short
convolution of width 4), then one full-attention layer. ``sdpa`` in one
process is the baseline; ``ring_dilated`` on 2 ranks splits every layer's rows,
the attention through the ring, the recurrent layers by state passing. Each
configuration runs in fresh one-thread processes, ``--repeats`` timed steps
after a warm-up, in each of ``--rounds`` interleaved sweeps; a step is timed
at its slowest rank, and the table gives the median and spread of all of them.
"/ one process in pieces" compares with the same model on ``ring_dilated`` in
one process, whose long row runs the torch kernels in pieces as each rank does:
what the splitting alone gives. The peak resident memory is the busiest rank's above the same process after a
512-token warm-up. "recurrent share" is the part of a step spent in the
recurrent layers (their forward and backward, timed by module hooks),
"exchange share" the part spent in their all-gathers (state passing and
convolution halos) and the gradients' all-reduces.

``python -m bench generate --hybrid`` generates from the same model with its
attention layer on the linear dilated pattern (:func:`generate_file`).

``--packed`` trains the same model on 2 ranks on documents of 512 to 4096
tokens (:data:`DOCUMENTS`, 16K in all) three ways: packed into one row
(position ids restarting, every recurrent layer starting each document from
zero), as padded rows (a batch of the documents, each padded to the longest),
and, for scale, one 16K document. "real tokens/s" counts the documents'
tokens only (16K whatever the form).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Optional

import torch

from .common import (clock, command_line, format_table, loss_step, peak_rss_mb, rss_mb, run_ranks, save, split_for,
                     spread, summary, token_row)
from .configs import HYBRID, MIXER, MODEL, dilated_pattern, hybrid_config

TABLES = {
    "hybrid_scan_rows": (("n", "rows"), ("scan_rows", "rows per piece"), ("s", "forward + backward s"),
                         ("us_per_row", "µs per row"), ("over_whole", "/ whole")),
    "hybrid_packed": (("form", "form"), ("rows", "rows x tokens"), ("ranks", "ranks"), ("step_s", "step s (median)"),
                      ("step_spread", "spread"), ("real_tok_s", "real tokens/s"),
                      ("over_padded", "real tokens/s / padded"), ("over_one_document", "step / one document"),
                      ("peak_mb", "peak MiB per rank")),
    "generate_hybrid": (("n", "prompt"), ("world", "ranks"), ("ttft_s", "time to first token s"),
                        ("ttft_spread", "spread"), ("ttft_ratio", "/ one process"), ("decode_tok_s", "decode tok/s"),
                        ("decode_spread", "spread"), ("decode_ratio", "/ one process"),
                        ("peak_mb", "peak MiB per rank"), ("same_tokens", "tokens = one process's")),
    "hybrid": (("n", "n"), ("attn", "attention"), ("ranks", "ranks"), ("step_s", "step s (median)"),
               ("step_spread", "spread"), ("over_one_process", "/ one process"),
               ("over_one_process_in_pieces", "/ one process in pieces"), ("peak_mb", "peak MiB per rank"),
               ("peak_over_one_process", "peak / one process"), ("recurrent_share", "recurrent share"),
               ("exchange_share", "exchange share")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


DOCUMENTS = (4096, 512, 2048, 1024, 3072, 1536, 2560, 1536)
"""The documents of ``--packed``: 512 to 4096 tokens, 16384 in all."""
FORMS = ("packed", "padded", "one document")


def documents_batch(form: str, vocab: int) -> Dict[str, torch.Tensor]:
    """The documents as one packed row (position ids restarting, each document's first label -100), as padded rows
    (a batch padded on the right to the longest), or one document of their total length."""
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in DOCUMENTS]
    if form == "one document":
        ids = torch.cat(docs)[None]
        return {"input_ids": ids, "labels": ids}
    if form == "packed":
        ids = torch.cat(docs)[None]
        positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
        labels = ids.masked_fill(positions == 0, -100)
        return {"input_ids": ids, "position_ids": positions, "labels": labels}
    longest = max(DOCUMENTS)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, doc in enumerate(docs):
        ids[i, :len(doc)], mask[i, :len(doc)] = doc, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _model(attn: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = hybrid_config(max_position_embeddings=1 << 20)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).train()


class _Mark(torch.autograd.Function):
    """An identity whose backward calls ``note()``: where the gradient reaches a module's output or leaves its input."""

    @staticmethod
    def forward(ctx, x, note):
        ctx.note = note
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.note()
        return grad, None


def recurrent_timers(model, spent: Dict[str, float]) -> None:
    """Add the seconds each recurrent layer spends in its forward and in its backward to ``spent["recurrent"]``.

    The layers take their input by keyword, which module backward hooks do not see; marks on the input and the
    output time the backward instead: from the gradient reaching the output to its leaving the input. A forward
    that checkpointing reruns inside the backward falls in that span already, so it is not timed again.
    """
    started: Dict[int, float] = {}

    def begin(key):
        started[key] = time.perf_counter()

    def end(key):
        spent["recurrent"] += time.perf_counter() - started.pop(key)

    def in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def pre(module, args, kwargs):
        if in_backward():
            return None
        begin(id(module))
        if torch.is_grad_enabled() and kwargs.get("hidden_states") is not None:
            kwargs = dict(kwargs, hidden_states=_Mark.apply(kwargs["hidden_states"], lambda: end(-id(module))))
        return args, kwargs

    def post(module, args, kwargs, out):
        if in_backward():
            return None
        end(id(module))
        if torch.is_grad_enabled() and out.requires_grad:
            return _Mark.apply(out, lambda: begin(-id(module)))
        return out

    for module in model.modules():
        if type(module).__name__ == MIXER:
            module.register_forward_pre_hook(pre, with_kwargs=True)
            module.register_forward_hook(post, with_kwargs=True)


def measure(attn: str, n: int, repeats: int, form: Optional[str] = None) -> Dict:
    """One rank's step times, peak memory and the seconds per step in the recurrent layers and their exchanges
    (fn of :func:`run_ranks`); ``form``: the documents of ``--packed`` in that form instead of ``n`` tokens."""
    import torch.distributed as dist

    from hf_ring.engine.comm import RingComm

    with split_for(attn) as (world, split):
        model = _model(attn)

        def step(data) -> None:
            loss_step(model, split, data)

        step(token_row(MODEL["vocab_size"], 512))  # kernels, threads and the allocator warmed
        base = rss_mb()
        data = token_row(MODEL["vocab_size"], n) if form is None else documents_batch(form, MODEL["vocab_size"])
        step(data)  # the untimed warm-up at this size, as every benchmark's
        spent = {"recurrent": 0.0, "exchange": 0.0}
        recurrent_timers(model, spent)
        clock(RingComm, "all_gather", "exchange", spent)
        clock(RingComm, "all_reduce", "exchange", spent)
        times, shares = [], []
        for _ in range(repeats):
            if world > 1:
                dist.barrier()
            spent.update(recurrent=0.0, exchange=0.0)
            t0 = time.perf_counter()
            step(data)
            times.append(time.perf_counter() - t0)
            shares.append(dict(spent))
        return {"steps": times, "shares": shares, "peak_mb": peak_rss_mb() - base}


CONFIGS = (("sdpa", 1), ("ring_dilated", 1), ("ring_dilated", 2))
"""One process on ``sdpa`` (transformers' torch kernels over whole rows), one process on ``ring_dilated`` (the same
kernels in pieces: hf_ring's one-process forward of a long row) and 2 ranks."""


def rows_for(sizes: List[int], repeats: int, rounds: int) -> List[Dict]:
    rows = []
    for n in sizes:
        found: Dict = {cfg: [] for cfg in CONFIGS}
        for _ in range(rounds):  # interleaved, so drift of the machine falls on every configuration alike
            for attn, world in CONFIGS:
                found[attn, world].append(run_ranks(world, measure, attn, n, repeats))
        stats = {}
        for cfg, runs in found.items():
            steps, recurrent, exchange, peaks = [], [], [], []
            for ranks in runs:
                for i, times in enumerate(zip(*(r["steps"] for r in ranks))):
                    slowest = max(range(len(times)), key=lambda r: times[r])
                    steps.append(times[slowest])
                    share = ranks[slowest]["shares"][i]
                    recurrent.append(share["recurrent"] / times[slowest])
                    exchange.append(share["exchange"] / times[slowest])
                peaks.append(max(r["peak_mb"] for r in ranks))
            stats[cfg] = {"steps": steps, "recurrent": recurrent, "exchange": exchange, "peak": max(peaks)}
        one, pieces = stats[CONFIGS[0]], stats[CONFIGS[1]]
        for (attn, world), s in stats.items():
            step = statistics.median(s["steps"])
            in_pieces = statistics.median(pieces["steps"])
            row = {"n": n, "attn": attn, "ranks": world, "step_s": round(step, 3),
                   "step_spread": f"{min(s['steps']):.3g}-{max(s['steps']):.3g}",
                   "over_one_process": round(step / statistics.median(one["steps"]), 3),
                   "over_one_process_spread": (f"{min(s['steps']) / max(one['steps']):.3f}-"
                                               f"{max(s['steps']) / min(one['steps']):.3f}"),
                   "over_one_process_in_pieces": round(step / in_pieces, 3),
                   "over_one_process_in_pieces_spread": (f"{min(s['steps']) / max(pieces['steps']):.3f}-"
                                                         f"{max(s['steps']) / min(pieces['steps']):.3f}"),
                   "peak_mb": round(s["peak"], 1), "peak_over_one_process": round(s["peak"] / one["peak"], 3),
                   "recurrent_share": round(statistics.median(s["recurrent"]), 3),
                   "exchange_share": round(statistics.median(s["exchange"]), 3), "repeats": len(s["steps"])}
            rows.append(row)
            print(format_table([row], list(row)), flush=True)
    return rows


def packed_rows(repeats: int, rounds: int) -> List[Dict]:
    """``--packed``: the documents in each form on 2 ranks, interleaved over ``rounds``."""
    found: Dict[str, List] = {form: [] for form in FORMS}
    for _ in range(rounds):
        for form in FORMS:
            found[form].append(run_ranks(2, measure, "ring_dilated", sum(DOCUMENTS), repeats, form))
    stats = {}
    for form, runs in found.items():
        steps = [max(times) for ranks in runs for times in zip(*(r["steps"] for r in ranks))]
        stats[form] = {"steps": steps, "peak": max(r["peak_mb"] for ranks in runs for r in ranks)}
    median = {form: statistics.median(s["steps"]) for form, s in stats.items()}
    rows = []
    for form in FORMS:
        s, batch = stats[form], documents_batch(form, 2)["input_ids"]
        rows.append({"form": form, "rows": f"{batch.shape[0]} x {batch.shape[1]}", "ranks": 2,
                     "step_s": round(median[form], 3), "step_spread": f"{min(s['steps']):.3g}-{max(s['steps']):.3g}",
                     "real_tok_s": round(sum(DOCUMENTS) / median[form], 1),
                     "over_padded": round(median["padded"] / median[form], 3),
                     "over_one_document": round(median[form] / median["one document"], 3),
                     "peak_mb": round(s["peak"], 1), "repeats": len(s["steps"])})
        print(format_table([rows[-1]], list(rows[-1])), flush=True)
    return rows


def scan_time(n: int, scan_rows: Optional[int], repeats: int) -> List[float]:
    """Seconds of a forward and backward of transformers' torch delta rule over ``n`` rows, one process and one
    thread, at the benchmark model's width (8 heads of 32 channels): whole (``scan_rows`` None), or as hf_ring runs
    it in pieces of at most ``scan_rows`` rows, each starting from the state the one before ended in."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from hf_ring.integration.context import ShardedForward
    from hf_ring.patches.recurrent import DELTA, hooked

    torch.set_num_threads(1)
    kernel = modeling_qwen3_5.torch_chunk_gated_delta_rule
    if scan_rows is not None:
        kernel = hooked(DELTA, kernel, ShardedForward.over(None, n, "contiguous", scan_rows=scan_rows))
    g = torch.Generator().manual_seed(n)
    heads, width = HYBRID["linear_num_value_heads"], HYBRID["linear_key_head_dim"]
    times = []
    for _ in range(repeats + 1):
        q, k, v = (torch.randn(1, n, heads, width, generator=g).requires_grad_() for _ in range(3))
        decay = (-torch.rand(1, n, heads, generator=g)).requires_grad_()
        beta = torch.rand(1, n, heads, generator=g).requires_grad_()
        t0 = time.perf_counter()
        out, final = kernel(q, k, v, decay, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        (out.sum() + final.sum()).backward()
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first warms the allocator


def scan_rows_table(sizes: List[int], lengths: List[int], repeats: int) -> List[Dict]:
    """``--scan-rows``: the delta rule's time per row, whole and in pieces of each length, side by side per size."""
    rows = []
    for n in sizes:
        whole = statistics.median(scan_time(n, None, repeats))
        for length in [None] + [x for x in lengths if x < n]:
            t = whole if length is None else statistics.median(scan_time(n, length, repeats))
            rows.append({"n": n, "scan_rows": "whole" if length is None else length, "s": round(t, 3),
                         "us_per_row": round(1e6 * t / n, 1), "over_whole": round(t / whole, 3)})
            print(format_table([rows[-1]], list(rows[-1])), flush=True)
    return rows


GENERATE_WARMUP = 4096
"""The prompt of the untimed warm-up call of ``generate --hybrid`` (threads, allocator, kernels): short, since at
these lengths a call's time is in its linear work, not in what a first call sets up."""


def _generate(n: int, new_tokens: int, repeats: int) -> Dict:
    """On this rank: ``hf_ring.generate`` calls on the hybrid with the linear dilated pattern on its attention layer;
    per timed call the time to the first token (the prefill forward and the first token's) and the seconds per
    later token, the peak resident memory above the built model, and the tokens."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_ring

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        hf_ring.setup_sequence_parallel(None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hybrid_config(max_position_embeddings=max(n, 1 << 20)),
                                             attn_implementation="ring_dilated", dtype=torch.float32).eval()
    hf_ring.configure(model, pattern=dilated_pattern(n))
    base = rss_mb()
    first, later, tokens = [], [], []
    for length in [GENERATE_WARMUP] + [n] * repeats:
        # Token 0 is the pad token: keep it out of the prompt, or generate would infer padding and mask it.
        ids = torch.randint(1, MODEL["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))
        starts: List[float] = []
        hook = model.register_forward_pre_hook(lambda m, a: starts.append(time.perf_counter()))
        if world > 1:
            dist.barrier()
        with torch.no_grad():
            out = hf_ring.generate(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        starts.append(time.perf_counter())
        hook.remove()
        if length == n and len(starts) > 2:
            first.append(starts[2] - starts[0])  # the prefill, then the first token's forward
            later.append((starts[-1] - starts[2]) / (len(starts) - 3))
            tokens = out.sequences[0, n:].tolist()
    hf_ring.clear_sequence_parallel()
    return {"first": first, "later": later, "peak_mb": peak_rss_mb() - base, "tokens": tokens}


def generate_rows(sizes: List[int], new_tokens: int, repeats: int, one_process_max: int) -> List[Dict]:
    """``generate --hybrid``: each prompt on 2 ranks and, up to ``one_process_max``, in one process."""
    rows = []
    for n in sizes:
        one = None
        for world in ((1, 2) if n <= one_process_max else (2,)):
            res = run_ranks(world, _generate, n, new_tokens, repeats, exact_peak=False)
            ttft, later = summary([r["first"] for r in res]), summary([r["later"] for r in res])
            got = {"ttft": ttft, "tok_s": 1 / later["median"], "tokens": res[0]["tokens"]}
            one = one or (got if world == 1 else None)
            row = {"n": n, "world": world, "ttft_s": round(ttft["median"], 2), "ttft_spread": spread(ttft),
                   "decode_tok_s": round(got["tok_s"], 1),
                   "decode_spread": f"{1 / later['max']:.3g}-{1 / later['min']:.3g}",
                   "peak_mb": round(max(r["peak_mb"] for r in res), 1), "repeats": ttft["runs"]}
            if one is not None:
                row.update(ttft_ratio=round(ttft["median"] / one["ttft"]["median"], 3),
                           decode_ratio=round(got["tok_s"] / one["tok_s"], 3),
                           same_tokens=all(r["tokens"] == one["tokens"] for r in res))
            rows.append(row)
            print(format_table([row], list(row)), flush=True)
    return rows


def generate_file(args, command: str) -> None:
    """``python -m bench generate --hybrid``: :func:`generate_rows` for ``args``, saved as generate_hybrid.json."""
    rows = generate_rows(args.sizes, args.new_tokens, args.repeats, args.one_process_max)
    print("\n" + format_table(rows, [k for k, _ in TABLES["generate_hybrid"]]))
    save(args.out, "generate_hybrid", {"config": dict(vars(args), model=dict(MODEL, **HYBRID),
                                                      warmup_prompt=GENERATE_WARMUP), "rows": rows}, command=command)


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench hybrid", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per configuration and round, after a warm-up")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved sweeps over the configurations")
    ap.add_argument("--packed", action="store_true", help="documents packed into one row, against padded rows and "
                    "one document of their length (hybrid_packed.json)")
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--scan-rows", type=int, nargs="*", default=None,
                    help="time the torch delta rule over --sizes rows whole and in pieces of these lengths "
                         "(hybrid_scan_rows.json)")
    args = ap.parse_args(argv)
    if args.scan_rows is not None:
        rows = scan_rows_table(args.sizes, args.scan_rows or [1024, 2048, 4096], max(args.repeats, 3))
        print("\n" + format_table(rows, [k for k, _ in TABLES["hybrid_scan_rows"]]))
        save(args.out, "hybrid_scan_rows", {"config": dict(vars(args), model=dict(MODEL, **HYBRID)), "rows": rows},
             command=command_line("hybrid", argv))
        return
    if args.packed:
        rows = packed_rows(args.repeats, args.rounds)
        print("\n" + format_table(rows, [k for k, _ in TABLES["hybrid_packed"]]))
        save(args.out, "hybrid_packed", {"config": dict(vars(args), model=dict(MODEL, **HYBRID), documents=DOCUMENTS),
                                         "rows": rows}, command=command_line("hybrid", argv))
        return
    rows = rows_for(args.sizes, args.repeats, args.rounds)
    print("\n" + format_table(rows, [k for k, _ in TABLES["hybrid"]]))
    save(args.out, "hybrid", {"config": dict(vars(args), model=dict(MODEL, **HYBRID)), "rows": rows},
         command=command_line("hybrid", argv))
