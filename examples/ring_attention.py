"""Ring attention on its own: each rank holds a shard of a long sequence.

    torchrun --nproc_per_node 2 examples/ring_attention.py --seq-len 8192
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/ring_attention.py

Every rank builds the same random q, k, v (a seeded generator), keeps only
its rows, runs the ring forward and backward, and rank 0 prints the largest
difference from one process computing the whole sequence (only possible at
lengths one process can hold, which is what --check is for).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import hf_ring


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|`` over one tensor (0 when both are zero)."""
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=4096, help="global sequence length (default: %(default)s)")
    ap.add_argument("--heads", type=int, default=8, help="query heads (default: %(default)s)")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default: %(default)s)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dimension (default: %(default)s)")
    ap.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"],
                    help="how the sequence is split over the ranks (default: %(default)s)")
    ap.add_argument("--segments", type=int, nargs="*", help="dilated: segment lengths (default: none, dense attention)")
    ap.add_argument("--rates", type=int, nargs="*", help="dilated: dilation rates, one per segment (default: none)")
    ap.add_argument("--check", action="store_true",
                    help="compare with one process on the whole sequence (default: off)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    pattern = hf_ring.DilatedPattern(args.segments, args.rates) if args.segments else None

    g = torch.Generator().manual_seed(0)
    n, h, hkv, d = args.seq_len, args.heads, args.kv_heads, args.head_dim
    q, k, v, dout = (torch.randn(1, heads, n, d, generator=g) for heads in (h, hkv, hkv, h))
    pos = hf_ring.local_positions(n, rank, world, args.layout)
    ql, kl, vl = (t[:, :, pos].to(device).requires_grad_(True) for t in (q, k, v))

    t0 = time.perf_counter()
    out = hf_ring.ring_attention(ql, kl, vl, layout=args.layout, seq_len=n, pattern=pattern)
    out.backward(dout[:, :, pos].to(device))
    elapsed = time.perf_counter() - t0
    if rank == 0:
        print(f"{world} rank(s), {n} tokens, layout={args.layout}, pattern={pattern}: "
              f"forward+backward {elapsed:.2f} s, {len(pos)} rows on rank 0")
    if args.check:
        ref_q, ref_k, ref_v = (t.clone().requires_grad_(True) for t in (q, k, v))
        # A group of this rank alone: the same attention on the whole sequence in one process.
        alone = [dist.new_group([r]) for r in range(world)][rank] if dist.is_initialized() else None
        whole = hf_ring.ring_attention(ref_q, ref_k, ref_v, group=alone, pattern=pattern)
        whole.backward(dout)
        errs = [relative_error(mine.detach().cpu(), ref.detach()[:, :, pos])
                for mine, ref in ((out, whole), (ql.grad, ref_q.grad), (kl.grad, ref_k.grad), (vl.grad, ref_v.grad))]
        print(f"rank {rank}: max |ring - one process| / max |one process| for out, dq, dk, dv = "
              + ", ".join(f"{e:.2e}" for e in errs), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
