"""Local argument checks of ring attention: everything one rank can get wrong on its own.

Types, shapes and options are checked here, on each rank, with no exchange;
what the ranks must share is compared afterwards in :mod:`hf_ring.engine.agreement`.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Tuple

import torch

from .arguments import positive_int
from .kernels import default_scale
from .layout import check_layout
from .pattern import DilatedPattern
from .spans import Spans, check_spans
from .spec import DTYPES, AttentionSpec

Tensor = torch.Tensor


def check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q, k, v must be one of {[str(d) for d in DTYPES]}, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got q={q.device}, k={k.device}, v={v.device}")
    if k.shape[:3] != v.shape[:3]:  # v's head_dim may differ (multi-head latent attention: 128 against 192)
        raise ValueError(f"k and v must have the same batch, heads and rows; got k={tuple(k.shape)}, "
                         f"v={tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch size differs: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head_dim differs: q has {q.shape[3]}, k has {k.shape[3]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q has {q.shape[2]} local rows but k/v have {k.shape[2]}; ring attention needs each rank's "
            "own rows of q, k and v (for decoding with a cache use hf_ring.generate)"
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


def _check_tensor(name: str, t: Any, what: str, shape: Tuple[int, ...], dims: str) -> Tensor:
    """``t`` is a tensor of ``shape`` (named ``dims`` in errors); ``what`` says what it must hold."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be {what} of shape {dims} = {shape} or None, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {dims} = {shape}, got {tuple(t.shape)}")
    return t


def check_key_mask(key_mask, k: Tensor) -> Optional[Tensor]:
    if key_mask is None:
        return None
    _check_tensor("key_mask", key_mask, "a bool tensor", (k.shape[0], k.shape[2]), "(batch, local rows)")
    if key_mask.dtype != torch.bool:
        raise TypeError(f"key_mask must be torch.bool (True = attend), got {key_mask.dtype}")
    return key_mask.to(k.device)


def check_softcap(softcap) -> Optional[float]:
    """``softcap`` as a float, or None; it must be a finite number > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float > 0 or None (scores -> softcap·tanh(scores/softcap)), got {softcap!r}")
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap!r}")
    return float(softcap)


def check_sinks(sinks, hq: int) -> Optional[Tensor]:
    """``sinks``: one float logit per query head, shape ``(Hq,)``, or None."""
    if sinks is None:
        return None
    _check_tensor("sinks", sinks, "a float tensor (one logit per query head)", (hq,), "(query heads,)")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    return sinks


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


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0 (softmax temperature), got {scale!r}")
    return float(scale)


def _check_causal(causal) -> bool:
    if not isinstance(causal, (bool, int)) or causal not in (0, 1):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    return bool(causal)


def check_options(causal, window, pattern, scale, head_dim: int, layout: str = "zigzag") -> AttentionSpec:
    """The spec of these options (checked); ``scale=None`` becomes ``1/sqrt(head_dim)``."""
    causal = _check_causal(causal)
    window = _check_window(window, causal)
    return AttentionSpec(_check_scale(scale, head_dim), causal, window, _check_pattern(pattern, window),
                         layout=check_layout(layout))


OPTIONS = {**{name: AttentionSpec.__dataclass_fields__[name].default
              for name in ("layout", "seq_len", "causal", "window", "pattern", "softcap", "documents", "spans",
                           "message_rows")}, "scale": None}
"""The options :func:`hf_ring.ring_attention` takes by keyword, with their defaults: the spec's own (``scale=None``
is ``1/sqrt(head_dim)``)."""


def check_spec(q, k, v, options: Mapping[str, Any], key_mask=None, sinks=None) -> AttentionSpec:
    """Every local check of a ring attention call: its spec, before the ranks agree on the length."""
    check_qkv(q, k, v)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"ring_attention got unexpected keyword argument(s) {unknown}; it takes group, key_mask, "
                        f"position_ids, sinks and the options {sorted(OPTIONS)}")
    o = {**OPTIONS, **options}
    spec = check_options(o["causal"], o["window"], o["pattern"], o["scale"], q.shape[-1], o["layout"])
    return spec.at(softcap=check_softcap(o["softcap"]), documents=o["documents"],
                   spans=check_spans_option(o["spans"], spec, q.shape[0], o["seq_len"]),
                   message_rows=check_message_rows(o["message_rows"]), key_mask=check_key_mask(key_mask, k),
                   sinks=check_sinks(sinks, q.shape[1]))


def check_spans_option(spans, spec: AttentionSpec, batch: int, seq_len: Optional[int]) -> Optional[Spans]:
    """Bidirectional spans for ``spec`` (checked): None where they add nothing (no span of two rows, or
    attention that is not causal, where every pair of a span is allowed anyway)."""
    spans = check_spans(spans, batch, seq_len)
    if spans is None or not spec.causal:
        return None
    if spec.pattern is not None:
        raise NotImplementedError("bidirectional spans inside a dilated pattern are not implemented; use dense "
                                  "attention (pattern=None) with spans")
    return spans


def check_position_ids(position_ids, q: Tensor) -> Optional[Tensor]:
    """This rank's rows' position ids ``(B, S_local)`` (integers), or None."""
    if position_ids is None:
        return None
    _check_tensor("position_ids", position_ids, "an integer tensor (this rank's rows, in local_positions order)",
                  (q.shape[0], q.shape[2]), "(batch, local rows)")
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer tensor (torch.long), got {position_ids.dtype}")
    return position_ids


def check_message_rows(message_rows) -> Optional[int]:
    """K/V rows per ring message, or None for the default."""
    if message_rows is None:
        return None
    return positive_int(message_rows, "message_rows", "K/V rows per ring message, or None")
