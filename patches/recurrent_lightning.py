"""MiniMax's lightning attention runs (:mod:`.recurrent`): the layer's own forward, rerun from its true start where
a run does not start the sequence."""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

import torch

from hf_ring.engine.merge import accumulator_dtype
from hf_ring.integration.context import ShardedForward
from hf_ring.integration.seams import CACHE_KEYWORD

from .recurrent_runs import Runs, Scan, by_segment, rank_segments

Tensor = torch.Tensor


class _LinearState:
    """The cache a lightning attention layer is given to start from ``state`` (its ``get_linear_cache``), keeping
    nothing it is given."""

    def __init__(self, state: Tensor):
        self.state = state

    def get_linear_cache(self, layer_idx: int) -> Tensor:
        return self.state

    def set_linear_cache(self, layer_idx: int, state: Tensor) -> None:
        pass


def lightning_runs(forward, context: ShardedForward, inputs: List[Any], rest: Dict[str, Any], scan: Scan) -> Runs:
    """MiniMax's lightning attention, the layer's own ``forward`` (whose output passes a norm and a gate, so a start
    state cannot be added to it afterwards): each segment from a zero state gives its end state (the layer returns
    it); a segment that does not start the sequence (or, per batch row, a document) runs once more from its true
    start, given through the layer's cache. The transition is the decay ``exp(-slope)`` per head to the power of the
    segment's rows."""
    hidden, position_embeddings, mask = inputs
    cache, layer_idx = rest.pop(CACHE_KEYWORD, None), forward.__self__.layer_idx  # (the release's name for it)
    if cache is not None:  # a prefill's: it keeps the whole sequence's end state (lightning_finish)
        if cache.get_linear_cache(layer_idx) is not None:
            context.fail(ValueError("lightning attention over sequence shards was given a cache holding a state to "
                                    "start from: a sharded prefill starts from an empty cache"))
        rest[_KEEP] = functools.partial(cache.set_linear_cache, layer_idx)
    decay = torch.exp(-forward.__self__.slope_rate.to(accumulator_dtype(hidden)))  # (H, 1, 1)
    b = hidden.shape[0]
    runs = Runs(rank_segments(context, hidden.shape[1], b, forward))
    masks = [None] * len(runs.segments) if mask is None else [m for (m,) in by_segment(runs.segments, 1, mask)]
    given = {k: v for k, v in rest.items() if k != _KEEP}
    for seg, (h_s,), m_s in zip(runs.segments, by_segment(runs.segments, 1, hidden), masks):
        out, state = forward(h_s, position_embeddings, m_s, **given)
        again = None if all(seg.fresh) else functools.partial(_lightning_from, forward, h_s, position_embeddings, m_s,
                                                              given)
        runs.add(out, again, state.to(decay.dtype), decay.pow(seg.length).expand(b, -1, -1, -1))
    return runs


_KEEP = "_keep_state"
"""Where :func:`lightning_runs` leaves :func:`lightning_finish` what keeps a prefill's end state in the cache."""


def lightning_finish(out: Tensor, final: Tensor, want_final: bool, rest: Dict[str, Any]):
    keep = rest.get(_KEEP)
    if keep is not None:
        keep(final.to(out.dtype))
    return out, final


def _lightning_from(forward, hidden: Tensor, position_embeddings: Any, mask: Optional[Tensor], rest: Dict[str, Any],
                    start: Tensor) -> Tensor:
    out, _ = forward(hidden, position_embeddings, mask, **{**rest, CACHE_KEYWORD: _LinearState(start.to(hidden.dtype))})
    return out
