"""Generation with and without eviction on every rank of a pool (module-level so it pickles)."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import hf_ring

UNREAD = "leaves positions unread"
"""hf_ring's warning for a dilated pattern whose rates exceed the query heads (some positions no head reads)."""


def _generate(model, ids, mask, cache, continue_with, kwargs):
    """hf_ring.generate on ``cache``, recording after every forward what each layer and row set holds."""
    held = []  # per forward: per layer, per row set, (positions, bytes of the layer)

    def record(module, args, output):
        held.append([([rs.held().clone() for rs in cache.row_sets(i)], cache.layers[i].nbytes())
                     for i in range(len(cache.layers))])

    hook = model.register_forward_hook(record)
    try:
        out = hf_ring.generate(model, ids, attention_mask=mask, past_key_values=cache, **kwargs)
        if continue_with:
            seq = out.sequences
            more = None if mask is None else torch.cat([mask, torch.ones_like(seq[:, mask.shape[1]:])], 1)
            first = torch.stack(out.logits, 1)
            out = hf_ring.generate(model, seq, attention_mask=more,
                                   **dict(kwargs, past_key_values=out.past_key_values, max_new_tokens=continue_with))
            logits = torch.cat([first, torch.stack(out.logits, 1)], 1)
        else:
            logits = torch.stack(out.logits, 1)
    finally:
        hook.remove()
    row_bytes = [layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size() for layer in cache.layers]
    return {"sequences": out.sequences, "logits": logits, "held": held, "rules": cache.rules, "kv_row_bytes": row_bytes}


def evict_case(path, ids, mask=None, *, pattern=None, layout="zigzag", continue_with=0, **kwargs):
    """``hf_ring.generate`` with the sharded cache evicting and keeping every row, on this rank.

    Runs in one process too (no process group: one rank). Returns both runs'
    sequences and step logits, and the rows each layer's row sets held after every forward; ``"unread"``: whether
    hf_ring warned that the pattern leaves positions unread.
    """
    from models import load

    sp = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if sp else (0, 1)
    if sp:
        hf_ring.setup_sequence_parallel(None, layout=layout)
    try:
        with warnings.catch_warnings(record=True) as caught:  # what the pattern leaves unread, kept for the test
            model = load(path, "ring_dilated")
            hf_ring.configure(model, pattern=pattern, layout=layout)
            kwargs = dict(kwargs, return_dict_in_generate=True, output_logits=True)
            found = {evict: _generate(model, ids, mask, hf_ring.ShardedCache(rank, world, layout, evict=evict),
                                      continue_with, kwargs)
                     for evict in (True, False)}
        for w in caught:
            if UNREAD not in str(w.message):
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        found["unread"] = any(UNREAD in str(w.message) for w in caught)
        return found
    finally:
        if sp:
            hf_ring.clear_sequence_parallel()
