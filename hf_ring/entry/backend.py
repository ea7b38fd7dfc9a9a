"""The ``ring_dilated`` attention backend transformers calls, and its mask function.

One plain function, as transformers' own backends are: it takes the layer's
rotated ``(B, H, S, D)`` query/key/value and returns ``(out (B, S, Hq, D), None)``.
It dispatches on what the forward carries (see :mod:`hf_ring.integration.context`):

- a :class:`~hf_ring.integration.context.ShardedForward` (from :func:`hf_ring.shard_batch`
  or a sharded prefill): the ring over the sequence-parallel group, agreed once per forward;
- a context that decodes (:class:`~hf_ring.generation.step.DecodeStep`, from
  :func:`hf_ring.generate`): new tokens over this rank's cache rows, merged across the ranks;
- nothing, in one process: whole sequences run the ring on this process alone,
  new tokens over transformers' own cache attend the cached rows at the positions
  the cache reports. Under sequence parallelism a forward without a context is refused.

A multimodal model's towers (:func:`~hf_ring.entry.media.is_tower`) are not
the split decoder: their calls go to transformers' ``sdpa``, with their own masks.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Tuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from ..engine.agreement import full_key_mask, option_codes
from ..engine.checks import check_options, check_qkv, check_sinks, check_softcap, check_spans_option
from ..engine.decode import CachedBlock, cached_attention, cached_blocks
from ..engine.documents import Documents, check_documents, chunk_ids, documents_of_call, starts_of_ids
from ..engine.layout import head_split
from ..engine.merge import add_sinks
from ..engine.ring import run
from ..engine.spans import Spans, spans_of_ids, within_documents
from ..engine.spec import AttentionSpec
from ..engine.ulysses import head_parallel
from ..patches import at_global_positions, check_supported
from ..integration import config as ring_config
from ..integration.context import CONTEXT_KEY, ForwardContext, ShardedForward, refuse_unsharded
from ..integration.groups import current, tp_place
from ..integration.masks import MaskRead, RingMask, remaps_packed_rows
from .media import MediaForward, is_tower
from ..integration.tp import tensor_parallel_head_base

Tensor = torch.Tensor

NAME = ring_config.ATTN_IMPLEMENTATION

UNSUPPORTED_KWARGS = {
    "head_mask": "head masks are not implemented by ring_dilated",
    "sliding_window_pattern": "per-call sliding window patterns are not implemented by ring_dilated",
    "attention_chunk_size": "a chunk size given to the attention call (not in its mask) is not implemented by "
                            "ring_dilated",
    "block_sequence_ids": "bidirectional blocks given to the attention call (not in its mask) are not implemented "
                          "by ring_dilated",
    "position_bias": "an additive position bias on the scores is not implemented by ring_dilated",
}
"""Keywords that would change the attention's result and are not implemented: refused rather than dropped.
``s_aux`` (attention sinks), ``softcap``, ``position_ids``/``cu_seq_lens_q``/``cu_seq_lens_k`` (packed
documents) and ``is_causal`` are honoured."""


def _key_mask_2d(attention_mask: Any) -> Optional[Tensor]:
    """The 2-D padding mask of a whole-sequence forward (True = may attend), or None."""
    if isinstance(attention_mask, RingMask):
        attention_mask = attention_mask.padding
    if attention_mask is None:
        return None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        return attention_mask.to(torch.bool)
    raise ValueError(
        f"ring_dilated takes a 2-D padding mask (batch, keys) and builds causality, windows and dilation itself; "
        f"got an attention_mask of shape {tuple(getattr(attention_mask, 'shape', ()))}. Pass the 2-D "
        "attention_mask from the tokenizer (or none) instead of a prepared 4-D mask"
    )


def _autocast_alike(query: Tensor, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Under autocast the rotary embedding hands back fp32 q/k beside a lower-precision v; run them in autocast's
    dtype, as sdpa does. Outside autocast, mixed dtypes are left for the checks to refuse."""
    if query.dtype == key.dtype == value.dtype:
        return query, key, value
    device = query.device.type
    if not torch.is_autocast_enabled(device):
        return query, key, value
    dtype = torch.get_autocast_dtype(device)
    return query.to(dtype), key.to(dtype), value.to(dtype)


DROPOUT_SETTINGS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout",
                    "attention_dropout_prob", "attn_dropout_prob")
"""The names model families give their attention-dropout setting (GPT-2: ``attn_pdrop``, BERT-like:
``attention_probs_dropout_prob``); MPT and DBRX keep theirs in ``config.attn_config``."""


def _dropout_setting(config: Any) -> str:
    """The config attribute holding the model's nonzero attention dropout (``attention_dropout`` if none is found)."""
    nested = getattr(config, "attn_config", None)
    for prefix, holder in (("", config), ("attn_config.", nested)):
        for name in DROPOUT_SETTINGS:
            value = holder.get(name) if isinstance(holder, dict) else getattr(holder, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value:
                return prefix + name
    return "attention_dropout"


HONOURED_TENSORS = ("position_ids", "s_aux", "cu_seq_lens_q", "cu_seq_lens_k", "encoder_hidden_states",
                    "encoder_attention_mask")
"""Tensor keywords a self-attention call may carry that ring_dilated honours, or that belong to other modules."""


def _refuse_unsupported(dropout: float, training: bool, kwargs: dict, config: Any = None,
                        scores: Tuple[int, int] = (-1, -1)) -> None:
    if dropout and training:
        name = _dropout_setting(config)
        load = "" if "." in name else f"load the model with from_pretrained(..., {name}=0.0), or "
        raise ValueError(
            f"ring_dilated does not implement attention dropout (got dropout={dropout} in training); {load}set "
            f"config.{name} = 0.0 before the model is built (its attention layers copy the value when built)"
        )
    for name, why in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the model passed {name}= to the attention: {why}; use "
                                      "attn_implementation='eager'")
    for name, value in kwargs.items():  # a score-shaped tensor under a name not listed is a bias all the same
        bias = (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2
                and tuple(value.shape[-2:]) == scores)
        if bias and name not in HONOURED_TENSORS:
            raise NotImplementedError(f"the model passed {name}= (shape {tuple(value.shape)}, one value per query "
                                      "and key) to the attention, which ring_dilated would drop; use "
                                      "attn_implementation='eager'")


def ring_dilated_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> Tuple[Tensor, None]:
    """transformers attention function for ``attn_implementation="ring_dilated"``."""
    forward = kwargs.get(CONTEXT_KEY)
    if is_tower(module.config):
        return _tower(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    decoding = isinstance(forward, ForwardContext) and forward.decodes
    sp = current()
    sharded = sp is not None and sp.sp_size > 1
    whole = query.shape[2] == key.shape[2]  # else new tokens over a cache
    read = None
    if isinstance(attention_mask, RingMask):  # its function describes one rank's rows, or (made before a split) all
        covers = isinstance(forward, ShardedForward) and attention_mask.size[1] == forward.seq_len
        read = attention_mask.read(partial=sharded and not covers)
    try:  # under sequence parallelism a rank whose arguments fail makes every rank raise, at once
        if isinstance(forward, MediaForward):
            raise ValueError(f"the {module.config.model_type} language model ran before its multimodal model split "
                             "the sequence; call the model that shard_batch's batch was made for")
        _refuse_unsupported(dropout, module.training, kwargs, module.config, (query.shape[2], key.shape[2]))
        if _custom_mask(attention_mask, whole):
            return _under_custom_mask(module, query, key, value, attention_mask, dropout, scaling,
                                      sharded or decoding or isinstance(forward, ShardedForward), kwargs)
        if read is not None and read.refusal is not None:
            raise NotImplementedError(
                f"ring_dilated cannot compute the attention mask of this {module.config.model_type} model: "
                f"{read.refusal}. Run it with attn_implementation='sdpa' (or 'eager')")
        query, key, value = _autocast_alike(query, key, value)
        if not query.dtype == key.dtype == value.dtype:
            raise TypeError(f"q, k, v must share one dtype; got q={query.dtype}, k={key.dtype}, v={value.dtype}")
        # transformers' own backends let an explicit is_causal win over the module's attribute; the mask the
        # model built is what sdpa and eager compute, so what it says wins over both (and over the window keyword).
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if read is not None:
            causal, sliding_window = read.causal, read.window
        cfg = ring_config.parse(getattr(module.config, ring_config.CONFIG_KEY, None))
        spec = _layer_spec(module, cfg, query, causal, scaling, sliding_window, kwargs)
        # Under tensor parallelism this rank holds a slice of the heads; dilation offsets count from global heads.
        spec = spec.at(head_base=tensor_parallel_head_base(*tp_place(), query.shape[1], key.shape[1], module.config))
        # the ring's routes: a forward over shards, or whole sequences in one process
        ring_route = whole and not decoding and (isinstance(forward, ShardedForward) or not sharded)
        if ring_route:
            check_qkv(query, key, value)
            if isinstance(forward, ShardedForward):
                # a forward over shards: its layout, length, documents and this rank's key padding. A model whose
                # saved layout or ulysses_size differs from the setup's was refused at its call
                # (guard.refuse_other_shape). The heads must serve the head-parallel groups:
                head_split(query.shape[1], key.shape[1], forward.ulysses)
                documents, spans = _sharded_mask(forward, read, query.shape[0])
                spec = spec.at(layout=forward.layout, seq_len=forward.seq_len, documents=documents,
                               spans=check_spans_option(spans, spec, query.shape[0], forward.seq_len),
                               key_mask=_key_mask_2d(attention_mask))
            else:
                key_valid = _key_mask_2d(attention_mask)
                documents = documents_of_call(query.shape[0], query.shape[2], kwargs.get("position_ids"),
                                              kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"),
                                              key_valid is not None or read is not None)
                documents, spans = _whole_mask(read, documents, query.shape[0], query.shape[2])
                any_padded = key_valid is not None and not bool(key_valid.all())
                spec = spec.at(seq_len=query.shape[2], documents=documents,
                               spans=check_spans_option(spans, spec, query.shape[0], query.shape[2]),
                               key_mask=full_key_mask(key_valid, key, any_padded))
        elif read is not None and read.chunk is not None and decoding:
            raise NotImplementedError(
                f"chunked attention ({module.config.model_type}, attention_chunk_size={read.chunk}) is not "
                "implemented over hf_ring.generate's sharded cache; generate with model.generate in one process")
    except (TypeError, ValueError, NotImplementedError) as err:
        if isinstance(forward, (ShardedForward, MediaForward)):
            forward.fail(err)
        raise
    if decoding:
        out = forward.attend(module, query, key, value, _key_mask_2d(attention_mask), spec)
    elif not whole:
        if sharded:
            raise NotImplementedError(
                "ring_dilated got a KV cache while the sequence is split across ranks; generate with "
                "hf_ring.generate(model, input_ids, ...), which keeps the cache sharded"
            )
        out = _over_cache(query, key, value, attention_mask, spec)
    elif isinstance(forward, ShardedForward):
        out = _sharded(module, at_global_positions(module, query, forward.rows(query.device)), key, value,
                       spec, forward)
    elif sharded:
        refuse_unsharded(sp.comm, query, key, spec)
    else:  # whole sequences in one process: the ring on this process alone
        out = run(query, key, value, None, spec)
    return out.transpose(1, 2).contiguous(), None


def _custom_mask(attention_mask: Any, whole: bool) -> bool:
    """Whether the call carries a 4-D mask of the caller's own (transformers hands a 4-D ``attention_mask`` given to
    the model to the attention as it is): over the call's own rows, where ring_dilated's mask function makes none,
    or an additive one over a cache, where it makes a boolean one."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and (
        whole or attention_mask.is_floating_point())


def _under_custom_mask(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor, dropout: float,
                       scaling: Optional[float], split: bool, kwargs: dict) -> Tuple[Tensor, None]:
    """A call with a 4-D mask of the caller's own (tree or speculative decoding, a block mask of packed rows): in one
    process it is the attention ``sdpa`` computes, boolean or additive, any batch and head broadcast; what the mask
    says wins over causality and the window, as it does there. With the sequence split the mask, one row per query
    of the whole sequence, is refused: no rank holds the rows it would need."""
    if split:
        raise ValueError(
            f"a 4-D attention_mask of shape {tuple(attention_mask.shape)} was given to a {module.config.model_type} "
            "model whose sequence is split across ranks (or generated by hf_ring.generate): a mask of every query "
            "against every key is not sharded by hf_ring; pass the 2-D padding mask (and position_ids for packed "
            "documents), or run the model in one process")
    pattern = ring_config.parse(getattr(module.config, ring_config.CONFIG_KEY, None)).pattern
    unsupported = [name for name, value in (("a dilated pattern (config.ring_dilated)", pattern),
                                            ("softcap", kwargs.get("softcap")), ("s_aux (sinks)", kwargs.get("s_aux")))
                   if value is not None]
    if unsupported:
        raise NotImplementedError(
            f"ring_dilated computes a 4-D attention_mask of the caller's own as sdpa does, which takes no "
            f"{' and no '.join(unsupported)}; run this model with attn_implementation='eager'")
    rest = {k: v for k, v in kwargs.items() if k not in (CONTEXT_KEY, "sliding_window", "position_ids")}
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=False, **rest)


def _whole_mask(read: Optional[MaskRead], documents: Optional[Documents], batch: int,
                n: int) -> Tuple[Optional[Documents], Optional[Spans]]:
    """The documents (packed rows, cut into chunks) and bidirectional spans of a whole-sequence call in one
    process: from the model's mask function, which must agree with flash-style ``cu_seq_lens`` where both are
    given (``documents``: what the call's keywords mark)."""
    if read is None:
        return documents, None
    from_mask = starts_of_ids(read.documents, None if read.chunk is None else
                              chunk_ids(read.chunk, read.chunk_start, read.chunk_positions, n))
    from_mask = check_documents(from_mask, batch, n)
    if documents is not None and read.chunk is None and documents != from_mask:
        raise ValueError("the documents the call's cu_seq_lens mark differ from those its mask function separates; "
                         "pass the position_ids and cu_seq_lens the collator made together")
    spans = None if read.blocks is None else within_documents(spans_of_ids(read.blocks), from_mask, n)
    return from_mask, spans


def _sharded_mask(forward: ShardedForward, read: Optional[MaskRead],
                  batch: int) -> Tuple[Optional[Documents], Optional[Spans]]:
    """The documents and spans of one rank's call of a forward over shards: the forward's global facts, cut into
    the chunks the mask function asks for (its data pieces hold only this rank's rows and are not read)."""
    if read is None or read.chunk is None:
        documents = forward.documents
    else:
        documents = forward.chunked(read.chunk, remaps_packed_rows())
    if read is not None and read.blocks is not None:  # blocks are read only from a function of every row
        return documents, within_documents(spans_of_ids(read.blocks), documents, forward.seq_len)
    return documents, None


def _tower(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, dropout: float,
           scaling: Optional[float], is_causal: Optional[bool], kwargs: dict) -> Tuple[Tensor, None]:
    """A tower's attention (over its own patches, in one piece on every rank): transformers' ``sdpa``."""
    forward = kwargs.pop(CONTEXT_KEY, None)
    if isinstance(forward, ForwardContext):
        error = ValueError(f"the {module.config.model_type} tower was given sequence-sharded inputs; its images stay "
                           "whole: give shard_batch the multimodal batch (with its pixel_values), which splits the "
                           "sequence where the language model starts")
        if isinstance(forward, ShardedForward):
            forward.fail(error)
        raise error
    if isinstance(attention_mask, RingMask):
        raise ValueError(f"the {module.config.model_type} tower was handed a mask made for the language model")
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _layer_spec(module, cfg: ring_config.RingConfig, query: Tensor, causal: Any, scaling: Any, sliding_window: Any,
                kwargs: dict) -> AttentionSpec:
    """What this layer's attention computes, from the model's parsed ``config.ring_dilated`` and the call's
    keywords (checked)."""
    ring_config.warn_coverage(cfg.pattern, module.config)  # a saved pattern may leave positions unread
    spec = check_options(causal, sliding_window, cfg.pattern, scaling, query.shape[-1], cfg.layout)
    return spec.at(softcap=check_softcap(kwargs.get("softcap")), sinks=check_sinks(kwargs.get("s_aux"), query.shape[1]))


def _sharded(module, query: Tensor, key: Tensor, value: Tensor, spec: AttentionSpec, forward: ShardedForward) -> Tensor:
    """The ring (or head parallelism) over the shards of one forward; the ranks agree once per kind of layer.

    ``spec.key_mask`` is this rank's rows' padding (None: no padding here). A
    rank that holds no row of the sequence runs the model on a placeholder
    row: the ring gets none of it, and its output there is zero.
    """
    forward.mixing()
    if forward.placeholder:
        key_valid = spec.key_mask
        out = _sharded(module, query[:, :, :0], key[:, :, :0], value[:, :, :0],
                       spec.at(key_mask=None if key_valid is None else key_valid[:, :0]),
                       replace(forward, placeholder=False))
        return torch.cat([out, out.new_zeros(*out.shape[:2], query.shape[2], out.shape[3])], dim=2)
    codes = option_codes(spec) + [("ulysses_size", forward.ulysses)]
    if forward.agree(query, key, spec, codes) and forward.world_size > 1:
        check_supported(module.config)  # once per forward: the family does not change between layers
    key_mask = full_key_mask(spec.key_mask, key, forward.padded)
    if forward.ulysses > 1:
        spec = spec.at(key_mask=None if key_mask is None else forward.group_key_mask(key_mask))
        return head_parallel(query, key, value, forward.head_comm, forward.ring_comm,
                             head_split(query.shape[1], key.shape[1], forward.ulysses), forward.group_sizes(), spec)
    return run(query, key, value, forward.comm, spec.at(key_mask=key_mask))


def _is_cache_mask(attention_mask: Any) -> bool:
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4


def _over_cache(query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, spec: AttentionSpec) -> Tensor:
    """New tokens over transformers' own cache in one process.

    The mask function gives such a forward the cache's own 4-D mask (what
    ``sdpa`` uses): it knows where a static, sliding or chunked cache keeps
    each position, which rows are unwritten, and the padding. Dense attention
    uses it as it is. A dilated pattern also needs positions: keys are taken
    to hold positions ``0..kv_len-1`` with the queries last, as a dynamic cache
    does, and a cache laid out otherwise is refused.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = attention_mask
    if isinstance(mask, RingMask) and q_len == 1 and (mask.padding is None or mask.padding.shape[-1] == kv_len):
        # A mask made for the new row alone (MiniMax's cache reports no rows to transformers' mask sizes): every
        # cached row comes before the one new row, so it attends each that the padding keeps, as sdpa's does
        mask = None if mask.padding is None else mask.padding.to(torch.bool)[:, None, None, :]
    if isinstance(mask, RingMask):
        raise NotImplementedError(
            f"the model attends {q_len} query rows over {kv_len} key rows in a forward without a KV cache (keys "
            "it adds or drops itself); ring_dilated computes attention over the call's own rows or over a cache: "
            "use attn_implementation='sdpa' (or 'eager')")
    if mask is not None and not (_is_cache_mask(mask) and mask.dtype == torch.bool):
        raise ValueError(
            "over a KV cache ring_dilated expects the boolean 4-D mask its own mask function builds from the 2-D "
            f"padding mask; got {type(mask).__name__} {tuple(getattr(mask, 'shape', ()))} "
            f"{getattr(mask, 'dtype', '')}. Pass the 2-D attention_mask from the tokenizer (or none)"
        )
    if spec.pattern is None:
        groups = [(range(query.shape[1]), range(key.shape[1]))]
        blocks = [CachedBlock(q, k, None, None, None) for q, k in groups]
    else:
        if mask is not None and not bool(mask[:, :, -1, -1].all()):
            raise ValueError(
                "a dilated ring_dilated pattern over a pre-allocated (static or sliding) transformers cache is not "
                "supported: its rows do not hold positions 0..n-1 in order. Use the default dynamic cache, or "
                "hf_ring.generate"
            )
        k_pos = torch.arange(kv_len)
        blocks = cached_blocks(k_pos[kv_len - q_len:], k_pos, hq=query.shape[1], hkv=key.shape[1], causal=spec.causal,
                               window=spec.window, branches=spec.branches, head_offset=spec.head_base)
    out, lse = cached_attention(query, key, value, blocks, scale=spec.scale, pair_mask=mask, softcap=spec.softcap)
    if spec.sinks is not None:  # one process: nothing to merge across ranks, only the sinks to join
        out, lse = add_sinks(out, lse, spec.sinks)
    return out.to(query.dtype)


def ring_dilated_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                      mask_function: Any = None, attention_mask: Optional[Tensor] = None,
                      **kwargs: Any) -> Any:
    """Mask function for ``ring_dilated``.

    A whole-sequence forward gets a :class:`~hf_ring.integration.masks.RingMask`: the 2-D
    key padding mask and the model's mask function, which the attention reads
    into the ring's terms (causality, window, chunks, documents, bidirectional
    blocks) or refuses (:mod:`hf_ring.integration.masks`) and applies from
    global positions, since a mask of the whole sequence would be quadratic.
    A forward over a KV cache gets the cache's own 4-D boolean mask, the one
    ``sdpa`` would use, since only the cache knows where its rows sit; a
    tower's call gets the mask ``sdpa`` would, for its own attention.
    """
    if is_tower(kwargs.get("config")):  # a tower's own mask, for its own attention (see _tower)
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function or causal_mask_function,
                         attention_mask, **kwargs)
    over_cache = q_length != kv_length or int(q_offset) != 0 or int(kv_offset) != 0
    if isinstance(attention_mask, RingMask):  # prepared already, for this call or for the prompt before a cache
        if not over_cache and attention_mask.rows_seen == (batch_size, q_length):
            return attention_mask
        attention_mask = attention_mask.padding
    if not over_cache:
        padding = None if attention_mask is None else attention_mask.to(torch.bool)
        return RingMask(padding, mask_function or causal_mask_function, (batch_size, kv_length))
    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function or causal_mask_function,
                     attention_mask, allow_is_causal_skip=False, **kwargs)


# Outside a compiled graph on purpose: the attention holds collectives, agreements and host-side plans, and the
# mask hook reads the mask function's closures on the host.
_ATTENTION = torch.compiler.disable(ring_dilated_attention)
_MASK = torch.compiler.disable(ring_dilated_mask)


def _as_sdpa_when_compiled(module, query: Tensor, key: Tensor, attention_mask: Any, kwargs: dict) -> bool:
    """Whether a call inside a compiled graph is one ``sdpa`` computes as ring_dilated does, so that it is traced
    rather than a graph break (which ``fullgraph=True`` refuses): new rows over transformers' own cache in one
    process (a compiled decoding step, a static cache's), dense (no saved pattern, soft cap or sinks), with the
    cache's own mask. Every other call leaves the graph for :func:`ring_dilated_attention`."""
    sp = current()
    return (query.shape[2] != key.shape[2] and kwargs.get(CONTEXT_KEY) is None and (sp is None or sp.sp_size == 1)
            and getattr(module.config, ring_config.CONFIG_KEY, None) is None and kwargs.get("softcap") is None
            and kwargs.get("s_aux") is None and (attention_mask is None or isinstance(attention_mask, torch.Tensor)))


def attention_entry(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                    **kwargs: Any) -> Tuple[Tensor, None]:
    """The function registered as ``ring_dilated``: :func:`ring_dilated_attention` outside a compiled graph, or a
    compiled decoding step traced as ``sdpa`` (:func:`_as_sdpa_when_compiled`)."""
    if torch.compiler.is_compiling() and _as_sdpa_when_compiled(module, query, key, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _ATTENTION(module, query, key, value, attention_mask, **kwargs)


def mask_entry(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
               mask_function: Any = None, attention_mask: Optional[Tensor] = None, **kwargs: Any) -> Any:
    """The mask function registered for ``ring_dilated``: :func:`ring_dilated_mask`, or inside a compiled graph over
    a cache (fewer rows than the cache holds) the cache's own mask, as ``sdpa`` gets it and as
    :func:`ring_dilated_mask` makes it there, traced."""
    if torch.compiler.is_compiling() and q_length != kv_length and not isinstance(attention_mask, RingMask) \
            and not is_tower(kwargs.get("config")):
        kwargs.pop("allow_is_causal_skip", None)
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function or causal_mask_function,
                         attention_mask, allow_is_causal_skip=False, **kwargs)
    return _MASK(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)


def register() -> None:
    """Make ``attn_implementation="ring_dilated"`` available to transformers."""
    AttentionInterface.register(NAME, attention_entry)
    AttentionMaskInterface.register(NAME, mask_entry)
