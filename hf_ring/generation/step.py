"""A decode step of :func:`hf_ring.generate`: new tokens attended over the sharded cache, merged across the ranks.

Every rank runs the same new tokens; each attends them over its own cache
rows, at the global positions the cache records, and the ranks merge the
partials by log-sum-exp (:mod:`hf_ring.engine.decode`). The step travels to
every layer in the forward's kwargs like a :class:`ShardedForward`, and the
backend hands it the layer's attention (:meth:`DecodeStep.attend`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..engine.comm import RingComm
from ..engine.decode import CachedBlock, cached_attention, cached_blocks, merge_ranks
from ..engine.spec import AttentionSpec
from ..integration.context import ForwardContext
from .cache import ShardedCache
from .retention import KEEP_ALL, rule_for

Tensor = torch.Tensor


@dataclass(eq=False)
class DecodeStep(ForwardContext):
    """A forward of new tokens over a sharded KV cache during :func:`hf_ring.generate`.

    Every rank runs the same new tokens at global positions ``q_pos``; each
    attends them over its own cache rows and the ranks merge the partials.
    ``check_ids``: the step's input tokens, which the first layer's merge
    checks are the same on every rank (see :meth:`take_check`).
    """

    decodes = True

    cache: ShardedCache
    comm: Optional[RingComm]
    q_pos: Tensor
    check_ids: Optional[Tensor] = None
    _blocks: Dict[Any, List[CachedBlock]] = field(default_factory=dict, repr=False)
    _key_masks: List[Tuple[Tensor, Any, Optional[Tensor]]] = field(default_factory=list, repr=False)

    def take_check(self) -> Optional[Tensor]:
        """The token ids to check across ranks, once per step (the first layer's merge carries them)."""
        ids, self.check_ids = self.check_ids, None
        return ids

    def key_mask(self, key_valid: Optional[Tensor], rows: Any, k_pos: Tensor) -> Optional[Tensor]:
        """The 2-D padding mask ``key_valid`` ``(B, total)`` at this rank's cache rows ``k_pos`` of row set ``rows``.

        None when none of them is padded. Every layer of a step passes the
        same mask tensor, and the layers of one row set the same rows, so the
        gather and the check run once per step and row set, not once per layer.
        """
        if key_valid is None:
            return None
        for seen, key, found in self._key_masks:
            if seen is key_valid and key == rows:
                return found
        found = key_valid[:, k_pos.clamp(min=0).to(key_valid.device)]  # an evicted slot's mask is never read
        found = None if bool(found.all()) else found
        self._key_masks.append((key_valid, rows, found))
        return found

    def blocks(self, rows: Any, k_pos: Tensor, hq: int, hkv: int, spec: AttentionSpec, device: torch.device,
               head_offset: int = 0) -> List[CachedBlock]:
        """This step's kernel calls of the layer's attention ``spec`` over the cache rows ``k_pos`` of row set ``rows``.

        Computed by the first layer of the row set, reused by the others.
        ``head_offset``: the first query head's number (a row set of one K/V head).
        """
        causal, window, branches = spec.causal, spec.window, spec.branches
        key = (rows, hq, hkv, causal, window, branches, head_offset, str(device))
        found = self._blocks.get(key)
        if found is None:
            found = self._blocks[key] = [
                CachedBlock(b.q_heads, b.kv_heads,
                            *(None if t is None else t.to(device) for t in (b.q_rows, b.k_rows, b.mask)))
                for b in cached_blocks(self.q_pos, k_pos, hq=hq, hkv=hkv, causal=causal, window=window,
                                       branches=branches, head_offset=head_offset)
            ]
        return found

    def attend(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
               key_valid: Optional[Tensor], spec: AttentionSpec) -> Tensor:
        """New tokens of :func:`hf_ring.generate` over this rank's cache rows, merged across the ranks.

        Each row set of the layer (all its K/V heads, or one K/V head of a
        dilated layer that keeps rows per head) is attended by its query heads
        over its own rows and positions.
        """
        cache = self.cache
        layer_idx = cache.last_updated  # the layer that stored these keys: a block shared across depths (Zamba's)
        # has one module, and one layer_idx attribute, for several layers of the cache
        rule = cache.rule_of(layer_idx)
        branches = spec.branches
        sets = cache.layer_rows(layer_idx)
        _, k_first, v_first = sets[0]  # what the layer's cache update returned the layer: its first row set
        if k_first.shape[3] != key.shape[3] or v_first.shape[3] != value.shape[3] or (
                len(sets) == 1 and k_first.shape[1] != key.shape[1]):
            # The cache holds what the layer makes its keys and values from (multi-head latent attention caches its
            # compressed latents): attend over the keys and values it made, one per cached row, in the cache's order.
            if len(sets) != 1 or sets[0][0].numel() != key.shape[2]:
                raise ValueError(
                    f"layer {layer_idx} caches rows of another shape than the keys and values it attends over (its "
                    "cache holds what they are made from, as multi-head latent attention's does), and the sharded "
                    "cache keeps its rows per K/V head or evicted some; pass past_key_values=hf_ring.ShardedCache("
                    "rank, world, layout, evict=False)")
            sets = [(sets[0][0], key, value)]
        hq, hkv = query.shape[1], sum(k_rows.shape[1] for _, k_rows, _ in sets)
        if rule is not KEEP_ALL and rule != rule_for(spec.window, branches, hq, hkv):
            raise ValueError(
                f"layer {layer_idx} attends with window {spec.window} and branches {list(branches)} over {hq} "
                f"query and {hkv} K/V heads, but the sharded cache kept its rows for window {rule.window} and "
                f"branches {list(rule.branches)}: the model's config (layer_types, sliding_window, ring_dilated, "
                "head counts) does not say what its attention does. Pass "
                "past_key_values=hf_ring.ShardedCache(rank, world, layout, evict=False) to keep every row"
            )
        if len(sets) == 1 and sets[0][0].numel() != key.shape[2]:
            raise RuntimeError(f"the sharded cache records {sets[0][0].numel()} rows but the layer returned "
                               f"{key.shape[2]}")
        per = hq // len(sets)  # the query heads of each row set
        outs, lses = [], []
        for s, (k_pos, k_rows, v_rows) in enumerate(sets):
            q = query if len(sets) == 1 else query[:, s * per:(s + 1) * per]
            blocks = self.blocks((rule, s), k_pos, per, k_rows.shape[1], spec, query.device, head_offset=s * per)
            out, lse = cached_attention(q, k_rows, v_rows, blocks, scale=spec.scale,
                                        key_mask=self.key_mask(key_valid, (rule, s), k_pos), softcap=spec.softcap)
            outs.append(out)
            lses.append(lse)
        out, lse = (outs[0], lses[0]) if len(sets) == 1 else (torch.cat(outs, 1), torch.cat(lses, 1))
        return merge_ranks(out, lse, self.comm, spec.sinks, same_ids=self.take_check()).to(query.dtype)
