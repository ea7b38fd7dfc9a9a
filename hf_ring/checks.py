"""Argument checks of ring attention and the ranks' agreement on them.

Everything a rank could get wrong on its own (types, shapes, options) is
checked locally first; everything the ranks must share (shapes, dtype,
layout, causality, window, pattern, padding, lengths) is then compared in one
small all-gather, so a mismatch raises the same error on every rank before
any K/V row moves, instead of leaving some ranks waiting in the ring.
"""
from __future__ import annotations

import math
import struct
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .arguments import positive_int
from .comm import RingComm
from .kernels import default_scale
from .documents import Documents, check_documents, document_starts
from .layout import LAYOUTS, check_layout, infer_seq_len, local_positions, shard_sizes
from .pattern import DilatedPattern
from .spec import AttentionSpec

Tensor = torch.Tensor

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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
    if q.dtype not in _DTYPES:
        raise TypeError(f"q, k, v must be one of {[str(d) for d in _DTYPES]}, got {q.dtype}")
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


OPTIONS = {"layout": "zigzag", "seq_len": None, "causal": True, "window": None, "pattern": None, "scale": None,
           "softcap": None, "documents": None, "message_rows": None}
"""The options :func:`hf_ring.ring_attention` takes by keyword, with their defaults."""


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
                   message_rows=check_message_rows(o["message_rows"]), key_mask=check_key_mask(key_mask, k),
                   sinks=check_sinks(sinks, q.shape[1]))


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
    return spec.at(seq_len=n, documents=check_documents(documents, q.shape[0], n),
                   key_mask=full_key_mask(spec.key_mask, k, padded))


def resolve_group(group) -> Optional[RingComm]:
    """The ring of ``group`` (the default group when None), or None for one process without torch.distributed."""
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


def _digest(value: Any) -> int:
    """A stable 31-bit fingerprint of a small value (the same on every rank for equal values)."""
    return zlib.crc32(repr(value).encode()) & 0x7FFFFFFF


def check_position_ids(position_ids, q: Tensor) -> Optional[Tensor]:
    """This rank's rows' position ids ``(B, S_local)`` (integers), or None."""
    if position_ids is None:
        return None
    _check_tensor("position_ids", position_ids, "an integer tensor (this rank's rows, in local_positions order)",
                  (q.shape[0], q.shape[2]), "(batch, local rows)")
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise TypeError(f"position_ids must be an integer tensor (torch.long), got {position_ids.dtype}")
    return position_ids


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


def _check_seq_len(seq_len) -> Optional[int]:
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0):
        raise ValueError(f"seq_len must be a non-negative int or None, got {seq_len!r}")
    return seq_len


# Columns of the agreement table: (name in errors, whether every rank must hold the same value).
_COLUMNS: Tuple[Tuple[str, bool], ...] = (
    ("local rows", False), ("seq_len", True), ("padded keys", False), ("batch size", True), ("query heads", True),
    ("key/value heads", True), ("head_dim", True), ("dtype", True), ("layout", True), ("causal", True),
    ("window", True), ("pattern", True), ("scale", True), ("sharded inputs", True), ("batch contents", True),
    ("options", True),
)


_SHARDED = [name for name, _ in _COLUMNS].index("sharded inputs")


def facts(q: Tensor, k: Tensor, seq_len: Optional[int], opts: AttentionSpec, padded: bool,
          sharded: bool = True, contents: int = 0, codes: Sequence[Tuple[str, int]] = ()) -> List[int]:
    """This rank's row of the agreement table (see ``_COLUMNS``); ``codes`` are :func:`option_codes`."""
    return [
        q.shape[2], -1 if seq_len is None else seq_len, int(padded), q.shape[0], q.shape[1], k.shape[1], q.shape[3],
        _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1, LAYOUTS.index(opts.layout), int(opts.causal),
        -1 if opts.window is None else opts.window, _digest(opts.pattern), _digest(opts.scale), int(sharded), contents,
        _digest(tuple(code for _, code in codes)),
    ]


def agree_table(comm: RingComm, mine: Optional[Sequence[int]], codes: Sequence[Tuple[str, int]] = (),
                error: Optional[Exception] = None) -> List[List[int]]:
    """Every rank's row; raises the same error on every rank if a rank's local checks failed or a shared column differs.

    ``error``: what this rank's own argument checks raised (``mine`` is then
    ignored); it travels in the same exchange, so every rank raises the first
    failing rank's error at once instead of waiting for it. When only the
    options digest differs, the ranks (all of them, having seen the same
    table) gather the option codes themselves to name the one that differs.
    """
    row = list(mine) if error is None else [0] * len(_COLUMNS)
    both = comm.all_gather_ints(row + _error_row(error), "the agreement on attention arguments before the ring")
    _raise_first([r[len(_COLUMNS):] for r in both])
    table = [r[: len(_COLUMNS)] for r in both]
    sharded = [row[_SHARDED] for row in table]
    if not all(sharded):
        raise ValueError(_disagreement("sharded inputs", sharded))
    for i, (name, shared) in enumerate(_COLUMNS):
        values = [row[i] for row in table]
        if shared and len(set(values)) > 1:
            if name == "options" and codes:
                _name_the_option(comm, codes)
            raise ValueError(_disagreement(name, values))
    return table


_NONE = -(1 << 62)


def _float_code(x: Optional[float]) -> int:
    """A float as an integer every rank can compare exactly (its IEEE bits); None is a value no float has."""
    return _NONE if x is None else struct.unpack("<q", struct.pack("<d", x))[0]


def option_codes(spec: AttentionSpec, position_ids: Optional[Tensor] = None) -> List[Tuple[str, int]]:
    """The options beyond the basic ones that every rank must share, as integers for the agreement."""
    documents = spec.documents
    return [("softcap", _float_code(spec.softcap)), ("sinks", _NONE if spec.sinks is None else 1),
            ("position_ids", _NONE if position_ids is None else 1),
            ("documents", _NONE if documents is None else hash(documents) & ((1 << 61) - 1)),
            ("message_rows", _NONE if spec.message_rows is None else spec.message_rows)]


def check_message_rows(message_rows) -> Optional[int]:
    """K/V rows per ring message, or None for the default."""
    if message_rows is None:
        return None
    return positive_int(message_rows, "message_rows", "K/V rows per ring message, or None")


def _name_the_option(comm: RingComm, codes: Sequence[Tuple[str, int]]) -> None:
    table = comm.all_gather_ints([code for _, code in codes], "the option check before the ring")
    for i, (name, _) in enumerate(codes):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            shown = [None if c == _NONE else (struct.unpack("<d", struct.pack("<q", c))[0] if name == "softcap"
                                              else "given") for c in values]
            raise ValueError(f"the ranks passed different {name}: {shown} (by rank); pass the same on every rank")


def unsharded_message(ranks: Sequence[int]) -> str:
    return (
        f"rank(s) {list(ranks)} ran a forward whose inputs were not sharded for sequence parallelism, so each rank "
        "would attend over a sequence stitched from unrelated rows; pass every batch through hf_ring.shard_batch "
        "(or hf_ring.prepare_trainer for transformers.Trainer) while sequence parallelism is set up, or call "
        "hf_ring.clear_sequence_parallel() to run whole sequences"
    )


def _disagreement(name: str, values: List[int]) -> str:
    if name == "sharded inputs":
        return unsharded_message([r for r, v in enumerate(values) if not v])
    if name == "batch contents":
        return ("the ranks of a sequence-parallel group passed different batches to hf_ring.shard_batch; every rank "
                "of a group must shard the same global batch (only data-parallel ranks differ)")
    if name == "dtype":
        names = [str(_DTYPES[v]) if 0 <= v < len(_DTYPES) else "?" for v in values]
        return f"the ranks of the ring disagree on dtype: {names} (by rank)"
    if name == "seq_len":
        return f"the ranks passed different seq_len values: {values} (by rank; -1 = None)"
    if name == "layout":
        return f"the ranks of the ring disagree on layout: {[LAYOUTS[v] for v in values]} (by rank)"
    return f"the ranks of the ring disagree on {name}: {values} (by rank)"


def global_length(table: Sequence[Sequence[int]], seq_len: Optional[int], layout: str, ulysses: int = 1) -> int:
    """The global length the ranks' row counts give (checked against ``seq_len`` when given)."""
    lens = [row[0] for row in table]
    if seq_len is None:
        return infer_seq_len(lens, layout, ulysses)
    expected = shard_sizes(seq_len, len(lens), layout, ulysses)
    if lens != expected:
        mode = f" and ulysses_size={ulysses}" if ulysses > 1 else ""
        raise ValueError(
            f"seq_len={seq_len} with layout={layout!r}{mode} over {len(lens)} ranks needs shard sizes "
            f"{expected}, but the ranks hold {lens}; shard with hf_ring.local_positions"
        )
    return seq_len


def _padded(key_mask: Optional[Tensor]) -> bool:
    return key_mask is not None and not bool(key_mask.all())


def agree(comm: Optional[RingComm], q: Tensor, k: Tensor, seq_len: Optional[int], opts: Optional[AttentionSpec],
          codes: Sequence[Tuple[str, int]] = (), error: Optional[Exception] = None) -> Tuple[int, bool]:
    """The global length, and whether any rank has padded keys, agreed by every rank of the ring.

    ``error``: what this rank's local argument checks raised; every rank then
    raises it (see :func:`agree_table`).
    """
    if error is None:
        try:
            seq_len = _check_seq_len(seq_len)
        except ValueError as err:
            error = err
    if comm is None or comm.world_size == 1:
        if error is not None:
            raise error
        if seq_len is not None and seq_len != q.shape[2]:
            raise ValueError(f"seq_len={seq_len} but this single process holds {q.shape[2]} rows")
        return q.shape[2], _padded(opts.key_mask)
    mine = None if error is not None else facts(q, k, seq_len, opts, _padded(opts.key_mask), codes=codes)
    table = agree_table(comm, mine, codes, error)
    return global_length(table, seq_len, opts.layout), any(row[2] for row in table)


def full_key_mask(key_mask: Optional[Tensor], k: Tensor, any_padded: bool) -> Optional[Tensor]:
    """The key mask the ring carries: None when no rank is padded, all-True rows on an unpadded rank otherwise."""
    if not any_padded:
        return None  # an all-valid mask changes nothing; dropping it keeps the unmasked fast paths
    if key_mask is None:
        return torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
    return key_mask


_MESSAGE_BYTES = 480
_ERROR_INTS = 2 + _MESSAGE_BYTES
_KINDS = {"TypeError": TypeError, "NotImplementedError": NotImplementedError}


def _error_row(error: Optional[Exception]) -> List[int]:
    """A local check's outcome as integers of one fixed size: failed or not, then its type and message."""
    text = b"" if error is None else f"{type(error).__name__}\0{error}".encode()[:_MESSAGE_BYTES]
    return [int(error is not None), len(text)] + list(text) + [0] * (_MESSAGE_BYTES - len(text))


def _raise_first(rows: Sequence[Sequence[int]]) -> None:
    """Raise, on this rank, the error of the first rank whose row (see :func:`_error_row`) says it failed."""
    failed = [r for r, got in enumerate(rows) if got[0]]
    if not failed:
        return
    first = rows[failed[0]]
    kind, _, message = bytes(first[2:2 + first[1]]).decode(errors="replace").partition("\0")
    raise _KINDS.get(kind, ValueError)(f"rank {failed[0]}: {message}")


@dataclass
class Caught:
    """What a block of local checks raised (see :func:`caught`)."""

    error: Optional[Exception] = None


@contextmanager
def caught() -> Iterator[Caught]:
    """Keep the TypeError or ValueError a block of local checks raises instead of raising it now.

    Under sequence parallelism no rank may raise alone while the others wait
    for it in a collective: the error is handed to the exchange every rank
    makes next (:func:`fail_together`, or the ring's agreement), which raises
    it on all of them.
    """
    found = Caught()
    try:
        yield found
    except (TypeError, ValueError) as err:
        found.error = err


@contextmanager
def fail_together(comm: Optional[RingComm], what: str) -> Iterator[None]:
    """Run a block of local checks; an error it raises on one rank is raised on every rank of ``comm``.

    The ranks exchange the block's outcome once after it (:func:`raise_together`), whether it passed or not.
    """
    with caught() as found:
        yield
    raise_together(comm, found.error, what)


def raise_together(comm: Optional[RingComm], error: Optional[Exception], what: str) -> None:
    """Make one rank's failed local check fail every rank, with the same exception.

    Checks that need no other rank run first on each rank; this exchange (one
    small all-gather) then tells every rank whether any failed, so no rank
    raises while the others wait for it in a collective. Every rank raises
    the first failing rank's error type and message, prefixed with its rank.
    The ring's own agreement carries the same row (:func:`agree_table`), so
    a direct call needs no exchange of its own.
    """
    if comm is None or comm.world_size == 1:
        if error is not None:
            raise error
        return
    _raise_first(comm.all_gather_ints(_error_row(error), what))
