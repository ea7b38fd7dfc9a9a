"""The ranks' agreement on a ring call: what every rank must share, compared in one small all-gather.

Everything a rank could get wrong on its own is checked first (:mod:`hf_ring.engine.checks`, beside it);
what the ranks must share (shapes, dtype, layout, causality, window,
pattern, padding, lengths) is then compared as one row of named integers per
rank (:class:`Facts`), so a mismatch raises the same error on every rank
before any K/V row moves, instead of leaving some ranks waiting in the ring.
A rank whose local checks failed sends its error in the same exchange
(:mod:`hf_ring.engine.relay`).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .comm import RingComm
from .documents import Documents, document_starts
from .fingerprint import fingerprint
from .layout import LAYOUTS, infer_seq_len, layout_name, local_positions, shard_sizes
from .relay import error_row, raise_first
from .spec import DTYPES, AttentionSpec

Tensor = torch.Tensor


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


def _shared(name: str) -> Any:
    return field(metadata={"name": name, "shared": True})


@dataclass(frozen=True)
class Facts:
    """One rank's row of the agreement: what it holds and what it asks for, as integers every rank can compare.

    Fields made with ``_shared`` must hold the same value on every rank; their
    metadata names them in the error when they do not.
    """

    local_rows: int
    padded_keys: int
    seq_len: int = _shared("seq_len")  # -1: None
    batch_size: int = _shared("batch size")
    query_heads: int = _shared("query heads")
    kv_heads: int = _shared("key/value heads")
    head_dim: int = _shared("head_dim")
    dtype: int = _shared("dtype")
    layout: int = _shared("layout")
    causal: int = _shared("causal")
    window: int = _shared("window")  # -1: None
    pattern: int = _shared("pattern")
    scale: int = _shared("scale")
    sharded: int = _shared("sharded inputs")
    contents: int = _shared("batch contents")
    options: int = _shared("options")

    def row(self) -> List[int]:
        return [getattr(self, f.name) for f in fields(self)]


_WIDTH = len(fields(Facts))


def facts(q: Tensor, k: Tensor, seq_len: Optional[int], opts: AttentionSpec, padded: bool,
          sharded: bool = True, contents: int = 0, codes: Sequence[Tuple[str, int]] = ()) -> Facts:
    """This rank's row of the agreement; ``codes`` are :func:`option_codes`."""
    return Facts(
        local_rows=q.shape[2], padded_keys=int(padded), seq_len=-1 if seq_len is None else seq_len,
        batch_size=q.shape[0], query_heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[3],
        dtype=DTYPES.index(q.dtype) if q.dtype in DTYPES else -1, layout=LAYOUTS.index(layout_name(opts.layout)),
        causal=int(opts.causal), window=-1 if opts.window is None else opts.window, pattern=fingerprint(opts.pattern),
        scale=fingerprint(opts.scale), sharded=int(sharded), contents=contents,
        options=fingerprint(tuple(code for _, code in codes)),
    )


def agree_table(comm: RingComm, mine: Optional[Facts], codes: Sequence[Tuple[str, int]] = (),
                error: Optional[Exception] = None) -> List[Facts]:
    """Every rank's facts; raises the same error on every rank if a rank's local checks failed or a shared field differs.

    ``error``: what this rank's own argument checks raised (``mine`` is then
    ignored); it travels in the same exchange, so every rank raises the first
    failing rank's error at once instead of waiting for it. When only the
    options digest differs, the ranks (all of them, having seen the same
    table) gather the option codes themselves to name the one that differs.
    """
    row = mine.row() if error is None else [0] * _WIDTH
    both = comm.all_gather_ints(row + error_row(error), "the agreement on attention arguments before the ring")
    raise_first([r[_WIDTH:] for r in both], comm.rank, error)
    table = [Facts(*r[:_WIDTH]) for r in both]
    sharded = [f.sharded for f in table]
    if not all(sharded):
        raise unsharded_error([r for r, v in enumerate(sharded) if not v])
    shared = [f for f in fields(Facts) if f.metadata.get("shared")]
    for name, values in differing([[getattr(row, f.name) for f in shared] for row in table],
                                  [f.name for f in shared]).items():
        if name == "options" and codes:
            _name_the_option(comm, codes)
        raise ValueError(_disagreement(Facts.__dataclass_fields__[name].metadata["name"], values))
    return table


def differing(table: Sequence[Sequence[int]], names: Sequence[str]) -> Dict[str, List[int]]:
    """Per name, in order, the column of ``table`` (one row of integers per rank, in the order of ``names``) where
    the ranks differ: the one comparison behind every check that the ranks were given the same thing."""
    return {name: [row[i] for row in table] for i, name in enumerate(names) if len({row[i] for row in table}) > 1}


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
            ("spans", _NONE if spec.spans is None else hash(spec.spans) & ((1 << 61) - 1)),
            ("message_rows", _NONE if spec.message_rows is None else spec.message_rows)]


def _name_the_option(comm: RingComm, codes: Sequence[Tuple[str, int]]) -> None:
    table = comm.all_gather_ints([code for _, code in codes], "the option check before the ring")
    for i, (name, _) in enumerate(codes):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            shown = [None if c == _NONE else (struct.unpack("<d", struct.pack("<q", c))[0] if name == "softcap"
                                              else "given") for c in values]
            raise ValueError(f"the ranks passed different {name}: {shown} (by rank); pass the same on every rank")


UNSHARDED_RANKS = "unsharded_ranks"
"""The attribute naming, on the ValueError of :func:`unsharded_error`, the group ranks whose attention got no sharded
inputs: a caller that knows the forward *was* sharded (the guard on the model's call) can then tell a model that
dropped the forward's context on the way to its attention from a batch that was never sharded."""


def unsharded_error(ranks: Sequence[int]) -> ValueError:
    """The error of a forward under sequence parallelism whose attention got no sharded inputs on ``ranks``."""
    error = ValueError(unsharded_message(ranks))
    setattr(error, UNSHARDED_RANKS, list(ranks))
    return error


def unsharded_message(ranks: Sequence[int]) -> str:
    return (
        f"rank(s) {list(ranks)} ran a forward whose inputs were not sharded for sequence parallelism, so each rank "
        "would attend over a sequence stitched from unrelated rows; pass every batch through hf_ring.shard_batch "
        "(or hf_ring.prepare_trainer for transformers.Trainer) while sequence parallelism is set up, or call "
        "hf_ring.clear_sequence_parallel() to run whole sequences"
    )


def _disagreement(name: str, values: List[int]) -> str:
    if name == "batch contents":
        return ("the ranks of a sequence-parallel group passed different batches to hf_ring.shard_batch; every rank "
                "of a group must shard the same global batch (only data-parallel ranks differ)")
    if name == "dtype":
        names = [str(DTYPES[v]) if 0 <= v < len(DTYPES) else "?" for v in values]
        return f"the ranks of the ring disagree on dtype: {names} (by rank)"
    if name == "seq_len":
        return f"the ranks passed different seq_len values: {values} (by rank; -1 = None)"
    if name == "layout":
        return f"the ranks of the ring disagree on layout: {[LAYOUTS[v] for v in values]} (by rank)"
    return f"the ranks of the ring disagree on {name}: {values} (by rank)"


def global_length(table: Sequence[Facts], seq_len: Optional[int], layout: str, ulysses: int = 1) -> int:
    """The global length the ranks' row counts give (checked against ``seq_len`` when given)."""
    lens = [f.local_rows for f in table]
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


def check_seq_len(seq_len) -> Optional[int]:
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0):
        raise ValueError(f"seq_len must be a non-negative int or None, got {seq_len!r}")
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
            seq_len = check_seq_len(seq_len)
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
    return global_length(table, seq_len, opts.layout), any(f.padded_keys for f in table)


def full_key_mask(key_mask: Optional[Tensor], k: Tensor, any_padded: bool) -> Optional[Tensor]:
    """The key mask the ring carries: None when no rank is padded, all-True rows on an unpadded rank otherwise."""
    if not any_padded:
        return None  # an all-valid mask changes nothing; dropping it keeps the unmasked fast paths
    if key_mask is None:
        return torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
    return key_mask
