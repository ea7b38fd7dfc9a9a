"""Long-context generation: prefill through the ring, decode over a sharded KV cache.

:func:`generate` runs transformers' own ``model.generate`` (so its knobs,
logits processors, stopping criteria and streamers all apply) with two hooks
on the model's forward:

- **prefill** (empty cache): each rank keeps only its layout shard of the
  prompt, attention runs as the ring, and the cache stores the shard's K/V.
  The rank holding the last prompt token broadcasts its next-token logits.
- **step** (every later forward): every rank runs the same new token(s); each
  new row's K/V is stored on one rank only (the least loaded), each rank
  attends the new queries over its own rows and the ranks merge the partial
  results with one small all-gather per layer, which leaves every rank the
  same numbers. So every rank computes the same logits and picks the same
  token with no broadcast; the step's tokens ride in its first all-gather to
  check that, and a final exchange checks the last one. Where ranks may round
  differently (mixed hardware), ``broadcast_logits=True`` makes every rank
  take rank 0's logits.

Every rank gets the same output sequences; no rank ever holds the whole cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from ..engine.agreement import differing
from ..engine.comm import RingComm
from ..engine.decode import RanksDivergedError
from ..engine.documents import left_padding
from ..engine.fingerprint import fingerprint
from ..engine.layout import owner, shard_sizes
from ..engine.relay import fail_together
from ..integration import config as ring_config
from ..integration.context import CONTEXT_KEY, ShardedForward
from ..integration.groups import SequenceParallel, current
from ..entry.guard import other_attention_message
from ..entry.media import MediaForward, has_media
from ..integration.seams import CACHE_KEYWORD, cache_argument, generate_cache_problem, peft_base
from ..patches import apply as apply_patches
from ..patches.hybrids import own_cache, recurrent_layers
from .cache import ShardedCache, sharded_cache_class
from .retention import layer_rules
from .step import DecodeStep

Tensor = torch.Tensor

EXTRAPOLATING_ROPE = ("dynamic",)
"""RoPE types meant to run past ``max_position_embeddings``; any other is refused there unless allowed."""

_UNSUPPORTED = {
    "inputs_embeds": "pass input_ids",
    "assistant_model": "assisted generation rewinds the cache, which a sharded cache cannot do",
    "prompt_lookup_num_tokens": "prompt-lookup decoding rewinds the cache, which a sharded cache cannot do",
}


@dataclass
class Generation:
    """What the forward hooks of one :func:`generate` call share."""

    cache: ShardedCache
    comm: Optional[RingComm]
    sp: Optional[SequenceParallel] = None
    broadcast_logits: bool = False
    src: Optional[int] = None  # the rank whose logits every rank takes this forward; None: each its own


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(params, dict):
        return str(params.get("rope_type", params.get("type", "default")))
    return "default"


def check_length(config, prompt_len: int, total_len: int, allow: bool) -> None:
    """Refuse positions beyond the model's ``max_position_embeddings`` unless its RoPE extrapolates or ``allow``."""
    limit = getattr(config, "max_position_embeddings", None)
    rope = _rope_type(config)
    if allow or limit is None or total_len <= limit or rope in EXTRAPOLATING_ROPE:
        return
    raise ValueError(
        f"the prompt ({prompt_len} tokens) and the new tokens reach {total_len} positions, beyond this model's "
        f"max_position_embeddings={limit} (RoPE type {rope!r}, which does not extrapolate). Shorten the prompt or "
        "max_new_tokens, use a model configured for longer positions (e.g. rope_parameters with rope_type='dynamic' "
        "or a larger max_position_embeddings), or pass allow_beyond_max_positions=True to generate anyway"
    )


def _rng_fingerprint(device: torch.device) -> int:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return fingerprint(*states)


def _agree(comm: RingComm, input_ids: Tensor, attention_mask: Optional[Tensor], cache: ShardedCache,
           do_sample: bool, device: torch.device) -> None:
    """Check that every rank generates for the same batch; the same error is raised on all ranks."""
    mine = {"batch": input_ids.shape[0], "length": input_ids.shape[1], "ids": fingerprint(input_ids),
            "mask": fingerprint(attention_mask), "cache": cache.seq_len, "sampling": int(do_sample),
            "rng": _rng_fingerprint(device) if do_sample else 0}
    table = comm.all_gather_ints(list(mine.values()), "the input check before generation")
    found = differing(table, list(mine))
    if "batch" in found:
        raise ValueError(
            f"the ranks passed batch sizes {found['batch']} (by rank); every rank of a sequence-parallel group "
            "must pass the same full batch of prompts to hf_ring.generate"
        )
    if found.keys() & {"length", "ids", "mask"}:
        raise ValueError(
            f"the ranks passed different prompts (lengths {[row[1] for row in table]} by rank); every rank of a "
            "sequence-parallel group must pass the same full input_ids and attention_mask (hf_ring shards them "
            "itself)"
        )
    if "cache" in found:
        raise ValueError(f"the ranks' past_key_values hold different lengths {found['cache']}; pass each rank its "
                         "own cache returned by the same hf_ring.generate call")
    if any(row[5] for row in table) and "rng" in found:
        raise ValueError(
            "do_sample=True needs the same random state on every rank, or the ranks would sample different tokens; "
            "call transformers.set_seed(seed) with one seed on every rank before hf_ring.generate"
        )


def _pre_forward(state: Generation):
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None:
            raise ValueError("hf_ring.generate runs on input_ids; inputs_embeds are not supported")
        cache, world = state.cache, state.cache.world_size
        b, m = ids.shape
        if cache.seq_len == 0 and min(shard_sizes(m, world, cache.layout, cache.ulysses)) > 0:
            mask = kwargs.get("attention_mask")
            if mask is not None and not isinstance(mask, torch.Tensor):
                raise NotImplementedError(
                    f"this transformers release's generate hands {type(module).__name__} masks it made for the whole "
                    f"prompt ({type(mask).__name__}), which hf_ring cannot split over the ranks; generate it with "
                    "transformers 5.24 (tested), or in one process")
            # The ranks already agreed on the prompt (_agree), so the batch fingerprint is not needed here.
            prefill = ShardedForward.over(state.sp if state.comm is not None else None, m, cache.layout,
                                          padded=mask is not None and not bool(mask.all()),
                                          left_padding=left_padding(mask))
            pos = cache.begin_prefill(m, prefill).to(ids.device)
            if has_media(kwargs):  # the towers see whole images; the language model's call is split
                kwargs[CONTEXT_KEY] = MediaForward(prefill, pos)
            else:
                positions = kwargs.get("position_ids")
                if positions is None:
                    positions = torch.arange(m, device=ids.device).expand(b, m)
                kwargs["input_ids"] = ids[:, pos]
                kwargs["position_ids"] = positions[..., pos]
                if mask is not None:
                    kwargs["attention_mask"] = mask[:, pos]
                kwargs[CONTEXT_KEY] = prefill
            # The owner's last local row is the prompt's last token.
            state.src = owner(m - 1, m, world, cache.layout, cache.ulysses)
        else:
            # Later tokens, and prompts too short to give every rank a row, run on every rank.
            kwargs[CONTEXT_KEY] = DecodeStep(cache, state.comm, cache.begin_step(m), check_ids=ids)
            state.src = 0 if state.broadcast_logits else None
        return args, kwargs

    return hook


def _post_forward(state: Generation):
    def hook(module, args, kwargs, output):
        if state.comm is None or state.src is None:
            return output
        logits = output.logits[:, -1:].contiguous()
        output.logits = state.comm.broadcast(logits, state.src, "the next-token logits broadcast")
        return output

    return hook


def _unwrap(model):
    while not hasattr(model, "generate") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "generate"):
        raise TypeError(f"model must be a transformers model with .generate, got {type(model).__name__}")
    return model


def _check_inputs(input_ids, attention_mask) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise TypeError(f"input_ids must be an integer tensor (batch, prompt length), got "
                        f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")


def _check_same_output(comm: RingComm, result: Any) -> None:
    """The ranks' output sequences are equal (the last token was checked by no later step)."""
    sequences = result if isinstance(result, torch.Tensor) else result.sequences
    digests = [row[0] for row in comm.all_gather_ints([fingerprint(sequences)], "the output check after generation")]
    if len(set(digests)) > 1:
        raise RanksDivergedError("the ranks generated different sequences")


def generate(model, input_ids: Tensor, attention_mask: Optional[Tensor] = None, *,
             allow_beyond_max_positions: bool = False, broadcast_logits: bool = False, **generate_kwargs: Any):
    """``model.generate`` over a sequence-parallel group, with the KV cache sharded across its ranks.

    Every rank of the group calls this with the same full ``input_ids`` (and
    ``attention_mask`` for left padding); each keeps only its part of the
    prompt's K/V, and every rank returns the same sequences. Outside
    sequence parallelism it is ``model.generate`` with the same semantics.
    ``generate_kwargs`` are ``model.generate``'s (``max_new_tokens``,
    ``do_sample``, ``eos_token_id``, ``streamer`` (used on rank 0 only), ...);
    ``past_key_values`` (or ``cache``, its name from transformers 5.24) may be a
    :class:`hf_ring.ShardedCache` returned by an earlier call (``return_dict_in_generate=True``) on the same ranks.
    Positions past ``config.max_position_embeddings`` are refused unless the
    RoPE type is ``dynamic`` or ``allow_beyond_max_positions=True``. A bad
    argument on any rank raises the same error on every rank of the group.
    Every rank computes the same logits at each decoding step, and the ranks
    check they ran the same tokens (:class:`hf_ring.RanksDivergedError` if
    not); ``broadcast_logits=True`` sends rank 0's logits to every rank at
    each step instead, for ranks that may round differently.
    """
    sp = current()
    if sp is not None and sp.tp_size > 1:  # the same on every rank: the setup is
        raise NotImplementedError(
            f"hf_ring.generate does not support tensor parallelism (tp_size={sp.tp_size}): the sharded cache and its "
            "eviction count heads from 0 on every rank. Generate under a setup with tp_size=1, from the model loaded "
            "whole"
        )
    comm = sp.comm if sp is not None and sp.sp_size > 1 else None
    with fail_together(comm, "the argument check before generation"):
        model, cache = _prepare(model, input_ids, attention_mask, sp, comm, allow_beyond_max_positions, generate_kwargs)
    if cache is None:  # not ring_dilated, one process: transformers' own generate
        return model.generate(input_ids, attention_mask=attention_mask, **generate_kwargs)
    if comm is not None:
        _agree(comm, input_ids, attention_mask, cache, bool(_setting(model, generate_kwargs, "do_sample")), model.device)
        if comm.rank != 0:
            generate_kwargs.pop("streamer", None)
    cache.comm = comm  # the cache deals the rows still visible after the prefill out over the group
    state = Generation(cache, comm, sp, broadcast_logits=bool(broadcast_logits))
    stepped = peft_base(model)  # a PEFT model's generate calls its base model's forward
    hooks = [stepped.register_forward_pre_hook(_pre_forward(state), with_kwargs=True),
             stepped.register_forward_hook(_post_forward(state), with_kwargs=True)]
    try:
        result = model.generate(input_ids, attention_mask=attention_mask, **{CACHE_KEYWORD: cache}, **generate_kwargs)
    finally:
        for h in hooks:
            h.remove()
    if comm is not None:
        _check_same_output(comm, result)
    return result


def _setting(model, generate_kwargs: dict, name: str):
    """A generation setting: the call's keyword, else the generation config's value."""
    gen_config = generate_kwargs.get("generation_config") or model.generation_config
    return generate_kwargs.get(name, getattr(gen_config, name, None))


def _prepare(model, input_ids, attention_mask, sp, comm: Optional[RingComm], allow_beyond: bool,
             generate_kwargs: dict) -> Tuple[Any, Optional[ShardedCache]]:
    """Every check that needs no other rank; the unwrapped model and the cache to generate with.

    The cache is None when the model is not ``ring_dilated`` (then one process
    runs transformers' own generate). Pops the cache (``past_key_values`` or ``cache``) from ``generate_kwargs``.
    """
    model = _unwrap(model)
    _check_inputs(input_ids, attention_mask)
    for key, why in _UNSUPPORTED.items():
        if generate_kwargs.get(key) is not None:
            raise ValueError(f"hf_ring.generate does not take {key}: {why}")
    config = ring_config.decoder_config(model.config)  # a multimodal model's cache holds its language model's rows
    setting = lambda name: _setting(model, generate_kwargs, name)  # noqa: E731
    n = input_ids.shape[1]
    max_new = setting("max_new_tokens")
    total = n + max_new if max_new is not None else max(n, setting("max_length") or n)
    check_length(config, n, total, allow_beyond)
    if not ring_config.runs_ring(model.config):
        if comm is not None:
            raise ValueError(other_attention_message(model))
        return model, None
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        raise ValueError("hf_ring.generate does not take a prompt-learning PEFT model (prefix or prompt tuning): its "
                         "virtual tokens are not split; merge or use a weight adapter such as LoRA")
    problem = generate_cache_problem(peft_base(model))
    if problem is not None and comm is None:  # nothing to shard: transformers' own generate
        return model, None
    if problem is not None:
        raise NotImplementedError(f"hf_ring.generate shards the cache generate hands the model: {problem}")
    if setting("use_cache") is False:
        raise ValueError("hf_ring.generate keeps a sharded KV cache; use_cache=False is not supported")
    if (setting("num_beams") or 1) > 1:
        raise ValueError("hf_ring.generate supports greedy decoding and sampling, not beam search (num_beams > 1)")
    if comm is not None:
        apply_patches(model)  # the rotary modules of this model see the global length, whatever its family
    rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
    layout = sp.layout if comm is not None else ring_config.parse(getattr(config, ring_config.CONFIG_KEY, None)).layout
    ulysses = sp.ulysses_size if comm is not None else 1
    cache = cache_argument(generate_kwargs, pop=True)
    if cache is None:
        cache = sharded_cache_class(own_cache(model))(rank, world, layout, ulysses=ulysses)
        cache.set_rules(layer_rules(config, cache.evict))
        cache.set_recurrent(recurrent_layers(model))
        return model, cache
    if not isinstance(cache, ShardedCache):
        raise TypeError(
            f"past_key_values must be a hf_ring.ShardedCache returned by hf_ring.generate, got {type(cache).__name__}"
        )
    if not cache.same_layout(rank, world, layout, ulysses):
        raise ValueError(
            f"past_key_values was made for rank {cache.rank} of {cache.world_size} with layout {cache.layout!r} "
            f"(ulysses_size {cache.ulysses}), but this is rank {rank} of {world} with layout {layout!r} (ulysses_size "
            f"{ulysses}); continue a cache only on the ranks and layout that made it"
        )
    cache.set_rules(layer_rules(config, cache.evict))
    cache.set_recurrent(recurrent_layers(model))
    return model, cache
