"""``python -m bench fixed``: what a sharded training step pays whatever its length, exchange by exchange.

The scale benchmark's Llama (4 layers, hidden 256, fp32) with a vocabulary of
1024 (so that its LM head and embeddings do not hide the fixed costs), one thread per
process: a training step (``shard_batch``, forward, backward) on 2 ranks
with the ring against one process with ``sdpa``, at short lengths where the
fixed costs show. They run in turns, ``--rounds`` times, each round timing
``--repeats`` steps after a warm-up; the table gives the median step of all
rounds, the ratio, and the spread of the rounds' ratios. A third turn runs the
ring with every tensor of a message as its own transfer (how small messages
travelled before :func:`hf_ring.engine.comm.fused`), so what fusing them saves
is measured side by side, round by round.

Then one more set of steps on the ranks, with every exchange hf_ring makes
counted on rank 0: per step, each kind (the ring's K/V and gradient
messages, the agreement and the batch check's small all-gathers), how many,
how many transfers and bytes, and the seconds rank 0 spent in them
(posting and waiting, so a wait for the other rank's work counts here). The
time inside hf_ring's attention per layer call (forward and backward, the
exchanges included) is set against ``ring_dilated`` in one process, whose
difference to ``sdpa`` is hf_ring's own host work per layer.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Dict, List

import torch

from .common import clock, command_line, format_table, ratio_range, run_ranks, save, timed
from .configs import MODEL as SCALE

MODEL = dict(SCALE, vocab_size=1024)

TABLES = {
    "fixed": (("n", "tokens"), ("sdpa_ms", "1 process, sdpa ms"), ("ring_ms", "2 ranks, ring ms"),
              ("ring_over_sdpa", "ratio"), ("ratio_spread", "ratio over rounds"),
              ("unfused_over_sdpa", "ratio, each tensor its own transfer"),
              ("unfused_ratio_spread", "over rounds"),
              ("fused_over_unfused", "fused / each tensor its own transfer"),
              ("fused_over_unfused_spread", "over rounds"),
              ("one_process_ring_over_sdpa", "1 process, ring_dilated / sdpa"),
              ("attention_ms_per_layer", "in attention per layer ms"),
              ("exchange_ms_per_layer", "of it in exchanges"),
              ("host_ms_per_layer", "1 process: ring_dilated - sdpa per layer ms")),
    "fixed_exchanges": (("n", "tokens"), ("kind", "exchange"), ("per_step", "per step"),
                        ("transfers_per_step", "transfers per step"), ("bytes_per_step", "bytes per step"),
                        ("ms_per_step", "rank 0 ms per step")),
}
"""The columns of this benchmark's tables in the docs: (JSON key, header), in order (see :mod:`bench.tables`)."""


def _model(attn: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**MODEL), attn_implementation=attn).train()


def _count(log: Dict[str, List[float]]):
    """Wrap the ring's exchanges and all-gathers so each call adds (count, transfers, bytes) under its kind."""
    from hf_ring.engine import comm

    exchange, gather = comm.RingComm.exchange, comm.RingComm.all_gather

    def counted_exchange(self, send, send_to, recv_like, recv_from, tag=0, device=None):
        pending = exchange(self, send, send_to, recv_like, recv_from, tag=tag, device=device)
        row = log.setdefault("ring K/V and gradient messages", [0, 0, 0])
        row[0] += 1
        together = comm.fused([(t.numel(), t.dtype) for t in send], self.carriers.get("cpu", ""))
        # rank 0's own transfers (its receives are a peer's): the fused tensors travel as one
        row[1] += sum(1 for t in send if t.numel()) - max(len(together) - 1, 0)
        row[2] += sum(t.numel() * t.element_size() for t in send)
        return pending

    def counted_gather(self, tensor, what):
        row = log.setdefault(what, [0, 0, 0])
        row[0] += 1
        row[1] += 1
        row[2] += tensor.numel() * tensor.element_size()
        return gather(self, tensor, what)

    comm.RingComm.exchange, comm.RingComm.all_gather = counted_exchange, counted_gather


def measure(attn: str, n: int, repeats: int, account: bool, fuse: bool = True) -> Dict:
    """One rank's step times; with ``account``, then the exchanges and the attention's time of a few more steps.
    ``fuse=False``: every tensor of a message travels alone, as before small messages were fused."""
    import torch.distributed as dist

    import hf_ring
    from hf_ring.engine import comm, ring
    from hf_ring.entry import backend

    if not fuse:
        comm.FUSE_BYTES = 0  # this worker process's own module
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        hf_ring.setup_sequence_parallel(None)
    try:
        model = _model(attn)
        ids = torch.randint(0, MODEL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
        batch = {"input_ids": ids, "labels": ids}

        def step():  # gradients accumulate, as over an accumulation window, with no allocation per step
            given = hf_ring.shard_batch(batch) if world > 1 else batch
            model(**given).loss.backward()

        step()  # with timed's own warm-up, two untimed steps, as the accounting below follows
        barrier = dist.barrier if world > 1 else None
        out: Dict = {"steps": timed(step, repeats, barrier)}
        if account:
            log: Dict[str, List[float]] = {}
            spent: Dict[str, float] = {}
            _count(log)
            clock(backend, "_sharded", "attention forward", spent)
            clock(ring, "ring_backward", "attention backward", spent)
            clock(comm.RingComm, "exchange", "ring K/V and gradient messages", spent)  # posting (gloo sends here)
            clock(comm.Pending, "wait", "ring K/V and gradient messages", spent)
            clock(comm.RingComm, "all_gather", "small all-gathers", spent)
            for _ in range(repeats):
                if barrier is not None:
                    barrier()
                step()
            out.update(log={k: [v / repeats for v in row] for k, row in log.items()},
                       spent={k: v / repeats for k, v in spent.items()})
        return out
    finally:
        if world > 1:
            hf_ring.clear_sequence_parallel()


def one_process(n: int, repeats: int) -> Dict[str, List[float]]:
    """One model's steps in one process, ``sdpa`` and ``ring_dilated`` in turns (fn of :func:`run_ranks`), so
    that what the two differ by is hf_ring's own work, not another process's luck."""
    import hf_ring  # noqa: F401  (registers ring_dilated in this worker process)

    model = _model("sdpa")
    ids = torch.randint(0, MODEL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))
    times: Dict[str, List[float]] = {"sdpa": [], "ring_dilated": []}
    for i in range(2 + repeats):
        for attn in times:
            model.set_attn_implementation(attn)
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            if i >= 2:
                times[attn].append(time.perf_counter() - t0)
    return times


def ms(seconds: float) -> float:
    """Seconds as the tables' milliseconds."""
    return round(1e3 * seconds, 2)


def timing_fields(sdpa: List[List[float]], ring: List[List[float]], unfused: List[List[float]],
                  one_ring: List[List[float]], layers: int) -> Dict:
    """The step times of each round (one list of seconds per round and side; ``one_ring`` is ``ring_dilated`` in
    the process that timed ``sdpa``) as the table's fields: medians over all rounds, their ratios, each ratio's
    spread over the rounds (the sides of a round ran back to back), and hf_ring's own host work per layer."""
    def med(rounds: List[List[float]]) -> float:
        return statistics.median([t for r in rounds for t in r])

    def per_round(a: List[List[float]], b: List[List[float]]) -> str:
        return ratio_range([statistics.median(x) for x in a], [statistics.median(y) for y in b])

    return {"sdpa_ms": ms(med(sdpa)), "ring_ms": ms(med(ring)),
            "ring_over_sdpa": round(med(ring) / med(sdpa), 3), "ratio_spread": per_round(ring, sdpa),
            "unfused_ms": ms(med(unfused)), "unfused_over_sdpa": round(med(unfused) / med(sdpa), 3),
            "unfused_ratio_spread": per_round(unfused, sdpa),
            "fused_over_unfused": round(med(ring) / med(unfused), 3),
            "fused_over_unfused_spread": per_round(ring, unfused),
            "one_process_ring_over_sdpa": round(med(one_ring) / med(sdpa), 3),
            "host_ms_per_layer": ms((med(one_ring) - med(sdpa)) / layers)}


def rows_for(n: int, rounds: int, repeats: int) -> Dict:
    layers = MODEL["num_hidden_layers"]
    sdpa, ring, unfused, one_ring = [], [], [], []

    def ranks(fuse: bool) -> List[float]:
        found = run_ranks(2, measure, "ring_dilated", n, repeats, False, fuse, exact_peak=False)
        return [max(ts) for ts in zip(*(x["steps"] for x in found))]  # each step at its slowest rank

    for _ in range(rounds):
        alone = run_ranks(1, one_process, n, repeats, exact_peak=False)[0]
        sdpa.append(alone["sdpa"])
        one_ring.append(alone["ring_dilated"])
        ring.append(ranks(True))
        unfused.append(ranks(False))
    acct = run_ranks(2, measure, "ring_dilated", n, repeats, True, exact_peak=False)[0]
    spent = acct["spent"]
    attention = spent.get("attention forward", 0.0) + spent.get("attention backward", 0.0)
    exchanges = spent.get("ring K/V and gradient messages", 0.0) + spent.get("small all-gathers", 0.0)
    row = {"n": n, **timing_fields(sdpa, ring, unfused, one_ring, layers),
           "attention_ms_per_layer": ms(attention / layers), "exchange_ms_per_layer": ms(exchanges / layers),
           "rounds": rounds, "repeats": repeats}
    exchanges_rows = [{"n": n, "kind": kind, "per_step": round(c, 2), "transfers_per_step": round(t, 2),
                       "bytes_per_step": int(b),
                       "ms_per_step": ms(spent.get("ring K/V and gradient messages", 0.0)) if kind.startswith("ring")
                       else None}
                      for kind, (c, t, b) in sorted(acct["log"].items())]
    small = spent.get("small all-gathers")
    if small is not None:
        exchanges_rows.append({"n": n, "kind": "all small all-gathers", "ms_per_step": ms(small)})
    return {"row": row, "exchanges": exchanges_rows}


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench fixed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[64, 256, 1024], help="tokens (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="turns of sdpa and the ring (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps per turn (default %(default)s)")
    ap.add_argument("--out", default="bench_results", help="where the JSON goes (default bench_results)")
    args = ap.parse_args(argv)
    command = command_line("fixed", argv)
    rows, exchanges = [], []
    for n in args.n:
        got = rows_for(n, args.rounds, args.repeats)
        rows.append(got["row"])
        exchanges += got["exchanges"]
        print(format_table([got["row"]], list(got["row"])), flush=True)
        print(format_table(got["exchanges"], list(TABLE_KEYS)), flush=True)
    save(args.out, "fixed", {"config": vars(args), "cores": os.cpu_count(),
                             "rows": rows, "exchanges": exchanges}, command=command)


TABLE_KEYS = [k for k, _ in TABLES["fixed_exchanges"]]
