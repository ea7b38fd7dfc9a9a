"""Ring attention: K/V shards visit every rank that needs them, partial results merge by log-sum-exp.

At step ``s`` of the ring every rank sends the rank ``s`` ahead the K/V rows
it needs and receives from the rank ``s`` behind; the next step's transfer is
posted before the current step computes, so communication overlaps compute.
The backward walks the same steps: dQ stays home, and the dK/dV of visiting
rows go straight back to their owner, where they are summed. Each block's
backward uses the merged output and LSE, so gradients are exact. Dense
attention is the schedule of the one-branch pattern ``(N, 1)``; a dilated
pattern only changes which rows travel and which blocks run.

Documents packed into a row keep the row-index schedule, cut into tiles of
about half the longest document: tiles whose rows share no document are
never computed nor sent, and a tile that straddles a document border gets a
same-document mask. Dilation inside documents counts segments and residues
from each document's start, so it runs on the dense tiled schedule with a
per-tile bias ``log m`` (m = branches allowing the pair). Bidirectional spans
(an image's tokens) add, beside the causal blocks, blocks of the pairs only
a span allows, masked to exactly those. Attention sinks
join the merged result once per query row; ``softcap`` runs the exact math
kernels on bounded tiles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .agreement import agree, full_key_mask, gather_documents, option_codes
from .block_args import block_parts, kernel_args
from .blocks import Progression, default_tile, tiles
from .checks import check_position_ids, check_spec
from .comm import Pending, RingComm, resolve_group
from .documents import check_documents, document_tile
from .kernels import block_backward, block_forward, kv_storage
from .merge import accumulator_dtype, add_sinks, merge_into, sinks_backward
from .messages import GRAD_TAG, KV_TAG, covers, kv_traffic, kv_views, numels, piece_view, post, sent_views, unpack
from .pattern import head_slice
from .relay import caught
from .schedule import (MIN_MESSAGE_ROWS, Block, Geometry, RankPlan, Step, local_causal, message_budget,
                       messages_per_transfer, rank_plan, sent)
from .spans import check_spans, within_documents
from .spec import AttentionSpec

Tensor = torch.Tensor

BACKWARD_TILE = 4096
"""Most rows per side of the tiles the backward works on; bounds its temporaries (each tile's dQ, dK, dV).

The fused kernels tile internally, so smaller tiles only add calls and accumulations into dQ, dK
and dV; the math path cuts its own tiles of ``kernels.MATH_TILE``."""

BACKWARD_TILE_PER_MESSAGE = 2
"""On several ranks the backward's tiles are at most this many messages' rows per side: a tile's dQ and
the kernel's own buffers for its queries then stay the size of the messages in flight instead of a
shard's, which at two ranks was the largest thing beside the rank's own tensors."""

FORWARD_MESSAGE_SCALE = 2
"""The forward's messages carry this many times the backward's rows: it holds no gradients, so larger messages
(fewer rounds, fewer merges into the output) stay below the backward's peak."""

KEEP_BYTES = 1 << 20
"""A forward keeps the K/V rows it was sent for its backward when the whole sequence's K and V take at most this
many bytes: the backward then makes two exchanges per step, not three, and at such sizes an exchange's latency
costs more than the rows' memory (one more shard's K/V, at most this, per layer until its backward)."""

SOFTCAP_TILE = 512
"""Rows per side of blocks with ``softcap``: the exact math kernel holds several score tiles at once."""


@dataclass
class RingCall:
    """One rank's plan of a ring call with the spec and the group it runs over (see :func:`plan`)."""

    comm: Optional[RingComm]
    plan: RankPlan
    spec: AttentionSpec
    backward_tile: int = BACKWARD_TILE
    own_causal: bool = False  # the own step is one causal call over all rows (see schedule.local_causal)
    forward_plan: Optional[RankPlan] = None
    """The same steps cut into the forward's larger messages (None: ``plan``'s)."""
    keep: bool = False
    """The forward keeps the K/V rows it is sent for the backward, which then sends none (see :func:`keeps`)."""


def rows_major(b: int, h: int, s: int, d: int, dtype: torch.dtype, device) -> Tensor:
    """Zeros of shape ``(B, H, S, D)`` stored as ``(B, S, H, D)``.

    That is the order the model reads the attention output in (and the order
    its projections' gradients come in), so the ``transpose(1, 2)`` back to
    ``(B, S, H·D)`` is a view: no second copy of the output per layer, which
    would be saved for the backward beside this one.
    """
    return torch.zeros(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)


def _all_valid(key_mask: Optional[Tensor]) -> bool:
    return key_mask is None or bool(key_mask.all())


def _single_block(plan: RankPlan, q: Tensor, k: Tensor) -> Optional[Block]:
    """The block when one kernel call over all rows and heads is the whole answer."""
    if len(plan.steps) != 1 or len(plan.steps[0].recv.blocks) != 1:
        return None
    blk = plan.steps[0].recv.blocks[0]
    whole_q = blk.q.stride == 1 and blk.q.count == q.shape[2] and blk.q_heads == range(q.shape[1])
    # A rank's own K/V are read in place, whatever their strides (the model's are (B, S, H, D) storage).
    return blk if whole_q and covers(plan.steps[0].recv.pieces, k) and blk.nk == k.shape[2] else None


def _visits(call: RingCall, plan: RankPlan, k: Tensor, v: Tensor, keep: Optional[list] = None,
            kept: Optional[list] = None) -> Iterator[Tuple[Step, list]]:
    """Each step with its K/V pieces; the next step's transfer is posted before a step is handed out.

    ``keep``: a list each step's received tensors are appended to (the forward's, for :attr:`RingCall.keep`);
    ``kept``: those of a forward over the same steps, used instead of receiving them again."""
    steps, incoming = plan.steps, None
    for i, step in enumerate(steps):
        if kept is not None:
            got = kept[i]
        else:
            got = incoming.wait() if incoming is not None else None
            incoming = None
            if i + 1 < len(steps):
                nxt = steps[i + 1]
                incoming = post(call.comm, nxt, *kv_traffic(nxt, k, v, call.spec.key_mask), k.device, tag=KV_TAG)
        if keep is not None:
            keep.append(got)
        yield step, kv_views(step, k, v, call.spec.key_mask, got)
        del got  # the visiting rows are done with; only the next step's stay in memory (unless kept)


def ring_forward(q: Tensor, k: Tensor, v: Tensor, call: RingCall, sinks: Optional[Tensor] = None,
                 keep: Optional[list] = None) -> Tuple[Tensor, Tensor]:
    """This rank's rows of the output (``q.dtype``) and their LSE, with the sinks (if any) joined once per row;
    ``keep``: a list that gets the K/V rows each step received (see :func:`_visits`)."""
    plan, spec = call.forward_plan or call.plan, call.spec
    b, hq, s, _ = q.shape
    k, v = kv_storage(k), kv_storage(v)
    own_valid = _all_valid(spec.key_mask)  # the own keys, and with one block of them every key
    only = _single_block(plan, q, k)
    if only is not None and own_valid and spec.documents is None:
        out, lse = block_forward(q, k, v, scale=spec.scale,
                                 **kernel_args(spec, only.q, only.k_pos, only.nk, only.kind, q.device))
        return (out, lse) if sinks is None else add_sinks(out, lse, sinks)
    acc = accumulator_dtype(q)
    own_causal = call.own_causal and own_valid
    if not own_causal:
        out = rows_major(b, hq, s, v.shape[3], acc, q.device)
        lse = torch.full((b, hq, s), float("-inf"), dtype=acc, device=q.device)
    for step, kv in _visits(call, plan, k, v, keep=keep):
        blocks = step.recv.blocks
        if step.shift == 0 and own_causal:
            # It sees every row's own key, so the accumulators start as its result: no zeros, no first merge.
            out, lse = block_forward(q, k, v, scale=spec.scale, **kernel_args(spec, _local(s), 0, s, "causal", q.device))
            out = out.to(acc)
            blocks = _span_blocks(blocks)
        for blk in blocks:
            hs = head_slice(blk.q_heads)
            pk, pv, pm, valid = kv[blk.piece]
            for bs, qt, kt, kind, ks, key_valid in block_parts(spec, blk, pm, valid, None):
                args = kernel_args(spec, qt, kt.pos, kt.count, kind, q.device, key_valid, blk.q_heads)
                if args is None:
                    continue
                rs = qt.slice
                o_blk, l_blk = block_forward(q[bs, hs, rs], pk[bs, :, ks], pv[bs, :, ks], scale=spec.scale, **args)
                merge_into(out[bs, hs, rs], lse[bs, hs, rs], o_blk, l_blk)
        del kv
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def _span_blocks(blocks) -> list:
    """The blocks of bidirectional spans' extra pairs, which run beside a rank's one causal call on its own rows."""
    return [blk for blk in blocks if blk.kind == "span"]


def _local(rows: int) -> Progression:
    """A rank's rows in local order, where only causality masks: its positions ascend, so local order is theirs."""
    return Progression(0, 0, rows)


def _own_backward(call: RingCall, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  acc: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of the own step as one causal call over all rows, cut into tiles of at most ``backward_tile``.

    One tile (a shard of at most ``backward_tile`` rows) returns the kernel's
    gradients as they are, with no accumulators at all.
    """
    s, scale = q.shape[2], call.spec.scale
    parts = tiles(_local(s), _local(s), True, None, call.backward_tile)
    if len(parts) == 1:
        grads = block_backward(dout, q, k, v, out, lse, scale=scale, **kernel_args(call.spec, _local(s), 0, s, "causal", q.device))
        return tuple(g.to(acc) for g in grads)
    dq, dk, dv = (rows_major(*x.shape, acc, x.device) for x in (q, k, v))
    for qt, kt, kind in parts:
        rs, ks = qt.slice, kt.slice
        g_q, g_k, g_v = block_backward(dout[:, :, rs], q[:, :, rs], k[:, :, ks], v[:, :, ks], out[:, :, rs],
                                       lse[:, :, rs], scale=scale, **kernel_args(call.spec, qt, kt.pos, kt.count, kind, q.device))
        dq[:, :, rs].add_(g_q)
        dk[:, :, ks].add_(g_k)
        dv[:, :, ks].add_(g_v)
    return dq, dk, dv


def _scatter_grads(dk: Tensor, dv: Tensor, step: Step, got: List[Tensor]) -> None:
    """Add the gradients a destination returned for the rows this rank sent it."""
    if not step.send:
        return
    b = dk.shape[0]
    # A view's gradients were added into its parent's by the receiver: only travelling pieces come back.
    grads_k, grads_v = sent_views(got[0], step.send, b, dk.shape[3]), sent_views(got[1], step.send, b, dv.shape[3])
    for piece, gk, gv in zip(sent(step.send), grads_k, grads_v):
        piece_view(dk, piece).add_(gk)
        piece_view(dv, piece).add_(gv)


def ring_backward(dout, q, k, v, out, lse, call: RingCall, kept: Optional[list] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV of this rank's rows; ``kept``: the K/V rows the forward received (``call.keep``), not sent again."""
    plan, comm, spec = call.plan, call.comm, call.spec
    b = q.shape[0]
    k, v = kv_storage(k), kv_storage(v)  # the saved K/V stay as given: a copy is made again rather than kept
    own_valid = _all_valid(spec.key_mask)
    only = _single_block(plan, q, k)
    if only is not None and own_valid and spec.documents is None:
        return block_backward(dout, q, k, v, out, lse, scale=spec.scale,
                              **kernel_args(spec, only.q, only.k_pos, only.nk, only.kind, q.device))
    acc = accumulator_dtype(q)
    own_causal = call.own_causal and own_valid
    if not own_causal:
        dq = rows_major(*q.shape, acc, q.device)
        dk = rows_major(*k.shape, acc, q.device)
        dv = rows_major(*v.shape, acc, q.device)
    returning: Optional[Tuple[Step, Pending]] = None
    for step, kv in _visits(call, plan, k, v, kept=kept):
        blocks = step.recv.blocks
        if step.shift == 0 and own_causal:
            dq, dk, dv = _own_backward(call, dout, q, k, v, out, lse, acc)
            blocks = _span_blocks(blocks)
        if step.shift == 0:
            grads = [(piece_view(dk, p), piece_view(dv, p)) for p in step.recv.pieces]
            flat = None
        else:
            flat = [torch.zeros(sum(numels(step.recv.pieces, b, x.shape[3])), dtype=acc, device=q.device)
                    for x in (k, v)]
            grads = list(zip(unpack(flat[0], step.recv.pieces, b, k.shape[3]),
                             unpack(flat[1], step.recv.pieces, b, v.shape[3])))
        for blk in blocks:
            hs = head_slice(blk.q_heads)
            pk, pv, pm, valid = kv[blk.piece]
            gk, gv = grads[blk.piece]
            for bs, qt, kt, kind, ks, key_valid in block_parts(spec, blk, pm, valid, call.backward_tile):
                rs = qt.slice
                args = kernel_args(spec, qt, kt.pos, kt.count, kind, q.device, key_valid, blk.q_heads)
                if args is None:
                    continue
                dq_b, dk_b, dv_b = block_backward(
                    dout[bs, hs, rs], q[bs, hs, rs], pk[bs, :, ks], pv[bs, :, ks], out[bs, hs, rs], lse[bs, hs, rs],
                    scale=spec.scale, **args,
                )
                dq[bs, hs, rs].add_(dq_b)  # add_ on the view: `+=` on an index would copy the rows back
                gk[bs, :, ks].add_(dk_b)
                gv[bs, :, ks].add_(dv_b)
                del dq_b, dk_b, dv_b
        del kv, grads
        if step.shift:
            if returning is not None:
                _scatter_grads(dk, dv, returning[0], returning[1].wait())
            back = [(torch.Size((sum(numels(step.send, b, x.shape[3])),)), acc) for x in (k, v)] if step.send else []
            returning = (step, post(comm, step, flat if step.recv.pieces else [], back, q.device, tag=GRAD_TAG, reverse=True))
            del flat
    if returning is not None:
        _scatter_grads(dk, dv, returning[0], returning[1].wait())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: saves ``(q, k, v, out, lse, sinks)`` and runs the ring backward.

    Block gradients use the output and LSE with the sinks joined, which makes
    them exact; the sinks' gradient is this rank's rows' share (summing it over
    the ranks, as for every other parameter, gives the whole).
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, call: RingCall):
        kept = [] if call.keep else None
        out, lse = ring_forward(q, k, v, call, sinks, keep=kept)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.call, ctx.kept = call, kept or None  # none when the forward made no step (one block)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if dout.stride(-1) != 1:  # e.g. the expanded gradient of a sum; the kernels read any other strides
            dout = dout.contiguous()
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.call, ctx.kept)
        ctx.kept = None
        dsinks = None if sinks is None else sinks_backward(dout, out, lse, sinks)
        return dq, dk, dv, dsinks, None


def _tile(spec: AttentionSpec) -> Optional[int]:
    """Rows per side of the ring's blocks (None: whole blocks, cut only along a window)."""
    tile = None  # key padding is met block by block (block_args.block_parts), not by tiling every block
    if spec.documents is not None:
        tile = min(tile or default_tile(spec.window),
                   document_tile(spec.documents, spec.seq_len, spec.dilated_in_documents))
    if spec.softcap is not None:
        tile = min(tile or default_tile(spec.window), SOFTCAP_TILE)
    return tile


def keeps(geo: Geometry, budget: int, forward_budget: Optional[int], kv_bytes: Optional[int]) -> bool:
    """Whether the forward keeps its received K/V for the backward (:attr:`RingCall.keep`): the whole sequence's
    K and V (``kv_bytes``) within :data:`KEEP_BYTES`, and the forward cut into the backward's very steps. Pure
    and global (sizes every rank agreed, transfers cut alike on every rank), so every rank decides alike: a
    rank that skipped the backward's K/V exchange while its peer made it would leave the peer waiting."""
    if geo.world_size == 1 or kv_bytes is None or kv_bytes > KEEP_BYTES:
        return False
    return forward_budget is None or all(
        messages_per_transfer(geo, s, budget) == messages_per_transfer(geo, s, forward_budget)
        for s in range(1, geo.world_size))


def plan(hq: int, hkv: int, comm: Optional[RingComm], spec: AttentionSpec,
         kv_bytes: Optional[int] = None) -> RingCall:
    """What this rank's ring computes and sends for ``hq`` query and ``hkv`` K/V heads under a checked spec;
    ``kv_bytes``: what the whole sequence's K and V take (the forward may then keep what it receives)."""
    rank, world = (0, 1) if comm is None else (comm.rank, comm.world_size)
    budget = message_budget(spec.seq_len, world, hkv) if spec.message_rows is None else spec.message_rows * hkv
    tile = _tile(spec)
    backward_tile = min(BACKWARD_TILE, tile or BACKWARD_TILE)
    if world > 1:
        backward_tile = min(backward_tile, max(MIN_MESSAGE_ROWS, BACKWARD_TILE_PER_MESSAGE * budget // hkv))
    geo = Geometry(spec.seq_len, world, spec.layout if world > 1 else "contiguous", spec.causal, spec.window,
                   spec.planned_branches, hq, hkv, tile, spec.documents, spec.head_base, spec.spans)
    # A message size the caller chose bounds the forward's messages too.
    forward_budget = None if world == 1 or spec.message_rows is not None else budget * FORWARD_MESSAGE_SCALE
    forward = None if forward_budget is None else rank_plan(geo, rank, forward_budget)
    # A tile is set exactly where something besides causality and padding masks (documents, softcap).
    return RingCall(comm, rank_plan(geo, rank, budget), spec, backward_tile=backward_tile,
                    own_causal=tile is None and local_causal(geo, rank), forward_plan=forward,
                    keep=keeps(geo, budget, forward_budget, kv_bytes))


def agreed_spec(comm: Optional[RingComm], q: Tensor, k: Tensor, v: Tensor, options: Mapping[str, Any],
                key_mask=None, position_ids=None, sinks=None) -> AttentionSpec:
    """The checked spec of a ring attention call, with the global length, documents and key mask every rank agreed.

    A bad argument on one rank fails every rank at once: its error rides in
    the agreement (one small all-gather) that precedes any K/V transfer.
    """
    spec = None
    with caught() as check:
        spec = check_spec(q, k, v, options, key_mask, sinks)
        position_ids = check_position_ids(position_ids, q)
        if position_ids is not None and spec.documents is not None:
            raise ValueError("pass either position_ids (the ranks then learn the documents) or documents, not both")
    codes = () if check.error is not None else option_codes(spec, position_ids)
    n, padded = agree(comm, q, k, options.get("seq_len"), spec, codes, check.error)
    documents = spec.documents
    if position_ids is not None:
        documents = gather_documents(comm, position_ids, n, spec.layout, k.device)
    documents = check_documents(documents, q.shape[0], n)
    return spec.at(seq_len=n, documents=documents, spans=within_documents(check_spans(spec.spans, q.shape[0], n),
                                                                         documents, n),
                   key_mask=full_key_mask(spec.key_mask, k, padded))


def run(q: Tensor, k: Tensor, v: Tensor, comm: Optional[RingComm], spec: AttentionSpec) -> Tensor:
    """The ring over a checked spec the ranks agreed on (``spec.seq_len`` set; see :func:`agreed_spec`).

    ``spec.key_mask`` only when some rank has padded keys.
    """
    kv_bytes = k.shape[0] * spec.seq_len * k.shape[1] * (k.shape[3] + v.shape[3]) * k.element_size()
    return RingAttentionFunction.apply(q, k, v, spec.sinks, plan(q.shape[1], k.shape[1], comm, spec, kv_bytes))


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    key_mask: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    **options: Any,
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    ``q`` is ``(B, Hq, S_local, D)``, ``k`` ``(B, Hkv, S_local, D)`` and ``v``
    ``(B, Hkv, S_local, D_v)`` holding this rank's rows in ``local_positions``
    order (``D_v`` may differ from ``D``, as multi-head latent attention's does);
    returns this rank's rows of the output, ``(B, Hq, S_local, D_v)``.
    ``key_mask`` ``(B, S_local)`` bool marks the keys that may be attended
    (False for padding); it travels with the K/V rows it describes.
    ``position_ids`` ``(B, S_local)``: this rank's rows' position ids; a row
    then holds several documents (each maximal run of ids increasing by one),
    and a query sees only its own document, with causality, window and
    dilation counted from the document's start. ``sinks`` ``(Hq,)`` adds one
    logit per query head to the softmax denominator with a zero value (its
    gradient is this rank's rows' share: sum it over the ranks like any
    parameter's).

    ``options`` (keywords, see :class:`hf_ring.engine.spec.AttentionSpec`):
    ``layout="zigzag"``; ``seq_len`` (checked against the shards; inferred when
    None); ``causal=True``; ``window=W`` lets query t see keys ``t-W < k <= t``;
    ``pattern`` selects dilated attention (:class:`hf_ring.DilatedPattern` or
    its dict; None is exact dense attention); ``scale`` (default
    ``1/sqrt(D)``); ``softcap`` caps the scores, ``softcap·tanh(s/softcap)``;
    ``documents`` gives the same as ``position_ids`` for a caller that knows
    the global document starts already (per batch row, the ascending rows
    where a document starts, beginning with 0; see
    :func:`hf_ring.engine.documents.document_starts`): no exchange is then needed;
    ``spans`` (causal dense attention): per batch row, ``(start, stop)`` runs
    of global rows whose tokens also see each other's later tokens, as an
    image's tokens do in Gemma 3 or a prefix in PaliGemma (see
    :func:`hf_ring.engine.spans.spans_of_ids`);
    ``message_rows`` sets the K/V rows per message on the ring, forward and
    backward (default: an eighth of a shard, at least 256, and twice that in
    the forward): smaller messages bound the ring's buffers further, at some speed.

    Without a group and without torch.distributed it runs as one process.
    Every argument is validated and the ranks agree on all of them (one small
    all-gather) before any K/V moves: a mismatch raises the same error on every rank.
    """
    comm = resolve_group(group)
    return run(q, k, v, comm, agreed_spec(comm, q, k, v, options, key_mask, position_ids, sinks))
