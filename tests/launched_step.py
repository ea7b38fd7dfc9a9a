"""A training script as users write it, launched by tests/test_launch.py under torchrun or by hand.

``--backend none`` calls ``dist.init_process_group()`` with no backend (what many
scripts do), ``gloo`` and ``cpu:gloo`` name one. The script runs one sharded
training step of a tiny Llama (dynamic RoPE, so the shards need the global
length) and prints its loss and every gradient's relative error against
transformers' ``sdpa`` on the whole batch, computed in this process by a second
model beside the sharded one. That second model runs before and after the
sequence-parallel setup, and on rank 0 only afterwards: it must return the
same loss, logits and gradients bit for bit, and issue no collective (rank 1
never joins one). ``--fault kill|raise`` makes rank 1 die or raise after the
setup instead; rank 0 reports how its step ended. ``--leave`` makes rank 1's
script end right after the setup, cleanly, while rank 0 shards a batch.
``--bad-labels one|both`` gives rank 1 (or both ranks) labels of the wrong
length. ``--light`` runs only a
sharded ``ring_attention`` forward and backward and a training loop's metric
reductions (no model), for launch counts. ``--hybrid`` trains a saved tiny hybrid
(``--model``, Qwen3.5: gated-delta-rule layers beside attention) and its image-text
form (``--vlm``) one step each through ``shard_batch``, so that the last exchange
before the end is a recurrent layer's, in its backward.
The script ends without any cleanup of its own, or ``--ending destroy`` (``dist.destroy_process_group()``, as
torch's examples do), ``end_training`` (``accelerator.end_training()``, accelerate's) or ``shutdown``
(``hf_ring.shutdown()``): every launch must exit 0.
"""
import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_ring  # noqa: E402
from helpers import rel_err  # noqa: E402
from models import batch, load  # noqa: E402


def whole_step(model, data):
    """Loss, logits and gradients of one unsharded training step (train mode, labels given)."""
    model.zero_grad(set_to_none=True)
    out = model(**data, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def light(rank: int, world: int) -> dict:
    n = 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 16, generator=g) for _ in range(3))
    pos = hf_ring.local_positions(n, rank, world, "zigzag")
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    hf_ring.ring_attention(ql, kl, vl).sum().backward()
    # A training loop's metric reductions: gloo groups torn down right after many collectives abort most often.
    total = torch.ones(1000)
    for _ in range(50):
        dist.all_reduce(total)
    return {"rank": rank, "rows": len(pos)}


def hybrid(rank: int, model_path: str, vlm_path: str, accelerator) -> dict:
    """One training step of the saved hybrid and one of its image-text form, each ending in its backward."""
    from transformers import AutoModelForCausalLM

    from vlm import HYBRIDS

    hf_ring.setup_sequence_parallel(accelerator, sp_size=dist.get_world_size())
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="ring_dilated").train()
    data = batch(3, 2, 37, vocab=model.config.vocab_size)
    model(**hf_ring.shard_batch(data)).loss.backward()
    family = HYBRIDS["qwen3_5"]
    vlm = family.load("ring_dilated", torch.float32, vlm_path).train()
    vlm(**hf_ring.shard_batch(family.batch(0, 64, ((14, 45),)))).loss.backward()
    return {"rank": rank}


ENDINGS = ("none", "destroy", "end_training", "shutdown")


def end(how: str, accelerator) -> None:
    """The script's last line: nothing, ``dist.destroy_process_group()``, ``accelerator.end_training()`` or
    ``hf_ring.shutdown()``."""
    if how == "destroy":
        dist.destroy_process_group()
    elif how == "end_training":
        accelerator.end_training()
    elif how == "shutdown":
        hf_ring.shutdown()


def report(out: str, result: dict) -> None:
    # One file per rank: the ranks' lines on a shared stdout can interleave.
    with open(os.path.join(out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="none", help="none, or the backend to name (default: %(default)s)")
    parser.add_argument("--model", help="a saved tiny Llama with dynamic RoPE (default: none, for --light)")
    parser.add_argument("--fault", choices=["kill", "raise"], help="rank 1 dies or raises after the setup")
    parser.add_argument("--leave", action="store_true", help="rank 1's script ends right after the setup")
    parser.add_argument("--bad-labels", choices=["one", "both"], help="labels one row short on rank 1, or on both")
    parser.add_argument("--light", action="store_true", help="only a sharded ring_attention forward and backward")
    parser.add_argument("--hybrid", action="store_true", help="a step of the hybrid --model and of its image-text "
                        "form --vlm")
    parser.add_argument("--vlm", help="a saved tiny Qwen3.5 image-text model (with --hybrid)")
    parser.add_argument("--ending", choices=ENDINGS, default="none", help="how the script ends (%(default)s)")
    parser.add_argument("--out", required=True, help="a folder: each rank writes rank<N>.json there")
    parser.add_argument("--accelerator", choices=["cpu", "default"],
                        help="with --light: set up through Accelerator(cpu=True) or Accelerator()")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(None if args.backend == "none" else args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.light or args.hybrid:
        from accelerate import Accelerator

        accelerator = None  # the light form also sets up from torch.distributed alone
        if args.hybrid or args.accelerator or args.ending == "end_training":
            accelerator = Accelerator(cpu=args.accelerator != "default")
        if args.light:
            hf_ring.setup_sequence_parallel(accelerator, sp_size=world)
            report(args.out, light(rank, world))
        else:
            report(args.out, hybrid(rank, args.model, args.vlm, accelerator))
        end(args.ending, accelerator)
        return
    data = batch(3, 2, 37)
    beside = load(args.model, "sdpa").train()
    before = whole_step(beside, data)
    hf_ring.setup_sequence_parallel(None, sp_size=world)
    if args.leave and rank == 1:
        return
    if args.bad_labels == "both" or (args.bad_labels == "one" and rank == 1):
        data = dict(data, labels=data["labels"][:, :-1])
    if args.fault and rank == 1:
        if args.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("rank 1 fails on purpose")
    model = load(args.model, "ring_dilated").train()
    start = time.monotonic()
    try:
        out = model(**hf_ring.shard_batch(data))
        out.loss.backward()
        hf_ring.sync_gradients(model)
    except Exception as err:
        report(args.out, {"rank": rank, "error": type(err).__name__, "message": str(err)[:300],
                          "after_s": time.monotonic() - start})
        raise
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)  # each rank's loss is its shard's share of the sequence loss
    result = {"rank": rank, "backend": dist.get_backend(), "loss": float(loss),
              "loss_err": rel_err(loss, before[0]),
              "grad_err": max(rel_err(p.grad, before[2][k]) for k, p in model.named_parameters())}
    if rank == 0:  # alone: a collective here would never complete
        after = whole_step(beside, data)
        result["beside_identical"] = all(torch.equal(a, b) for a, b in zip(before[:2], after[:2])) and all(
            torch.equal(before[2][k], after[2][k]) for k in before[2])
    report(args.out, result)


if __name__ == "__main__":
    main()
