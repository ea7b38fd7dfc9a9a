"""Local block attention that returns ``(out, lse)``, and its backward.

A block is one (query rows, key rows) pair. ``causal=True`` means the two row
sets hold the same positions (the diagonal block) so the kernel's top-left
causal mask is right; any other partial mask is passed as a boolean ``mask``
of shape ``(S_q, S_k)``, or ``(B, 1, S_q, S_k)`` with key padding (True = may
attend), or as a float additive bias ``(B, 1 or Hq, S_q, S_k)`` (-inf = masked;
dilated attention inside documents adds ``log m``). Rows with no allowed key get
``out = 0`` and ``lse = -inf`` so they vanish in a log-sum-exp merge.
``softcap`` caps the scores, ``cap·tanh(s/cap)``, before the mask (Gemma 2).

A partially visible causal block can instead come as a ``band`` ``(lo, hi)``
of allowed item offsets (key item j for query item i iff ``lo <= j - i <= hi``),
which the CUDA flash kernel takes without a mask.

Kernels, the first of :data:`KERNELS` that supports a block running it:

- CPU: the fused aten flash kernels (a band or mask as an additive bias).
- CUDA (:mod:`hf_ring.engine.cuda_kernels`): flash for fp16/bf16 blocks without a
  mask (dense, diagonal-causal, band), memory-efficient attention for fp32
  and for blocks with a mask or bias; both without repeating K/V.
- Otherwise (fp64, ``softcap``, which no fused kernel in torch applies, or a
  head size the kernels refuse): an exact math path in fp32 (fp64 for fp64
  inputs) over tiles of at most :data:`MATH_TILE` rows a side, which never
  expands K/V to the query-head count.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from . import cuda_kernels
from .blocks import band_mask
from .cuda_kernels import Band
from .merge import accumulator_dtype, merge_stacked

Tensor = torch.Tensor

_NEG_INF = float("-inf")


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.is_floating_point():
        return mask.to(dtype)
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(mask.logical_not(), _NEG_INF)


def kv_storage(x: Tensor) -> Tensor:
    """K or V stored as the block kernels read them fastest.

    On CPUs that is head-major ``(B, H, S, D)``: the fused CPU kernels run
    about 5% faster, forward and backward, on it than on the model's
    ``(B, S, H, D)`` storage, for the price of one O(S) copy per call. The
    GPU kernels read the model's storage as it is.
    """
    return x.contiguous() if x.device.type == "cpu" else x


def _grouped(mask: Tensor, b: int, hkv: int) -> Tensor:
    """A ``(S_q, S_k)``, ``(B, 1, S_q, S_k)`` or ``(B, Hq, S_q, S_k)`` mask laid out like grouped scores."""
    if mask.dim() != 4:
        return mask
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.reshape(mask.shape[0], hkv, mask.shape[1] // hkv, *mask.shape[2:])


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool, mask: Optional[Tensor],
            softcap: Optional[float] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Masked scores ``(B, Hkv, G, S_q, S_k)`` (query heads grouped under their K/V head).

    With ``softcap`` also ``tanh(s/cap)`` of the raw scores, whose derivative the backward needs.
    """
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    dt = accumulator_dtype(q)
    qg = q.to(dt).reshape(b, hkv, hq // hkv, sq, d)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.to(dt)) * scale
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(keep.logical_not(), _NEG_INF)
    if mask is not None:
        m = _grouped(mask, b, hkv)
        s = s + m.to(dt) if m.is_floating_point() else s.masked_fill(m.logical_not(), _NEG_INF)
    return s, t


MATH_TILE = 1024
"""Rows per side of the math path's tiles: it materialises scores, so its memory stays ~B·H·tile²
whatever the block (a CUDA block of a whole 32K shard would otherwise need tens of GB)."""


def _row_tiles(n: int) -> List[Tuple[int, int]]:
    """``(first row, rows)`` of each tile along one side of a block."""
    return [(i, min(MATH_TILE, n - i)) for i in range(0, n, MATH_TILE)]


def _rows(x: Tensor, tile: Tuple[int, int], dim: int = 2) -> Tensor:
    return x.narrow(dim, *tile)


def _tile_args(causal: bool, mask: Optional[Tensor], band: Optional[Band], qt: Tuple[int, int],
               kt: Tuple[int, int], device) -> Optional[Tuple[bool, Optional[Tensor]]]:
    """``(causal, mask)`` of the tile ``qt x kt`` (``(first row, rows)`` each) of a block, or None when no pair
    in it is allowed.

    A block's ``causal`` is top-left aligned (both sides hold the same
    positions), so only a diagonal tile keeps it; other tiles get it as a
    mask. A block's band becomes the tile's own band, and a mask only where
    the tile is partly inside it.
    """
    sub = None if mask is None else _rows(_rows(mask, qt, -2), kt, -1)
    (q0, nq), (k0, nk) = qt, kt
    if band is not None:
        lo, hi = band
        lo, hi = (None if lo is None else lo - (k0 - q0)), hi - (k0 - q0)
        if hi < -(nq - 1) or (lo is not None and (lo > nk - 1 or lo > hi)):
            return None
        if hi >= nk - 1 and (lo is None or lo <= -(nq - 1)):
            return False, sub
        allowed = band_mask(nq, nk, lo, hi, device=device)
        return False, allowed if sub is None else sub & allowed
    if not causal or qt == kt:
        return causal, sub
    if k0 >= q0 + nq:
        return None
    if k0 + nk - 1 <= q0:
        return False, sub
    allowed = band_mask(nq, nk, None, q0 - k0, device=device)
    return False, allowed if sub is None else sub & allowed


def _tiled_forward(tile_fn, q, k, v, causal, mask, band):
    """``tile_fn((q, k, v), causal, mask) -> (out, lse)`` over tiles of at most ``MATH_TILE`` rows a side.

    Each tile gets its share of the block's causality, band and mask; tiles
    with no allowed pair are skipped. Views and out-of-place merges only, so
    it runs on any device, fake ones included.
    """
    b, hq, sq, d = q.shape
    outs, lses = [], []
    for qt in _row_tiles(sq):
        out = torch.zeros(b, hq, qt[1], d, dtype=accumulator_dtype(q), device=q.device)
        lse = torch.full((b, hq, qt[1]), _NEG_INF, dtype=accumulator_dtype(q), device=q.device)
        for kt in _row_tiles(k.shape[2]):
            args = _tile_args(causal, mask, band, qt, kt, q.device)
            if args is not None:
                o_t, l_t = tile_fn((_rows(q, qt), _rows(k, kt), _rows(v, kt)), *args)
                out, lse = merge_stacked(torch.stack([out, o_t.to(out.dtype)]), torch.stack([lse, l_t]))
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)


def _tiled_backward(tile_fn, dout, q, k, v, out, lse, causal, mask, band):
    """``tile_fn((dout, q, k, v, out, lse), causal, mask) -> (dq, dk, dv)`` over tiles: with the global ``lse``
    every tile's share is exact."""
    acc = accumulator_dtype(q)
    k_tiles = _row_tiles(k.shape[2])
    dqs = []
    dks: List[Optional[Tensor]] = [None] * len(k_tiles)
    dvs: List[Optional[Tensor]] = [None] * len(k_tiles)
    for qt in _row_tiles(q.shape[2]):
        dq = torch.zeros(q.shape[0], q.shape[1], qt[1], q.shape[3], dtype=acc, device=q.device)
        for i, kt in enumerate(k_tiles):
            args = _tile_args(causal, mask, band, qt, kt, q.device)
            if args is None:
                continue
            g_q, g_k, g_v = tile_fn((_rows(dout, qt), _rows(q, qt), _rows(k, kt), _rows(v, kt), _rows(out, qt),
                                     _rows(lse, qt)), *args)
            dq = dq + g_q
            dks[i] = g_k if dks[i] is None else dks[i] + g_k
            dvs[i] = g_v if dvs[i] is None else dvs[i] + g_v
        dqs.append(dq)
    zero = lambda kt: torch.zeros(k.shape[0], k.shape[1], kt[1], k.shape[3], dtype=acc, device=q.device)  # noqa: E731
    dk = torch.cat([g if g is not None else zero(kt) for g, kt in zip(dks, k_tiles)], 2)
    dv = torch.cat([g if g is not None else zero(kt) for g, kt in zip(dvs, k_tiles)], 2)
    return torch.cat(dqs, 2), dk, dv


def _needs_tiles(q: Tensor, k: Tensor, masked: bool) -> bool:
    """Whether a block is larger than one tile and would have a mask (or, on the math path, scores) made whole."""
    return masked and (q.shape[2] > MATH_TILE or k.shape[2] > MATH_TILE)


def _math_tile_forward(q, k, v, scale, causal, mask, softcap=None):
    b, hq, sq, d = q.shape
    s, _ = _scores(q, k, scale, causal, mask, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v.to(p.dtype))
    return out.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq).to(accumulator_dtype(q))


def _math_tile_backward(dout, q, k, v, out, lse, scale, causal, mask, softcap=None):
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    s, t = _scores(q, k, scale, causal, mask, softcap)
    dt = s.dtype
    p = torch.exp(s - lse.to(dt).reshape(b, hkv, g, sq, 1))
    do = dout.to(dt).reshape(b, hkv, g, sq, d)
    o = out.to(dt).reshape(b, hkv, g, sq, d)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", do, v.to(dt))
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    if t is not None:
        ds = ds * (1 - t * t)  # d(cap·tanh(x/cap))/dx
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.to(dt)) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q.to(dt).reshape(b, hkv, g, sq, d)) * scale
    return dq.reshape(b, hq, sq, d), dk, dv


def _with_band(mask: Optional[Tensor], band: Optional[Band], sq: int, sk: int, device) -> Optional[Tensor]:
    """The mask of a kernel that takes no band: the band as a bool mask, joined to ``mask``."""
    if band is None:
        return mask
    allowed = band_mask(sq, sk, *band, device=device)
    return allowed if mask is None else mask & allowed


def _cpu_flash_forward(q, k, v, scale, causal, mask, softcap):
    bias = None if mask is None else _additive(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                           scale=scale)
    if mask is not None:
        # The fused kernel reports lse = 0 for a row whose keys are all masked.
        seen = torch.isneginf(mask).all(-1).logical_not() if mask.is_floating_point() else mask.any(-1)
        lse = lse.masked_fill(seen.logical_not(), _NEG_INF)
    return out, lse


def _cpu_flash_backward(dout, q, k, v, out, lse, scale, causal, mask, softcap):
    bias = None if mask is None else _additive(mask, q.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


def _efficient_forward(q, k, v, scale, causal, mask, softcap):
    return cuda_kernels.efficient_forward(q, k, v, scale=scale, causal=causal, mask=mask)


def _efficient_backward(dout, q, k, v, out, lse, scale, causal, mask, softcap):
    return cuda_kernels.efficient_backward(dout, q, k, v, out, lse, scale=scale, causal=causal, mask=mask)


@dataclass(frozen=True)
class Kernel:
    """One way to run a block, forward and backward.

    ``supports(q, masked, softcap)``: whether it takes a block of ``q``'s
    device and dtype (``masked``: the block has a mask). ``forward(q, k, v,
    scale, causal, mask, softcap)`` and ``backward(dout, q, k, v, out, lse,
    scale, causal, mask, softcap)`` see a mask with any band already joined,
    unless ``takes_band``: then they get the band instead of a mask, and the
    keyword call of :mod:`hf_ring.engine.cuda_kernels`. ``tiles``: when the block is
    cut into tiles of :data:`MATH_TILE` rows a side first (``"never"``,
    ``"masked"``: when it carries a mask or band, ``"always"``: it
    materialises scores). ``fallible``: a RuntimeError (a GPU the kernel does
    not support) hands the block to the next kernel that supports it.
    """

    name: str
    supports: Callable[[Tensor, bool, Optional[float]], bool]
    forward: Callable
    backward: Callable
    tiles: str = "never"
    takes_band: bool = False
    fallible: bool = False


_CPU_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fused(q: Tensor, softcap: Optional[float], device: str) -> bool:
    """No fused kernel in torch applies a soft cap."""
    return softcap is None and q.device.type == device


KERNELS: Tuple[Kernel, ...] = (
    Kernel("cuda_flash", lambda q, masked, cap: _fused(q, cap, "cuda") and not masked and cuda_kernels.flash_supports(q),
           cuda_kernels.flash_forward, cuda_kernels.flash_backward, takes_band=True, fallible=True),
    Kernel("cuda_efficient", lambda q, masked, cap: _fused(q, cap, "cuda") and cuda_kernels.efficient_supports(q),
           _efficient_forward, _efficient_backward, tiles="masked", fallible=True),
    # The ring hands the CPU blocks of at most a tile whenever they carry a mask, so it never tiles.
    Kernel("cpu_flash", lambda q, masked, cap: _fused(q, cap, "cpu") and q.dtype in _CPU_FLASH_DTYPES,
           _cpu_flash_forward, _cpu_flash_backward),
    Kernel("math", lambda q, masked, cap: True, _math_tile_forward, _math_tile_backward, tiles="always"),
)
"""The kernels a block may run on, in order of preference: the first that supports it runs it."""


def _cut(kernel: Kernel, q: Tensor, k: Tensor, mask: Optional[Tensor], band: Optional[Band]) -> bool:
    """Whether ``kernel`` runs this block in tiles."""
    masked = True if kernel.tiles == "always" else (kernel.tiles == "masked" and (band is not None or mask is not None))
    return _needs_tiles(q, k, masked)


@dataclass(frozen=True)
class BlockCall:
    """One block's settings, the same for its forward and its backward and for every tile it is cut into."""

    scale: float
    causal: bool
    mask: Optional[Tensor]
    softcap: Optional[float]
    band: Optional[Band]

    def on_tile(self, fn: Callable) -> Callable:
        """``fn`` (a kernel's forward or backward) as the tiled paths call it: the tile's tensors, causality, mask."""
        return lambda tensors, causal, mask: fn(*tensors, self.scale, causal, mask, self.softcap)

    def run(self, kernel: Kernel, fn: Callable, tiled: Callable, tensors: Tuple[Tensor, ...], q: Tensor, k: Tensor):
        """``fn``, ``kernel``'s forward or backward, over this block: whole, or in tiles through ``tiled``."""
        if kernel.takes_band:
            return fn(*tensors, scale=self.scale, causal=self.causal, band=self.band)
        if _cut(kernel, q, k, self.mask, self.band):
            return tiled(self.on_tile(fn), *tensors, self.causal, self.mask, self.band)
        return fn(*tensors, self.scale, self.causal, _with_band(self.mask, self.band, q.shape[2], k.shape[2], q.device),
                  self.softcap)


def _each_kernel(q: Tensor, mask: Optional[Tensor], softcap: Optional[float], attempt: Callable):
    """``attempt(kernel)`` with the first kernel that supports the block; a fallible one that fails hands on."""
    for kernel in KERNELS:
        if not kernel.supports(q, mask is not None, softcap):
            continue
        try:
            return attempt(kernel)
        except RuntimeError as err:
            if not kernel.fallible:
                raise
            _warn_fallback(err)  # a GPU the kernel does not support
    raise AssertionError("the math kernel supports every block")


def _widened(x: Tensor, width: int) -> Tensor:
    """``x`` with zero columns appended up to ``width`` (itself when already that wide)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def block_forward(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool = False,
                  mask: Optional[Tensor] = None, softcap: Optional[float] = None,
                  band: Optional[Band] = None) -> Tuple[Tensor, Tensor]:
    """Attention of one block: ``out`` in ``q.dtype`` ``(B, Hq, S_q, D_v)``, ``lse`` ``(B, Hq, S_q)`` in fp32 (fp64
    for fp64).

    No route makes a mask or scores larger than one tile of ``MATH_TILE`` rows a side. Values of another head
    size than the queries and keys (multi-head latent attention: 128 against 192) run as the fused kernels need
    them, all of one size: the narrower side widened with zero columns, which add nothing to a score or an output,
    and the output cut back to the values' size.
    """
    if v.shape[-1] != q.shape[-1]:
        width = max(v.shape[-1], q.shape[-1])
        out, lse = block_forward(_widened(q, width), _widened(k, width), _widened(v, width), scale=scale,
                                 causal=causal, mask=mask, softcap=softcap, band=band)
        return out[..., :v.shape[-1]], lse
    call = BlockCall(scale, causal, mask, softcap, band)
    return _each_kernel(q, mask, softcap, lambda kn: call.run(kn, kn.forward, _tiled_forward, (q, k, v), q, k))


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, scale: float,
                   causal: bool = False, mask: Optional[Tensor] = None, softcap: Optional[float] = None,
                   band: Optional[Band] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *merged* ``out`` and ``lse`` of the whole attention.

    Using the global ``out``/``lse`` makes each block's gradient its exact share
    of the full gradient, so summing blocks needs no rescaling.
    """
    if v.shape[-1] != q.shape[-1]:  # as block_forward runs it: one head size, zero columns cut off again
        width = max(v.shape[-1], q.shape[-1])
        dq, dk, dv = block_backward(_widened(dout, width), _widened(q, width), _widened(k, width),
                                    _widened(v, width), _widened(out, width), lse, scale=scale, causal=causal,
                                    mask=mask, softcap=softcap, band=band)
        return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]
    # A row with no key anywhere has lse = -inf; +inf makes every p = exp(s - lse) exactly 0.
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    call = BlockCall(scale, causal, mask, softcap, band)
    return _each_kernel(q, mask, softcap,
                        lambda kn: call.run(kn, kn.backward, _tiled_backward, (dout, q, k, v, out, lse), q, k))


FALLBACK_WARNING = "hf_ring: a fused CUDA kernel refused a block"


def _warn_fallback(err: Exception) -> None:
    """The next kernel (efficient attention, then the exact math path) takes over; say so, since it is slower."""
    warnings.warn(f"{FALLBACK_WARNING} ({err}); using the next kernel", stacklevel=3)
