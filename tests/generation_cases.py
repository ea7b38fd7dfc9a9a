"""Rank functions of the generation tests: hf_ring.generate on every rank of a pool (module-level so they pickle)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hf_ring
from hf_ring.integration.seams import CACHE_KEYWORD
from helpers import raises_on_rank


def sp_diverging_generate_case(path, ids, **kwargs):
    """``hf_ring.generate`` where rank 1's lm_head differs, so its own logits pick other tokens.

    Returns the sequences, or the (error type, message) this rank raised.
    """
    from models import load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        if dist.get_rank() == 1:
            with torch.no_grad():
                model.lm_head.weight.neg_()  # its greedy pick is then the least likely token, never rank 0's
        result = {}
        error = raises_on_rank(lambda: result.setdefault("sequences", hf_ring.generate(model, ids, **kwargs)))
        return error if error is not None else result["sequences"]
    finally:
        hf_ring.clear_sequence_parallel()


class ListStreamer:
    """A streamer that records what ``generate`` puts into it."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.ended = True


def sp_generate_case(path, ids, mask=None, *, layout="zigzag", pattern=None, seed=None, stream=False,
                     ids_by_rank=None, cache_from=None, continue_with=None, **kwargs):
    """``hf_ring.generate`` with the sequence split over the whole world.

    Returns the sequences (and the step logits when asked), this rank's cache
    rows after every forward, and what a streamer saw. ``ids_by_rank`` gives
    each rank its own prompt (to provoke errors); ``cache_from`` passes a cache
    made for ``(rank, world, layout)``; ``continue_with`` runs a second call on
    the returned cache with these many more tokens.
    """
    from models import load
    from transformers import set_seed

    rank = dist.get_rank()
    hf_ring.setup_sequence_parallel(None, layout=layout)
    try:
        model = load(path, "ring_dilated")
        hf_ring.configure(model, pattern=pattern, layout=layout)
        lengths = []
        cache = hf_ring.ShardedCache(*(cache_from or (rank, dist.get_world_size(), layout)))
        kwargs["past_key_values"] = cache
        hook = model.register_forward_hook(lambda m, a, o: lengths.append(cache.local_length()))
        if ids_by_rank is not None:
            ids = ids_by_rank[rank]
        if seed is not None:
            set_seed(seed)
        streamer = ListStreamer() if stream else None
        out = hf_ring.generate(model, ids, attention_mask=mask, streamer=streamer, **kwargs)
        if continue_with is not None:
            seq = out.sequences
            more = None if mask is None else torch.cat([mask, torch.ones_like(seq[:, mask.shape[1]:])], 1)
            out = hf_ring.generate(model, seq, attention_mask=more,
                                   **dict(kwargs, past_key_values=out.past_key_values, max_new_tokens=continue_with))
        hook.remove()
        res = {"lengths": lengths, "stream": None if streamer is None else (streamer.chunks, streamer.ended)}
        if isinstance(out, torch.Tensor):
            res["sequences"] = out
        else:
            res["sequences"] = out.sequences
            res["logits"] = None if out.logits is None else torch.stack(out.logits, 1)
            res["cache_bytes"] = out.past_key_values.nbytes()
        return res
    finally:
        hf_ring.clear_sequence_parallel()


def unseeded_sampling_case(path, ids):
    """Sampling with a different random state on each rank (an error)."""
    torch.manual_seed(100 + dist.get_rank())
    return sp_generate_case(path, ids, do_sample=True, max_new_tokens=3, pad_token_id=0)


def sdpa_sharded_case(path, ids, **kwargs):
    """hf_ring.generate of an sdpa model under sequence parallelism (an error)."""
    from models import load

    hf_ring.setup_sequence_parallel(None)
    try:
        return hf_ring.generate(load(path, "sdpa"), ids, **kwargs)
    finally:
        hf_ring.clear_sequence_parallel()


def sp_cache_forward_case(path):
    """A forward with transformers' own cache while the sequence is split (an error)."""
    from models import load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        ids = torch.arange(8).view(1, 8)
        with torch.no_grad():
            out = model(**dict(hf_ring.shard_batch({"input_ids": ids}), use_cache=True))
            cache = getattr(out, CACHE_KEYWORD)
            return model(input_ids=ids[:, :1], **{CACHE_KEYWORD: cache}, use_cache=True)
    finally:
        hf_ring.clear_sequence_parallel()


def one_rank_bad_argument_case(path, ids, bad):
    """``hf_ring.generate`` where only the last rank passes the keyword arguments ``bad``."""
    extra = bad if dist.get_rank() == dist.get_world_size() - 1 else {}
    return raises_on_rank(sp_generate_case, path, ids, **dict(dict(max_new_tokens=3, pad_token_id=0), **extra))


def head_parallel_generate_case(path, ids, mask=None, *, ulysses, pattern=None, **kwargs):
    """``hf_ring.generate`` with the prompt's prefill run by head parallelism (``ulysses`` ranks per group)."""
    from models import load

    hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses)
    try:
        model = load(path, "ring_dilated")
        hf_ring.configure(model, pattern=pattern, ulysses_size=ulysses)
        out = hf_ring.generate(model, ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True,
                               **kwargs)
        return {"sequences": out.sequences, "logits": torch.stack(out.logits, 1),
                "rows": out.past_key_values.local_length()}
    finally:
        hf_ring.clear_sequence_parallel()


def with_lora(model):
    """``model`` with LoRA adapters on its attention projections, their weights non-zero and seeded (a PEFT model)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False, lora_dropout=0.0))


def lora_generate_case(path, ids, mask=None, **kwargs):
    """``hf_ring.generate`` of a PEFT (LoRA) model with the sequence split over the whole world."""
    from models import load

    hf_ring.setup_sequence_parallel(None)
    try:
        return hf_ring.generate(with_lora(load(path, "ring_dilated")), ids, attention_mask=mask, **kwargs)
    finally:
        hf_ring.clear_sequence_parallel()
