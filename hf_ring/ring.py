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
per-tile bias ``log m`` (m = branches allowing the pair). Attention sinks
join the merged result once per query row; ``softcap`` runs the exact math
kernels on bounded tiles.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .blocks import Prog, default_tile, tiles
from .comm import Pending, RingComm
from .documents import (Documents, check_documents, dilated_multiplicity, document_starts, longest, same_document,
                        within_one)
from .kernels import (add_sinks, block_backward, block_forward, check_sinks, check_softcap, default_scale, merge_into,
                      sinks_backward)
from .layout import check_layout, infer_seq_len, local_positions, shard_sizes
from .pattern import DilatedPattern
from .schedule import Blk, Piece, RankPlan, Step, message_budget, rank_plan

Tensor = torch.Tensor

BACKWARD_TILE = 1024
"""Rows per side of the tiles the backward works on; bounds its temporaries."""

PADDED_TILE = 2048
"""Rows per side of forward blocks when keys are padded: each block then needs a built mask, and
whole-shard blocks would make that mask quadratic in the shard."""

SOFTCAP_TILE = 512
"""Rows per side of blocks with ``softcap``: the exact math kernel holds several score tiles at once."""

DOCUMENT_TILE = 1024
"""Most rows per side of tiles over documents (the tile is about half the longest document)."""

DILATED_DOCUMENT_TILE = 512
"""Most rows per side of tiles of dilated attention over documents: each carries a per-head bias."""


@dataclass
class _Ctx:
    comm: Optional[RingComm]
    plan: RankPlan
    scale: float
    causal: bool
    window: Optional[int]
    key_mask: Optional[Tensor] = None  # (B, S_local) bool, True where a key may be attended
    masks: dict = field(default_factory=dict)
    documents: Optional[Documents] = None  # global start rows of the documents, per batch row
    dilated: Optional[Tuple[Tuple[int, int], ...]] = None  # branches counted inside documents
    softcap: Optional[float] = None
    backward_tile: int = BACKWARD_TILE


def _hs(heads: range) -> slice:
    return slice(heads.start, heads.stop, heads.step)


def _piece_view(x: Tensor, piece: Piece) -> Tensor:
    return x[:, _hs(piece.heads), piece.rows.rows]


def _whole(pieces: Sequence[Piece], x: Tensor) -> bool:
    """One piece that is the entire tensor: it is sent as it is, without packing."""
    if len(pieces) != 1:
        return False
    p = pieces[0]
    return (p.heads == range(x.shape[1]) and p.rows.stride == 1 and p.rows.local == 0
            and p.rows.count == x.shape[2] and x.is_contiguous())


def _numels(pieces: Sequence[Piece], b: int, d: int) -> List[int]:
    return [b * len(p.heads) * p.rows.count * d for p in pieces]


def _pack(x: Tensor, pieces: Sequence[Piece]) -> Tensor:
    """The pieces of ``x`` laid one after another in a flat buffer."""
    if _whole(pieces, x):
        return x.reshape(-1)
    b, d = x.shape[0], x.shape[3]
    flat = x.new_empty(sum(_numels(pieces, b, d)))
    for view, piece in zip(_unpack(flat, pieces, b, d), pieces):
        view.copy_(_piece_view(x, piece))
    return flat


def _unpack(flat: Tensor, pieces: Sequence[Piece], b: int, d: int) -> List[Tensor]:
    views, off = [], 0
    for piece, n in zip(pieces, _numels(pieces, b, d)):
        views.append(flat[off : off + n].view(b, len(piece.heads), piece.rows.count, d))
        off += n
    return views


def _post(comm: RingComm, step: Step, send: Sequence[Tensor], recv: Sequence[Tuple[torch.Size, torch.dtype]],
          device: torch.device, tag: int, reverse: bool = False) -> Pending:
    """One step's traffic: to ``dst``/from ``src``, or the reverse (gradients going home)."""
    send_to, recv_from = (step.src, step.dst) if reverse else (step.dst, step.src)
    return comm.exchange(list(send), send_to, list(recv), recv_from, tag=tag, device=device)


def _kv_traffic(step: Step, k: Tensor, v: Tensor, key_mask: Optional[Tensor]):
    """What this rank sends for ``step`` (its K, V and key mask rows) and what it expects back."""
    send = []
    if step.send:
        send = [_pack(k, step.send), _pack(v, step.send)]
        if key_mask is not None:
            send.append(_pack_mask(key_mask, step.send))
    recv = []
    if step.recv.pieces:
        total = sum(_numels(step.recv.pieces, k.shape[0], k.shape[3]))
        recv = [(torch.Size((total,)), k.dtype)] * 2
        if key_mask is not None:
            recv.append((torch.Size((k.shape[0] * sum(p.rows.count for p in step.recv.pieces),)), torch.uint8))
    return send, recv


def _pack_mask(key_mask: Tensor, pieces: Sequence[Piece]) -> Tensor:
    return torch.cat([key_mask[:, p.rows.rows].reshape(-1) for p in pieces]).to(torch.uint8)


def _unpack_mask(flat: Tensor, pieces: Sequence[Piece], b: int) -> List[Tensor]:
    views, off = [], 0
    for p in pieces:
        n = b * p.rows.count
        views.append(flat[off : off + n].view(b, p.rows.count).bool())
        off += n
    return views


def _kv_views(step: Step, k: Tensor, v: Tensor, key_mask: Optional[Tensor], got: Optional[List[Tensor]]):
    """Per piece ``(K, V, key mask or None, all keys valid)`` for this step's blocks."""
    b, d = k.shape[0], k.shape[3]
    pieces = step.recv.pieces
    if not pieces:
        return []
    if step.shift == 0:
        ks = [_piece_view(k, p) for p in pieces]
        vs = [_piece_view(v, p) for p in pieces]
        ms = [None if key_mask is None else key_mask[:, p.rows.rows] for p in pieces]
    else:
        ks, vs = _unpack(got[0], pieces, b, d), _unpack(got[1], pieces, b, d)
        ms = [None] * len(pieces) if key_mask is None else _unpack_mask(got[2], pieces, b)
    return [(kk, vv, m, m is None or bool(m.all())) for kk, vv, m in zip(ks, vs, ms)]


def _kernel_args(ctx: _Ctx, q: Prog, k_pos: int, nk: int, kind: str, device,
                 key_valid: Optional[Tensor] = None, heads: Optional[range] = None) -> Optional[dict]:
    """Kernel arguments of one block (``heads``: its query heads); ``key_valid`` ``(B, nk)`` adds key padding.

    None when documents leave the block no allowed pair.
    """
    docs = ctx.documents
    if docs is not None and ctx.dilated is not None:
        m = dilated_multiplicity(docs, q.pos, q.count, k_pos, nk, ctx.dilated, heads, ctx.causal, device)
        if key_valid is not None:
            m = m * key_valid[:, None, None, :]
        if not bool(m.any()):
            return None
        return {"causal": False, "mask": torch.log(m.to(torch.float32)), "softcap": ctx.softcap}
    doc_mask = None
    if docs is not None and not within_one(docs, q.pos, q.last_pos, k_pos, k_pos + nk - 1):
        doc_mask = same_document(docs, q.pos, q.count, k_pos, nk, device)
    if kind != "mask" and key_valid is None and doc_mask is None:
        return {"causal": kind == "causal", "mask": None, "softcap": ctx.softcap}
    if kind == "full":
        mask = torch.ones(q.count, nk, dtype=torch.bool, device=device)
    elif kind == "causal":
        mask = torch.ones(q.count, nk, dtype=torch.bool, device=device).tril()
    else:
        key = (q.pos, q.count, q.stride, k_pos, nk)
        mask = ctx.masks.get(key)
        if mask is None:
            qp = torch.arange(q.pos, q.pos + q.count * q.stride, q.stride, device=device)[:, None]
            kp = torch.arange(k_pos, k_pos + nk * q.stride, q.stride, device=device)[None, :]
            mask = kp <= qp
            if ctx.window is not None:
                mask &= kp > qp - ctx.window
            if len(ctx.masks) < 64:  # tiles repeat along a sliding window; keep a few
                ctx.masks[key] = mask
    if key_valid is not None:
        mask = mask[None, None] & key_valid[:, None, None, :]
    if doc_mask is not None:
        mask = mask & doc_mask
        if not bool(mask.any()):
            return None
    return {"causal": False, "mask": mask, "softcap": ctx.softcap}


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _single_block(plan: RankPlan, q: Tensor, k: Tensor) -> Optional[Blk]:
    """The block when one kernel call over all rows and heads is the whole answer."""
    if len(plan.steps) != 1 or len(plan.steps[0].recv.blocks) != 1:
        return None
    blk = plan.steps[0].recv.blocks[0]
    whole_q = blk.q.stride == 1 and blk.q.count == q.shape[2] and blk.q_heads == range(q.shape[1])
    return blk if whole_q and _whole(plan.steps[0].recv.pieces, k) and blk.nk == k.shape[2] else None


def _visits(ctx: _Ctx, k: Tensor, v: Tensor) -> Iterator[Tuple[Step, list]]:
    """Each step with its K/V pieces; the next step's transfer is posted before a step is handed out."""
    steps, incoming = ctx.plan.steps, None
    for i, step in enumerate(steps):
        got = incoming.wait() if incoming is not None else None
        incoming = None
        if i + 1 < len(steps):
            nxt = steps[i + 1]
            incoming = _post(ctx.comm, nxt, *_kv_traffic(nxt, k, v, ctx.key_mask), k.device, tag=0)
        yield step, _kv_views(step, k, v, ctx.key_mask, got)
        del got  # the visiting rows are done with; only the next step's stay in memory


def ring_forward(q: Tensor, k: Tensor, v: Tensor, ctx: _Ctx, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """This rank's rows of the output (``q.dtype``) and their LSE, with the sinks (if any) joined once per row."""
    plan, key_mask = ctx.plan, ctx.key_mask
    b, hq, s, d = q.shape
    only = _single_block(plan, q, k)
    if only is not None and key_mask is None and ctx.documents is None:
        out, lse = block_forward(q, k, v, scale=ctx.scale,
                                 **_kernel_args(ctx, only.q, only.k_pos, only.nk, only.kind, q.device))
        return (out, lse) if sinks is None else add_sinks(out, lse, sinks)
    out = torch.zeros(b, hq, s, d, dtype=_acc_dtype(q), device=q.device)
    lse = torch.full((b, hq, s), float("-inf"), dtype=torch.float32, device=q.device)
    for step, kv in _visits(ctx, k, v):
        for blk in step.recv.blocks:
            hs, rs = _hs(blk.q_heads), blk.q.rows
            ks = slice(blk.k_off, blk.k_off + blk.nk)
            pk, pv, pm, all_valid = kv[blk.piece]
            args = _kernel_args(ctx, blk.q, blk.k_pos, blk.nk, blk.kind, q.device,
                                None if all_valid else pm[:, ks], blk.q_heads)
            if args is None:
                continue
            o_blk, l_blk = block_forward(q[:, hs, rs], pk[:, :, ks], pv[:, :, ks], scale=ctx.scale, **args)
            merge_into(out[:, hs, rs], lse[:, hs, rs], o_blk, l_blk)
        del kv
    if sinks is not None:
        out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def _scatter_grads(dk: Tensor, dv: Tensor, step: Step, got: List[Tensor]) -> None:
    """Add the gradients a destination returned for the rows this rank sent it."""
    if not step.send:
        return
    b, d = dk.shape[0], dk.shape[3]
    for piece, gk, gv in zip(step.send, _unpack(got[0], step.send, b, d), _unpack(got[1], step.send, b, d)):
        _piece_view(dk, piece).add_(gk)
        _piece_view(dv, piece).add_(gv)


def ring_backward(dout, q, k, v, out, lse, ctx: _Ctx) -> Tuple[Tensor, Tensor, Tensor]:
    plan, comm, key_mask = ctx.plan, ctx.comm, ctx.key_mask
    b, hq, s, d = q.shape
    only = _single_block(plan, q, k)
    if only is not None and key_mask is None and ctx.documents is None:
        return block_backward(dout, q, k, v, out, lse, scale=ctx.scale,
                              **_kernel_args(ctx, only.q, only.k_pos, only.nk, only.kind, q.device))
    acc = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    returning: Optional[Tuple[Step, Pending]] = None
    for step, kv in _visits(ctx, k, v):
        if step.shift == 0:
            grads = [(_piece_view(dk, p), _piece_view(dv, p)) for p in step.recv.pieces]
            flat = None
        else:
            total = sum(_numels(step.recv.pieces, b, d))
            flat = [torch.zeros(total, dtype=acc, device=q.device) for _ in range(2)]
            grads = list(zip(_unpack(flat[0], step.recv.pieces, b, d), _unpack(flat[1], step.recv.pieces, b, d)))
        for blk in step.recv.blocks:
            hs = _hs(blk.q_heads)
            pk, pv, pm, all_valid = kv[blk.piece]
            gk, gv = grads[blk.piece]
            stride = blk.q.stride
            k_prog = Prog(blk.k_off * stride, blk.k_pos, blk.nk, stride)
            for qt, kt, kind in tiles(blk.q, k_prog, ctx.causal, ctx.window, ctx.backward_tile):
                rs, ks = qt.rows, slice(kt.local // stride, kt.local // stride + kt.count)
                args = _kernel_args(ctx, qt, kt.pos, kt.count, kind, q.device,
                                    None if all_valid else pm[:, ks], blk.q_heads)
                if args is None:
                    continue
                dq_b, dk_b, dv_b = block_backward(
                    dout[:, hs, rs], q[:, hs, rs], pk[:, :, ks], pv[:, :, ks], out[:, hs, rs], lse[:, hs, rs],
                    scale=ctx.scale, **args,
                )
                dq[:, hs, rs].add_(dq_b)  # add_ on the view: `+=` on an index would copy the rows back
                gk[:, :, ks].add_(dk_b)
                gv[:, :, ks].add_(dv_b)
                del dq_b, dk_b, dv_b
        del kv, grads
        if step.shift:
            if returning is not None:
                _scatter_grads(dk, dv, returning[0], returning[1].wait())
            back = [(torch.Size((sum(_numels(step.send, b, d)),)), acc)] * 2 if step.send else []
            returning = (step, _post(comm, step, flat if step.recv.pieces else [], back, q.device, tag=4, reverse=True))
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
    def forward(ctx, q, k, v, sinks, rctx: _Ctx):
        out, lse = ring_forward(q, k, v, rctx, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.rctx = rctx
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.rctx)
        dsinks = None if sinks is None else sinks_backward(dout, out, lse, sinks)
        return dq, dk, dv, dsinks, None


# ---------------------------------------------------------------- validation


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got q={q.device}, k={k.device}, v={v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k={tuple(k.shape)}, v={tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch size differs: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head_dim differs: q has {q.shape[3]}, k/v have {k.shape[3]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q has {q.shape[2]} local rows but k/v have {k.shape[2]}; ring attention needs each rank's "
            "own rows of q, k and v (for decoding with a cache use hf_ring.generation)"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )


def _check_window(window, causal: bool) -> Optional[int]:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window must be a positive int or None, got {window!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1 (query t sees keys t-window < k <= t), got {window}")
    if not causal:
        raise ValueError("window is a causal sliding window; pass causal=True with window")
    return window


def _check_key_mask(key_mask, k: Tensor) -> Optional[Tensor]:
    if key_mask is None:
        return None
    if not isinstance(key_mask, torch.Tensor):
        raise TypeError(f"key_mask must be a bool tensor of shape (batch, local rows) or None, got {type(key_mask).__name__}")
    expected = (k.shape[0], k.shape[2])
    if tuple(key_mask.shape) != expected:
        raise ValueError(f"key_mask must have shape (batch, local rows) = {expected}, got {tuple(key_mask.shape)}")
    if key_mask.dtype != torch.bool:
        raise TypeError(f"key_mask must be torch.bool (True = attend), got {key_mask.dtype}")
    return key_mask.to(k.device)


def _check_pattern(pattern, window) -> Optional[DilatedPattern]:
    if pattern is None:
        return None
    if isinstance(pattern, dict):
        pattern = DilatedPattern.from_dict(pattern)
    if not isinstance(pattern, DilatedPattern):
        raise TypeError(
            f"pattern must be a hf_ring.DilatedPattern, a dict with segment_lengths and dilation_rates, "
            f"or None; got {type(pattern).__name__}"
        )
    if window is not None:
        raise ValueError("pattern and window cannot be combined: a dilated pattern already bounds what each query sees")
    return pattern


def check_position_ids(position_ids, q: Tensor, documents) -> Optional[Tensor]:
    """This rank's rows' position ids ``(B, S_local)`` (integers), or None."""
    if position_ids is None:
        return None
    if documents is not None:
        raise ValueError("pass either position_ids (the ranks then learn the documents) or documents, not both")
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be an integer tensor of shape (batch, local rows) or None, "
                        f"got {type(position_ids).__name__}")
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer tensor (torch.long), got {position_ids.dtype}")
    expected = (q.shape[0], q.shape[2])
    if tuple(position_ids.shape) != expected:
        raise ValueError(f"position_ids must have shape (batch, local rows) = {expected} (this rank's rows, in "
                         f"local_positions order), got {tuple(position_ids.shape)}")
    return position_ids


def check_options(causal: bool, window, pattern, scale, head_dim: int) -> Tuple[Optional[int], Optional[DilatedPattern], float]:
    """Validated ``(window, pattern, scale)``; ``scale=None`` becomes ``1/sqrt(head_dim)``."""
    window = _check_window(window, causal)
    pattern = _check_pattern(pattern, window)
    if scale is None:
        scale = default_scale(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    return window, pattern, float(scale)


def _resolve_group(group) -> Optional[RingComm]:
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
    elif not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group was given but torch.distributed is not initialised; call init_process_group first")
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the given group; "
            "call ring_attention only on the group's ranks"
        )
    return RingComm(group)


_NONE = -(1 << 62)


def _float_code(x: Optional[float]) -> int:
    """A float as an integer every rank can compare exactly (its IEEE bits); None is a value no float has."""
    return _NONE if x is None else struct.unpack("<q", struct.pack("<d", x))[0]


def _shown(name: str, code: int):
    if code == _NONE:
        return None
    return struct.unpack("<d", struct.pack("<q", code))[0] if name == "softcap" else code


def option_codes(softcap: Optional[float], sinks: Optional[Tensor], position_ids: Optional[Tensor],
                 documents: Optional[Documents]) -> List[Tuple[str, int]]:
    """The options every rank must share, as integers for the agreement step."""
    return [("softcap", _float_code(softcap)), ("sinks", _NONE if sinks is None else 1),
            ("position_ids", _NONE if position_ids is None else 1),
            ("documents", _NONE if documents is None else hash(documents) & ((1 << 61) - 1))]


def _digest(same: Sequence[Tuple[str, int]]) -> int:
    """One integer standing for all the options (hash of a tuple of ints: the same in every process)."""
    return hash(tuple(code for _, code in same)) & ((1 << 62) - 1)


def agree(comm: Optional[RingComm], q: Tensor, k: Tensor, seq_len: Optional[int], layout: str,
          padded: bool, same: Sequence[Tuple[str, int]] = ()) -> Tuple[int, bool]:
    """The global length, and whether any rank has padded keys, checked across the ranks.

    One all-gather of a few integers per rank per call: every rank sees every
    rank's shapes and a digest of the ``same`` options (name, integer code)
    every rank must share, so a mismatch raises the same error on all of them
    instead of leaving some waiting in the ring. Only when the digests differ
    do the ranks (all of them, having seen the same table) gather the options
    themselves, to say which one differs.
    """
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0):
        raise ValueError(f"seq_len must be a non-negative int or None, got {seq_len!r}")
    local_len = q.shape[2]
    if comm is None or comm.world_size == 1:
        if seq_len is not None and seq_len != local_len:
            raise ValueError(f"seq_len={seq_len} but this single process holds {local_len} rows")
        return local_len, padded
    mine = [local_len, -1 if seq_len is None else seq_len, int(padded), q.shape[0], q.shape[1], k.shape[1], q.shape[3],
            _digest(same)]
    table = comm.all_gather_ints(mine, "the shape check before the ring")
    for i, name in ((3, "batch size"), (4, "query heads"), (5, "key/value heads"), (6, "head_dim")):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            raise ValueError(f"the ranks of the ring disagree on {name}: {values} (by rank)")
    if len({row[7] for row in table}) > 1:
        options = comm.all_gather_ints([code for _, code in same], "the option check before the ring")
        for i, (name, _) in enumerate(same):
            values = [row[i] for row in options]
            if len(set(values)) > 1:
                if _NONE not in values and name != "softcap":
                    raise ValueError(f"the ranks passed different {name} (every rank gave some, not the same); "
                                     "pass the same on every rank")
                shown = [_shown(name, c) if name == "softcap" or c == _NONE else "given" for c in values]
                raise ValueError(f"the ranks passed different {name}: {shown} (by rank); pass the same on every rank")
    given = sorted({row[1] for row in table})
    if len(given) > 1:
        raise ValueError(f"the ranks passed different seq_len values: {[row[1] for row in table]} (-1 = None)")
    lens = [row[0] for row in table]
    any_padded = any(row[2] for row in table)
    if seq_len is None:
        return infer_seq_len(lens, layout), any_padded
    expected = shard_sizes(seq_len, comm.world_size, layout)
    if lens != expected:
        raise ValueError(
            f"seq_len={seq_len} with layout={layout!r} over {comm.world_size} ranks needs shard sizes "
            f"{expected}, but the ranks hold {lens}; shard with hf_ring.local_positions"
        )
    return seq_len, any_padded


def gather_documents(comm: Optional[RingComm], position_ids: Tensor, seq_len: int, layout: str,
                     device: torch.device) -> Documents:
    """Global document starts from every rank's rows' ``position_ids`` (one bounded all-gather)."""
    if comm is None or comm.world_size == 1 or seq_len == 0:
        return document_starts(position_ids)
    sizes = shard_sizes(seq_len, comm.world_size, layout)
    b = position_ids.shape[0]
    mine = torch.zeros(b, max(sizes), dtype=torch.long, device=device)
    mine[:, : position_ids.shape[1]] = position_ids.to(device=device, dtype=torch.long)
    parts = comm.all_gather(mine, "the exchange of position_ids (document starts)").cpu()
    whole = torch.empty(b, seq_len, dtype=torch.long)
    for r, size in enumerate(sizes):
        whole[:, local_positions(seq_len, r, comm.world_size, layout)] = parts[r, :, :size]
    return document_starts(whole)


def document_tile(documents: Documents, seq_len: int, dilated: bool) -> int:
    """Tile side over documents: about half the longest document, a multiple of 64, bounded.

    Work is then about ``n·(longest + 2·tile)`` pairs, whatever the number of documents.
    """
    half = -(-longest(documents, seq_len) // 2)
    side = max(64, -(-half // 64) * 64)
    return min(side, DILATED_DOCUMENT_TILE if dilated else DOCUMENT_TILE)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
    seq_len: Optional[int] = None,
    causal: bool = True,
    window: Optional[int] = None,
    pattern: Union[DilatedPattern, dict, None] = None,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    ``q`` is ``(B, Hq, S_local, D)``, ``k``/``v`` are ``(B, Hkv, S_local, D)``
    holding this rank's rows in ``local_positions`` order; returns this rank's
    rows of the output, ``(B, Hq, S_local, D)``. ``window=W`` lets query t see
    keys ``t-W < k <= t``. ``pattern`` selects dilated attention
    (:class:`hf_ring.DilatedPattern`); ``None`` is exact dense attention.
    ``key_mask`` ``(B, S_local)`` bool marks the keys that may be attended
    (False for padding); it travels with the K/V rows it describes.
    ``position_ids`` ``(B, S_local)``: this rank's rows' position ids; a row
    then holds several documents (each maximal run of ids increasing by one),
    and a query sees only its own document, with causality, window and
    dilation counted from the document's start. ``softcap`` caps the scores,
    ``softcap·tanh(s/softcap)``; ``sinks`` ``(Hq,)`` adds one logit per query
    head to the softmax denominator with a zero value (its gradient is this
    rank's rows' share: sum it over the ranks like any parameter's).
    Without a group and without torch.distributed it runs as one process.
    """
    return attend(q, k, v, _resolve_group(group), layout=layout, seq_len=seq_len, causal=causal,
                  window=window, pattern=pattern, scale=scale, key_mask=key_mask, position_ids=position_ids,
                  softcap=softcap, sinks=sinks)


def attend(q: Tensor, k: Tensor, v: Tensor, comm: Optional[RingComm], *, layout: str = "zigzag",
           seq_len: Optional[int] = None, causal: bool = True, window: Optional[int] = None,
           pattern: Union[DilatedPattern, dict, None] = None, scale: Optional[float] = None,
           key_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
           documents: Optional[Documents] = None, softcap: Optional[float] = None,
           sinks: Optional[Tensor] = None) -> Tensor:
    """:func:`ring_attention` over an already resolved ring (``None``: this process alone).

    ``documents``: the global document starts per batch row
    (:func:`hf_ring.documents.document_starts` of the global position ids),
    for a caller that knows them already; no collective is then needed to
    learn them. ``None`` (and no ``position_ids``) is one document per row.
    """
    _check_qkv(q, k, v)
    check_layout(layout)
    window, pattern, scale = check_options(causal, window, pattern, scale, q.shape[-1])
    key_mask = _check_key_mask(key_mask, k)
    softcap = check_softcap(softcap)
    sinks = check_sinks(sinks, q.shape[1])
    position_ids = check_position_ids(position_ids, q, documents)
    n, any_padded = agree(comm, q, k, seq_len, layout, key_mask is not None and not bool(key_mask.all()),
                          option_codes(softcap, sinks, position_ids, documents))
    if not any_padded:
        key_mask = None  # an all-valid mask changes nothing; dropping it keeps the unmasked fast paths
    elif key_mask is None:
        key_mask = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
    rank, world = (0, 1) if comm is None else (comm.rank, comm.world_size)
    if position_ids is not None:
        documents = gather_documents(comm, position_ids, n, layout, k.device)
    documents = check_documents(documents, q.shape[0], n)
    branches = ((max(n, 1), 1),) if pattern is None else pattern.branches
    dilated = None
    tile = min(default_tile(window), PADDED_TILE) if key_mask is not None else None
    if documents is not None:
        if pattern is not None:  # dilation counts from each document's start: a dense plan with per-tile bias
            dilated, branches = pattern.branches, ((max(n, 1), 1),)
        tile = min(tile or default_tile(window), document_tile(documents, n, dilated is not None))
    if softcap is not None:
        tile = min(tile or default_tile(window), SOFTCAP_TILE)
    plan = rank_plan(n, rank, world, layout if world > 1 else "contiguous", bool(causal), window,
                     branches, q.shape[1], k.shape[1], message_budget(n, world, k.shape[1]), tile, documents)
    rctx = _Ctx(comm, plan, float(scale), bool(causal), window, key_mask, documents=documents, dilated=dilated,
                softcap=softcap, backward_tile=min(BACKWARD_TILE, tile or BACKWARD_TILE))
    return RingAttentionFunction.apply(q, k, v, sinks, rctx)
