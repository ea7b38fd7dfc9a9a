"""Rank functions of the attention tests: ring attention, documents, spans and head parallelism on every rank of a
pool (module-level so they pickle)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hf_ring
from hf_ring.engine.documents import document_starts
from helpers import raises_on_rank


def make_qkv(seed, b, hq, hkv, n, d, dtype=torch.float32, dv=None):
    """Global q, k, v, dout from a seed: every rank and the test build the same tensors; ``dv``: the values' head
    size where it is not the queries' and keys' (multi-head latent attention)."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    shapes = [(b, hq, n, d), (b, hkv, n, d), (b, hkv, n, dv), (b, hq, n, dv)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def key_mask_of(b, n, pad, side="left"):
    """Bool ``(b, n)`` key mask: ``pad`` padded keys of sample 0 at its ``side`` ("left", "right"); "mixed" pads
    sample 0 on the left and the last sample on the right by ``pad + 3``; "all" pads the whole of sample 0;
    "none" pads nothing (a mask of valid keys only); "staggered" left-pads sample i by ``pad·(i+1)//b``."""
    key_mask = torch.ones(b, n, dtype=torch.bool)
    if side in ("left", "mixed"):
        key_mask[0, :pad] = False
    if side == "right":
        key_mask[0, n - pad:] = False
    if side == "mixed":
        key_mask[-1, n - pad - 3:] = False
    if side == "all":
        key_mask[0] = False
    if side == "staggered":
        for i in range(b):
            key_mask[i, :pad * (i + 1) // b] = False
    return key_mask


def ring_case(seed, b, hq, hkv, n, d, *, dtype=torch.float32, layout="zigzag", message_rows=None, pad=0,
              pad_side="left", padded_tile=None, dv=None, **kw):
    """This rank's positions, output and gradients of ring_attention on its shard.

    ``message_rows`` shrinks the per-message budget so shards travel in many small messages.
    ``pad`` masks ``pad`` keys (:func:`key_mask_of` with ``pad_side``); ``padded_tile`` sets the
    tile a block is cut into around a padding edge. ``max_mask`` reports the largest mask side any
    forward kernel got, ``masked_calls`` and ``calls`` how many forward kernel calls had a mask.
    """
    keep = kw.pop("keep", None)
    if keep is not None:  # the forward keeps its K/V for the backward (or never), whatever the sizes
        import hf_ring.engine.ring as ring
        from hf_ring.engine.comm import RingComm

        saved_keep, exchange, made = ring.KEEP_BYTES, RingComm.exchange, [0]

        def counted(self, *args, **kwargs):
            made[0] += 1
            return exchange(self, *args, **kwargs)

        ring.KEEP_BYTES, RingComm.exchange = (1 << 40) if keep else 0, counted
        try:
            res = ring_case(seed, b, hq, hkv, n, d, dtype=dtype, layout=layout, message_rows=message_rows, pad=pad,
                            pad_side=pad_side, padded_tile=padded_tile, **kw)
        finally:
            ring.KEEP_BYTES, RingComm.exchange = saved_keep, exchange
        return dict(res, exchanges=made[0])
    if padded_tile is not None:
        import hf_ring.engine.block_args as block_args
        import hf_ring.engine.ring as ring

        saved_tile, saved_forward = block_args.PADDED_TILE, ring.block_forward
        sides, calls = [0], [0]

        def spy(q, k, v, *, mask=None, **kernel_kw):
            calls[0] += 1
            if mask is not None:
                sides.append(max(mask.shape[-2:]))
            return saved_forward(q, k, v, mask=mask, **kernel_kw)

        block_args.PADDED_TILE, ring.block_forward = padded_tile, spy
        try:
            res = ring_case(seed, b, hq, hkv, n, d, dtype=dtype, layout=layout, message_rows=message_rows, pad=pad,
                            pad_side=pad_side, **kw)
        finally:
            block_args.PADDED_TILE, ring.block_forward = saved_tile, saved_forward
        res.update(max_mask=max(sides), masked_calls=len(sides) - 1, calls=calls[0])
        return res
    if message_rows is not None:
        kw["message_rows"] = message_rows
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    q, k, v, dout = make_qkv(seed, b, hq, hkv, n, d, dtype, dv)
    pos = hf_ring.local_positions(n, rank, world, layout)
    if pad or pad_side == "none":
        kw["key_mask"] = key_mask_of(b, n, pad, pad_side)[:, pos]
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    out = hf_ring.ring_attention(ql, kl, vl, layout=layout, **kw)
    out.backward(dout[:, :, pos])
    return {"pos": pos, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def assemble(results, name, n):
    """Put every rank's rows of ``name`` back in global order."""
    first = results[0][name]
    full = torch.zeros(first.shape[:2] + (n,) + first.shape[3:], dtype=first.dtype)
    for r in results:
        full[:, :, r["pos"]] = r[name]
    return full


def packed_case(seed, b, hq, hkv, n, d, *, position_ids=None, sinks=None, layout="zigzag", pad=0, spy=False,
                message_rows=None, known_starts=False, **kw):
    """This rank's rows and gradients of ring_attention with packed documents, soft-capping and/or sinks.

    ``position_ids`` ``(B, n)`` are the global position ids (this rank passes
    its rows'); ``sinks`` ``(Hq,)`` the global sink logits, whose gradient
    comes back as this rank's share ``dsinks``; ``known_starts`` passes the
    documents as their global starts (no gather), as the
    transformers backend does. ``pad`` masks the first
    ``pad`` keys of sample 0. ``spy`` counts the kernel calls, the (query,
    key) pairs they computed, and the bytes this rank sent. ``message_rows``
    shrinks the per-message budget so shards travel in many small messages.
    """
    import hf_ring.engine.ring as ring

    if message_rows is not None:
        kw["message_rows"] = message_rows

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    q, k, v, dout = make_qkv(seed, b, hq, hkv, n, d)
    pos = hf_ring.local_positions(n, rank, world, layout)
    if pad:
        key_mask = torch.ones(b, n, dtype=torch.bool)
        key_mask[0, :pad] = False
        kw["key_mask"] = key_mask[:, pos]
    if position_ids is not None and known_starts:
        kw["documents"] = document_starts(position_ids)
    elif position_ids is not None:
        kw["position_ids"] = position_ids[:, pos]
    sk = None if sinks is None else sinks.clone().requires_grad_(True)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    counts = {"calls": 0, "pairs": 0, "sent_bytes": 0}
    saved_forward, saved_batch = ring.block_forward, dist.batch_isend_irecv

    def count_forward(qb, kb, vb, **kernel_kw):
        counts["calls"] += 1
        counts["pairs"] += qb.shape[0] * qb.shape[1] * qb.shape[2] * kb.shape[2]
        return saved_forward(qb, kb, vb, **kernel_kw)

    def count_batch(ops):
        counts["sent_bytes"] += sum(op.tensor.numel() * op.tensor.element_size()
                                    for op in ops if op.op.__name__ == "isend")
        return saved_batch(ops)

    if spy:
        ring.block_forward, dist.batch_isend_irecv = count_forward, count_batch
    try:
        out = hf_ring.ring_attention(ql, kl, vl, layout=layout, sinks=sk, **kw)
        out.backward(dout[:, :, pos])
    finally:
        ring.block_forward, dist.batch_isend_irecv = saved_forward, saved_batch
    return {"pos": pos, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
            "dsinks": None if sk is None else sk.grad, **counts}


def options_case(options_by_rank):
    """ring_attention with this rank's own keyword options (to provoke disagreement errors)."""
    rank = dist.get_rank()
    kw = dict(options_by_rank[rank])
    q, k, v, _ = make_qkv(0, 1, 2, 2, 8, 4)
    pos = hf_ring.local_positions(8, rank, dist.get_world_size())
    if kw.get("position_ids") is not None:
        kw["position_ids"] = kw["position_ids"][:, pos]
    return raises_on_rank(hf_ring.ring_attention, q[:, :, pos], k[:, :, pos], v[:, :, pos], **kw)


REF_NAMES = ("out", "dq", "dk", "dv")


def packed_reference(args, position_ids=None, *, causal=True, window=None, branches=None, pad=0, softcap=None,
                     sinks=None):
    """float64 reference outputs and gradients of ``make_qkv(*args)`` with documents, soft-capping and/or sinks.

    ``position_ids`` ``(B, n)`` mark the documents (None: one per row); ``pad`` masks the first keys of sample 0.
    """
    import reference as R

    seed, b, hq, hkv, n, d = args
    q, k, v, dout = make_qkv(*args)
    if position_ids is None:
        position_ids = torch.arange(n).expand(b, n)
    bias = R.packed_bias(position_ids, hq, causal=causal, window=window, branches=branches)
    if pad:
        bias[0, :, :, :pad] = float("-inf")
    if sinks is None:
        fn = lambda q, k, v: R.attention(q, k, v, bias=bias, softcap=softcap)  # noqa: E731
        return dict(zip(REF_NAMES, R.with_grads(fn, q, k, v, dout)))
    fn = lambda q, k, v, sinks: R.attention(q, k, v, bias=bias, softcap=softcap, sinks=sinks)  # noqa: E731
    return dict(zip(REF_NAMES + ("dsinks",), R.with_grads_sinks(fn, q, k, v, sinks, dout)))


def head_parallel_case(seed, b, hq, hkv, n, d, *, ulysses, layout="zigzag", dtype=torch.float32, pad=0,
                       position_ids=None, sinks=None, causal=True, window=None, pattern=None, softcap=None, dv=None):
    """This rank's positions, output and gradients of head-parallel attention (``ulysses`` ranks per group).

    The sequence is sharded as ``shard_batch`` shards it under
    ``setup_sequence_parallel(ulysses_size=ulysses)``; ``position_ids`` (global,
    ``(B, n)``) packs documents; ``sinks`` ``(Hq,)`` adds attention sinks (their
    gradient is summed over the ranks, as ``sync_gradients`` does).
    """
    from hf_ring.engine.checks import check_options
    from hf_ring.engine.layout import head_split
    from hf_ring.engine.ulysses import group_rows, head_parallel

    sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses, layout=layout)
    try:
        rank, world = sp.sp_rank, sp.sp_size
        q, k, v, dout = make_qkv(seed, b, hq, hkv, n, d, dtype, dv)
        pos = hf_ring.local_positions(n, rank, world, layout, ulysses)
        sizes = hf_ring.shard_sizes(n, world, layout, ulysses)
        first = rank // ulysses * ulysses
        key_mask = None
        if pad:
            full = torch.ones(b, n, dtype=torch.bool)
            full[0, :pad] = False
            key_mask = group_rows(sp.head_comm, full[:, pos], sizes[first:first + ulysses])
        ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
        s = None if sinks is None else sinks.clone().requires_grad_(True)
        spec = check_options(causal, window, pattern, None, d, layout).at(
            seq_len=n, key_mask=key_mask, documents=None if position_ids is None else document_starts(position_ids),
            softcap=softcap, sinks=s)
        out = head_parallel(ql, kl, vl, sp.head_comm, sp.ring_comm, head_split(hq, hkv, ulysses),
                            sizes[first:first + ulysses], spec)
        out.backward(dout[:, :, pos])
        res = {"pos": pos, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        if s is not None:
            dist.all_reduce(s.grad)
            res["dsinks"] = s.grad
        return res
    finally:
        hf_ring.clear_sequence_parallel()


def counted_head_parallel_case(*args, **kwargs):
    """:func:`head_parallel_case` with the bytes this rank sends to other ranks counted (all-to-all pieces
    that leave it, point-to-point sends)."""
    sent = []
    p2p, a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def counting_p2p(ops):
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return p2p(ops)

    def counting_a2a(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
        sent.append(row * (tensor.shape[0] - input_split_sizes[dist.get_rank(group)]))
        return a2a(output, tensor, output_split_sizes, input_split_sizes, group=group, **kw)

    dist.batch_isend_irecv, dist.all_to_all_single = counting_p2p, counting_a2a
    try:
        head_parallel_case(*args, **kwargs)
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = p2p, a2a
    return sum(sent)
