"""Answer passkey prompts with a checkpoint from examples/finetune.py.

    python examples/generate.py --model checkpoints/passkey --prompts 8

Each prompt is a long passkey sequence up to its query token; the model's
greedy next token is the answer. Runs in one process and recomputes the whole
sequence per new token (``ring_dilated`` has no KV cache yet), so keep
``--max-new-tokens`` small.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import finetune as ft  # noqa: E402


@torch.no_grad()
def greedy(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    for _ in range(new_tokens):
        nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="checkpoints/passkey")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=1)
    ap.add_argument("--seed", type=int, default=123)
    args = ap.parse_args(argv)
    model = ft.load_model(args.model, args.seq_len, torch.float32).eval()
    batch = ft.passkey_batch(torch.Generator().manual_seed(args.seed), args.prompts, args.seq_len)
    prompts, answers = batch["input_ids"][:, :-1], batch["input_ids"][:, -1]
    t0 = time.perf_counter()
    out = greedy(model, prompts, args.max_new_tokens)
    elapsed = time.perf_counter() - t0
    got = out[:, prompts.shape[1]]
    for i, (a, g) in enumerate(zip(answers.tolist(), got.tolist())):
        print(f"prompt {i}: passkey {a - ft.KEY0:2d}, model says {g - ft.KEY0 if g >= ft.KEY0 else 'a non-key token'}")
    accuracy = float((got == answers).float().mean())
    print(f"{accuracy:.0%} of {args.prompts} passkeys recalled from {args.seq_len}-token prompts "
          f"(chance {1 / ft.N_KEYS:.0%}), {elapsed:.1f} s")
    return accuracy


if __name__ == "__main__":
    main()
