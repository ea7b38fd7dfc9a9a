"""What travels on the ring: a step's K/V pieces packed into flat messages, and views of what arrived.

A step's plan (:mod:`hf_ring.engine.schedule`) names the pieces (heads x rows) a rank
sends and receives; each direction is one flat buffer per tensor (K, V, and
the key mask when some rank is padded), so a message is one transfer per
tensor whatever the pieces (and over gloo a small message's K and V are one
transfer, :func:`hf_ring.engine.comm.fused`). A piece that is a strided view
of another one travels inside its parent.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .blocks import KeyValidity
from .comm import Pending, RingComm
from .pattern import head_slice
from .schedule import Piece, Step, sent, view_within

Tensor = torch.Tensor

KV_TAG, GRAD_TAG = 0, 4
"""Message tags: K/V going out use tags ``KV_TAG + i`` for their (up to three) tensors (K, V, key mask),
gradients coming home ``GRAD_TAG + i`` (dK, dV), so the two directions never match each other's receives."""


def piece_view(x: Tensor, piece: Piece) -> Tensor:
    return x[:, head_slice(piece.heads), piece.rows.slice]


def covers(pieces: Sequence[Piece], x: Tensor) -> bool:
    """One piece holding every head and row of ``x``."""
    if len(pieces) != 1 or pieces[0].within is not None:
        return False
    p = pieces[0]
    return p.heads == range(x.shape[1]) and p.rows.stride == 1 and p.rows.local == 0 and p.rows.count == x.shape[2]


def _whole(pieces: Sequence[Piece], x: Tensor) -> bool:
    """One piece that is the entire tensor, in its storage order: it is sent as it is, without packing."""
    return covers(pieces, x) and x.is_contiguous()


def numels(pieces: Sequence[Piece], b: int, d: int) -> List[int]:
    """Elements of each piece that travels (views of another piece travel inside it)."""
    return [b * len(p.heads) * p.rows.count * d for p in sent(pieces)]


def _pack(x: Tensor, pieces: Sequence[Piece]) -> Tensor:
    """The pieces of ``x`` that travel, laid one after another in a flat buffer."""
    if _whole(pieces, x):
        return x.reshape(-1)
    b, d = x.shape[0], x.shape[3]
    flat = x.new_empty(sum(numels(pieces, b, d)))
    for view, piece in zip(sent_views(flat, pieces, b, d), sent(pieces)):
        view.copy_(piece_view(x, piece))
    return flat


def _with_views(pieces: Sequence[Piece], own: List[Tensor], index) -> List[Tensor]:
    """Per piece its tensor: the ones that travel from ``own``, the others as strided views of their parent."""
    it = iter(own)
    out = [next(it) if p.within is None else None for p in pieces]
    for i, p in enumerate(pieces):
        if p.within is not None:
            out[i] = index(out[p.within], *view_within(pieces[p.within], p))
    return out


def sent_views(flat: Tensor, pieces: Sequence[Piece], b: int, d: int) -> List[Tensor]:
    """Views of the travelling pieces in their flat buffer, ``(B, heads, rows, D)`` each."""
    views, off = [], 0
    for piece, n in zip(sent(pieces), numels(pieces, b, d)):
        views.append(flat[off : off + n].view(b, len(piece.heads), piece.rows.count, d))
        off += n
    return views


def unpack(flat: Tensor, pieces: Sequence[Piece], b: int, d: int) -> List[Tensor]:
    """Views of every piece in a flat buffer of the travelling pieces (the others inside their parent's)."""
    return _with_views(pieces, sent_views(flat, pieces, b, d), lambda t, heads, items: t[:, heads, items])


def post(comm: RingComm, step: Step, send: Sequence[Tensor], recv: Sequence[Tuple[torch.Size, torch.dtype]],
          device: torch.device, tag: int, reverse: bool = False) -> Pending:
    """One step's traffic: to ``dst``/from ``src``, or the reverse (gradients going home)."""
    send_to, recv_from = (step.src, step.dst) if reverse else (step.dst, step.src)
    return comm.exchange(list(send), send_to, list(recv), recv_from, tag=tag, device=device)


def kv_traffic(step: Step, k: Tensor, v: Tensor, key_mask: Optional[Tensor]):
    """What this rank sends for ``step`` (its K, V and key mask rows) and what it expects back."""
    send = []
    if step.send:
        send = [_pack(k, step.send), _pack(v, step.send)]
        if key_mask is not None:
            send.append(_pack_mask(key_mask, step.send))
    recv = []
    if step.recv.pieces:  # K's and V's rows: their head sizes may differ (multi-head latent attention)
        recv = [(torch.Size((sum(numels(step.recv.pieces, x.shape[0], x.shape[3])),)), x.dtype) for x in (k, v)]
        if key_mask is not None:
            recv.append((torch.Size((k.shape[0] * sum(p.rows.count for p in sent(step.recv.pieces)),)), torch.uint8))
    return send, recv


def _pack_mask(key_mask: Tensor, pieces: Sequence[Piece]) -> Tensor:
    return torch.cat([key_mask[:, p.rows.slice].reshape(-1) for p in sent(pieces)]).to(torch.uint8)


def _unpack_mask(flat: Tensor, pieces: Sequence[Piece], b: int) -> List[Tensor]:
    views, off = [], 0
    for p in sent(pieces):
        n = b * p.rows.count
        views.append(flat[off : off + n].view(b, p.rows.count).bool())
        off += n
    return _with_views(pieces, views, lambda t, heads, items: t[:, items])


def kv_views(step: Step, k: Tensor, v: Tensor, key_mask: Optional[Tensor], got: Optional[List[Tensor]]):
    """Per piece ``(K, V, key mask, its KeyValidity)``, the last two None where no key of the piece is padding."""
    b = k.shape[0]
    pieces = step.recv.pieces
    if not pieces:
        return []
    if step.shift == 0:
        ks = [piece_view(k, p) for p in pieces]
        vs = [piece_view(v, p) for p in pieces]
        ms = [None if key_mask is None else key_mask[:, p.rows.slice] for p in pieces]
    else:
        ks, vs = unpack(got[0], pieces, b, k.shape[3]), unpack(got[1], pieces, b, v.shape[3])
        ms = [None] * len(pieces) if key_mask is None else _unpack_mask(got[2], pieces, b)
    views = []
    for kk, vv, m in zip(ks, vs, ms):
        valid = None if m is None else KeyValidity(m)
        padded = valid is not None and not valid.all_valid()
        views.append((kk, vv, m if padded else None, valid if padded else None))
    return views
