"""Long-context generation with the KV cache split across ranks.

    torchrun --nproc_per_node 2 examples/generate.py --prompt-file book.txt
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/generate.py --prompt-len 32768
    python examples/generate.py --model checkpoints/passkey --passkey

Every rank holds only its part of the prompt's K/V: the prompt is prefilled
through the ring and each new token's K/V is stored on one rank. All ranks get
the same tokens; rank 0 streams them and prints prefill tokens/s, decode
tokens/s and the cache bytes each rank holds.

``--model PATH`` loads a local Llama/Mistral checkpoint (its tokenizer too, if
it has one; otherwise text is read as bytes, the vocabulary of
examples/finetune.py). Without ``--model`` a tiny random Llama is
built in memory, so the script runs on a fresh machine (its output is noise,
the mechanics are real). Without ``--prompt-file`` the prompt is
``--prompt-len`` random tokens. ``--passkey`` instead answers passkey prompts
with a checkpoint from examples/finetune.py and reports the accuracy.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List

import torch

import hf_ring
from hf_ring.engine import comm
from hf_ring.integration import config as ring_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import finetune as ft  # noqa: E402


class TimedStreamer:
    """Prints tokens as they come (rank 0) and records when each arrives."""

    def __init__(self, tokenizer=None, echo: bool = True):
        self.tokenizer, self.echo, self.times = tokenizer, echo, []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) == 1:  # the prompt itself
            return
        if self.echo:
            print(self._text(value.reshape(-1)[:1].tolist()), end="", flush=True)

    def end(self) -> None:
        if self.echo:
            print(flush=True)

    def _text(self, ids: List[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return "".join(chr(i) if 32 <= i < 127 or i == 10 else f"<{i}>" for i in ids)


def tiny_model(dtype: torch.dtype):
    """A small random Llama, built in memory: the same seed on every rank gives every rank the same weights."""
    torch.manual_seed(0)
    return ft.load_model(None, 131072, dtype)


def load_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception:  # no tokenizer files: byte-level text
        return None


def prompt_ids(args, tokenizer, vocab: int) -> torch.Tensor:
    if args.prompt_file:
        text = ft.read_text(args.prompt_file)
        if tokenizer is not None:
            ids = tokenizer(text.decode("utf-8", errors="replace"), return_tensors="pt").input_ids
        elif vocab >= ft.VOCAB:
            ids = torch.cat([torch.tensor([[ft.BOS]]), torch.frombuffer(bytearray(text), dtype=torch.uint8).long()[None]], 1)
        else:
            raise SystemExit(f"the model has no tokenizer and only {vocab} tokens: too few for byte-level text")
        if args.prompt_len and ids.shape[1] > args.prompt_len:
            ids = ids[:, -args.prompt_len:]  # the end of the text, so generation continues it
        return ids
    gen = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, min(vocab, ft.N_FILLER), (1, args.prompt_len), generator=gen)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="local Llama/Mistral checkpoint (default: a tiny random Llama)")
    ap.add_argument("--prompt-file", default=None,
                    help=".txt or .jsonl file whose text is the prompt (default: none, a synthetic prompt)")
    ap.add_argument("--prompt-len", type=int, default=8192,
                    help="tokens of the synthetic prompt; with --prompt-file, keep at most this many (0 = all) "
                         "(default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    ap.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding (default: off)")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="sampling temperature, with --do-sample (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=123,
                    help="seed of the synthetic or passkey prompts and of sampling (default: %(default)s)")
    ap.add_argument("--sp-size", type=int, default=None, help="ranks per sequence (default: all)")
    ap.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"],
                    help="how the prompt is split over the ranks (default: %(default)s)")
    ap.add_argument("--ulysses-size", type=int, default=1,
                    help="ranks per head-parallel group: 1 the ring, --sp-size head parallelism, between both "
                         "(default: %(default)s)")
    ap.add_argument("--segment-lengths", type=int, nargs="*", default=None,
                    help="dilated attention: segment lengths (default: none, dense attention)")
    ap.add_argument("--dilation-rates", type=int, nargs="*", default=None,
                    help="dilated attention: dilation rates, one per segment length (default: none)")
    ap.add_argument("--passkey", action="store_true",
                    help="answer passkey prompts (a finetune.py checkpoint) (default: off)")
    ap.add_argument("--prompts", type=int, default=8, help="passkey prompts to answer (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=4096, help="length of each passkey prompt (default: %(default)s)")
    ap.add_argument("--quiet", action="store_true", help="do not stream the tokens (default: off)")
    return ap.parse_args(argv)


def passkey(model, args, is_main: bool) -> dict:
    batch = ft.passkey_batch(torch.Generator().manual_seed(args.seed), args.prompts, args.seq_len)
    prompts, answers = batch["input_ids"][:, :-1], batch["input_ids"][:, -1]
    t0 = time.perf_counter()
    out = hf_ring.generate(model, prompts.to(model.device), max_new_tokens=1, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    elapsed = time.perf_counter() - t0
    got = out[:, prompts.shape[1]].cpu()
    accuracy = float((got == answers).float().mean())
    if is_main:
        for i, (a, g) in enumerate(zip(answers.tolist(), got.tolist())):
            said = g - ft.KEY0 if ft.KEY0 <= g < ft.KEY0 + ft.N_KEYS else "a non-key token"
            print(f"prompt {i}: passkey {a - ft.KEY0:2d}, model says {said}")
        print(f"{accuracy:.0%} of {args.prompts} passkeys recalled from {args.seq_len}-token prompts "
              f"(chance {1 / ft.N_KEYS:.0%}), {elapsed:.1f} s")
    return {"accuracy": accuracy}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from accelerate import Accelerator

    cuda = torch.cuda.is_available()
    accelerator = Accelerator(cpu=not cuda)
    world = accelerator.num_processes
    sp_size = args.sp_size or world
    if world % sp_size:
        raise SystemExit(f"--sp-size {sp_size} does not divide the {world} processes")
    sp = hf_ring.setup_sequence_parallel(accelerator, sp_size, layout=args.layout,
                                         ulysses_size=args.ulysses_size)
    is_main = accelerator.is_main_process
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        model = ft.load_model(args.model, args.seq_len, dtype) if args.model else tiny_model(dtype)
        model = model.to(accelerator.device).eval()
        if args.segment_lengths:
            pattern = hf_ring.DilatedPattern(args.segment_lengths, args.dilation_rates)
        else:  # keep the checkpoint's own pattern (config.ring_dilated), only the layout follows --layout
            pattern = ring_config.parse(getattr(model.config, ring_config.CONFIG_KEY, None)).pattern
        hf_ring.configure(model, pattern=pattern, layout=args.layout, ulysses_size=args.ulysses_size)
        if args.passkey:
            return passkey(model, args, is_main)
        tokenizer = load_tokenizer(args.model) if args.model else None
        ids = prompt_ids(args, tokenizer, model.config.vocab_size).to(accelerator.device)
        streamer = TimedStreamer(tokenizer, echo=not args.quiet)
        if args.do_sample:
            from transformers import set_seed

            set_seed(args.seed)  # one seed on every rank: the ranks sample the same tokens
        out = hf_ring.generate(
            model, ids, attention_mask=torch.ones_like(ids),  # one unpadded prompt, whatever its token ids
            max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
            pad_token_id=0, eos_token_id=getattr(tokenizer, "eos_token_id", None), streamer=streamer,
            return_dict_in_generate=True,
        )
        cache_bytes = [out.past_key_values.nbytes()] * sp_size
        if sp.sp_group is not None and sp_size > 1:
            mine = torch.tensor([out.past_key_values.nbytes()], dtype=torch.long, device=comm.device_for(sp.sp_group))
            cache_bytes = comm.all_gather(mine, sp.sp_group, "the cache size report").flatten().tolist()
        stats = {"prompt_tokens": ids.shape[1], "new_tokens": out.sequences.shape[1] - ids.shape[1],
                 "sequences": out.sequences.cpu(), "cache_bytes": cache_bytes}
        if is_main:
            t = streamer.times
            prefill = t[1] - t[0]
            decode = (t[-1] - t[1]) / max(1, len(t) - 2)
            stats.update(prefill_s=prefill, prefill_tok_s=ids.shape[1] / prefill,
                         decode_tok_s=1.0 / decode if len(t) > 2 else float("nan"))
            print(f"{ids.shape[1]} prompt tokens on {sp_size} rank(s) ({args.layout}): prefill {prefill:.2f} s = "
                  f"{stats['prefill_tok_s']:.0f} tokens/s; decode {stats['decode_tok_s']:.1f} tokens/s; "
                  f"KV cache per rank: {', '.join(f'{b / 2**20:.2f} MiB' for b in cache_bytes)}")
        return stats
    finally:
        hf_ring.clear_sequence_parallel()


if __name__ == "__main__":
    main()
