"""Split a batch along the sequence for the ranks of a sequence-parallel group, and put outputs back.

Labels are shifted on the *global* sequence before sharding, so the last
token of a shard keeps its target (the model's own loss would shift inside
each shard and lose it). The loss each rank computes is its shard's share of
the sequence loss: summed over the sp group it is the global loss.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from ..engine.balance import CAUSAL, Work, plan_documents
from ..engine.comm import all_gather, device_for
from ..engine.documents import VARLEN_KEYS, Documents, documents_of_call, left_padding
from ..engine.fingerprint import fingerprint
from ..engine.layout import Layout, in_global_order, local_positions, shard_sizes
from ..engine.relay import fail_together
from ..integration.context import CONTEXT_KEY, ShardedForward
from ..integration.groups import SequenceParallel, current
from ..entry.media import LOSS_INPUTS, MEDIA_INPUTS, MediaForward, four_axes, has_media

IGNORE_INDEX = -100

PLACEHOLDER_ROWS = 1
"""Rows the model runs on a rank that holds none of the sequence (see :func:`shard_batch`)."""


def _sp(sp: Optional[SequenceParallel]):
    sp = sp or current()
    if sp is None or sp.sp_group is None:
        return None
    return sp


def _documents(batch: Mapping[str, Any], positions: Optional[torch.Tensor], b: int, n: int) -> Optional[Documents]:
    """The documents packed into the rows, or None when every row is one sequence (as transformers decides: see
    :func:`hf_ring.engine.documents.documents_of_call`)."""
    return documents_of_call(b, n, positions, batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k"),
                             masked=batch.get("attention_mask") is not None, seq_idx=batch.get("seq_idx"))


def batch_layout(layout: Layout, documents: Optional[Documents], seq_len: int, groups: int,
                 work: Work = CAUSAL) -> Layout:
    """The layout a batch is split by: for ``balanced``, a plan from the documents its rows share, weighed by
    ``work`` (zigzag when every row is one document, or when its rows hold different documents: one plan splits
    every row); any other layout as it is."""
    if layout != "balanced" or documents is None or groups == 1 or len(set(documents)) != 1:
        return layout
    return plan_documents(seq_len, documents[0], groups, work)


def _shifted_labels(batch: Mapping[str, Any], labels: torch.Tensor, documents: Optional[Documents]) -> torch.Tensor:
    """Next-token targets of the global rows; never across a document border."""
    shifted = batch.get("shift_labels")
    if shifted is None:
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
    elif tuple(shifted.shape) != tuple(labels.shape):
        raise ValueError(f"shift_labels must have the shape of labels {tuple(labels.shape)}, got {tuple(shifted.shape)}")
    else:
        shifted = shifted.clone()
    for row, starts in enumerate(documents or ()):
        ends = torch.tensor([s - 1 for s in starts[1:]], dtype=torch.long, device=shifted.device)
        shifted[row, ends] = IGNORE_INDEX  # the last token of a document predicts nothing of the next
    return shifted


PER_TOKEN = ("input_ids", "inputs_embeds", "labels", "attention_mask", "position_ids", "shift_labels",
             "token_type_ids", "completion_mask", "assistant_masks")
"""Per-token inputs a model forward (or a trainer's loss) takes: split along the sequence like the tokens."""


def batch_shape(batch: Mapping[str, Any]) -> Tuple[int, int]:
    """``(batch size, sequence length)`` of a global batch, from ``input_ids`` or ``inputs_embeds``."""
    ids, embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    if (ids is None) == (embeds is None):
        raise ValueError("shard_batch needs exactly one of 'input_ids' (batch, seq_len) and 'inputs_embeds' "
                         "(batch, seq_len, hidden), as the model's forward does")
    if ids is not None and (not isinstance(ids, torch.Tensor) or ids.dim() != 2):
        raise ValueError(f"input_ids must be a 2-D tensor (batch, seq_len), got {getattr(ids, 'shape', type(ids))}")
    if embeds is not None and (not isinstance(embeds, torch.Tensor) or embeds.dim() != 3
                               or not embeds.is_floating_point()):
        raise ValueError("inputs_embeds must be a 3-D floating-point tensor (batch, seq_len, hidden), got "
                         f"{getattr(embeds, 'shape', type(embeds))}")
    shape = (ids if ids is not None else embeds).shape
    return shape[0], shape[1]


PACKED_MROPE = ("position_ids of three axes restart inside a row: packed rows of a model with mRoPE positions "
                "(Qwen2.5-VL, Qwen3-VL) need the four-axis form, each document's text positions first "
                "(position_ids of shape (4, batch, seq_len)), so that the documents can be told apart; or give one "
                "document per row, padded (attention_mask)")


def row_labels(labels: Any, b: int, n: int) -> bool:
    """Whether ``labels`` hold one label per row (a sequence classifier's: ``(batch,)``, or floating
    ``(batch, num_labels)`` for several labels per row) rather than one next-token target per token."""
    if not isinstance(labels, torch.Tensor) or labels.shape[:1] != (b,):
        return False
    return labels.dim() == 1 or (labels.dim() == 2 and labels.is_floating_point())


def _text_positions(positions: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The (batch, seq_len) positions documents are read from: 2-D position ids, or the text positions that lead
    mRoPE's four-axis form (a multimodal batch's three-axis form holds no document borders)."""
    if positions is None or positions.dim() == 2:
        return positions
    return positions[0] if four_axes(positions) else None


def _check_batch(batch: Any) -> None:
    """Every local check of a batch given to :func:`shard_batch`."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping such as a dict, got {type(batch).__name__}")
    if CONTEXT_KEY in batch:
        raise ValueError(f"this batch is already sharded (it carries {CONTEXT_KEY!r}); shard the global batch once")
    b, n = batch_shape(batch)
    media = has_media(batch)
    for key in PER_TOKEN[2:] + ("mm_token_type_ids",):
        t = batch.get(key)
        if key == "labels" and row_labels(t, b, n):
            continue
        if key == "position_ids" and media and isinstance(t, torch.Tensor) and t.dim() == 3:
            shape = (t.shape[0], b, n)  # mRoPE's axes first
        else:
            shape = (b, n)
        if key == "attention_mask" and isinstance(t, torch.Tensor) and t.dim() == 4:
            raise ValueError(f"attention_mask of shape {tuple(t.shape)} is a 4-D mask of every query against every "
                             "key, which shard_batch does not split; pass the 2-D padding mask (batch, seq_len), and "
                             "position_ids restarting at each document for packed rows, or run the model in one "
                             "process, where ring_dilated computes a 4-D mask as sdpa does")
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape):
            raise ValueError(f"{key} must have the shape (batch, seq_len) = {(b, n)}, got "
                             f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
        if key == "position_ids" and t is not None and t.dim() == 3 and not four_axes(t) \
                and bool((t[0].diff(dim=-1) < 0).any()):
            raise ValueError(PACKED_MROPE)
    known = PER_TOKEN + VARLEN_KEYS + (MEDIA_INPUTS if media else ())
    for key, t in batch.items():
        if key not in known and isinstance(t, torch.Tensor) and t.dim() >= 2 \
                and tuple(t.shape[:2]) == (b, n):
            raise ValueError(
                f"shard_batch does not know whether {key!r} (shape {tuple(t.shape)}) holds one entry per token; "
                f"it splits only {', '.join(PER_TOKEN)} along the sequence. Drop {key!r} from the batch, or split "
                "it with hf_ring.local_positions yourself after sharding"
            )


def _tp_mismatch(group: Optional[SequenceParallel], batch: Any) -> Optional[ValueError]:
    """The error to raise when the ranks of this rank's tensor-parallel group were given different batches.

    Tensor parallelism splits one batch's computation over those ranks, so a
    different batch on one of them gives wrong results with nothing raised.
    The fingerprints travel over the tp group before any check can raise (a
    malformed batch counts as -1), so its ranks always meet; the error is
    raised inside the sp group's batch check, so every rank of both groups raises.
    """
    if group is None or group.tp_size == 1:
        return None
    try:
        ids = batch.get("input_ids")
        batch_shape(batch)
        mine = fingerprint(ids if ids is not None else batch["inputs_embeds"])
    except (AttributeError, TypeError, ValueError):  # refused by the batch check right after
        mine = -1
    device = device_for(group.tp_group)
    seen = all_gather(torch.tensor([mine], dtype=torch.long, device=device), group.tp_group,
                           "the batch check over the tensor-parallel group").reshape(-1).tolist()
    if len(set(seen)) == 1:
        return None
    return ValueError(
        f"the ranks of a tensor-parallel group passed different batches to hf_ring.shard_batch (fingerprints {seen} "
        "by tp rank); they split one batch's computation, so every rank of a data-parallel replica (its sp and tp "
        "ranks) must pass the same global batch, only dp ranks differ"
    )


def shard_batch(batch: Mapping[str, Any], sp: Optional[SequenceParallel] = None) -> Dict[str, Any]:
    """This rank's part of ``batch``: ``input_ids`` or ``inputs_embeds`` and every per-token input (:data:`PER_TOKEN`).

    Adds global ``position_ids``, globally shifted ``shift_labels`` and the
    global ``num_items_in_batch`` when labels are given, and ``ring_context``:
    the facts of this forward that every attention layer reads (global
    length, padding, documents, the group), so the ranks agree on them once
    per forward. Any length works, including one shorter than the number of
    ranks: a rank that holds no row gets one placeholder row (a copy of row 0
    with no label), which the attention leaves out of the ring (no query sees
    it) and whose output is zero; :func:`gather_sequence` drops it. Packed rows (``position_ids`` restarting inside a row and no
    ``attention_mask``, or ``cu_seq_lens_q``, as ``DataCollatorWithFlattening``
    makes them) keep their documents apart: attention never crosses a
    document border, and neither do the shifted labels. ``labels`` of one per row
    (a sequence classifier's: ``(batch,)``, or floating ``(batch, num_labels)``)
    are given to every rank whole and not shifted; the classifier's score of
    each row's last real token reaches every rank (:mod:`hf_ring.integration.readout`).

    A multimodal batch (``pixel_values`` or ``pixel_values_videos``, from a
    vision-language processor) is handed to the model whole but for its loss
    inputs: the towers encode whole images, and the sequence is split where the
    model's language model starts, after the image features are merged
    (:mod:`hf_ring.entry.media`). Llava, Mistral 3, Qwen2.5-VL, Qwen3-VL
    and Gemma 3 are tested; another multimodal family is refused at its call.
    """
    group = _sp(sp)
    documents = shifted = None
    by_row = False
    tp_mismatch = _tp_mismatch(group, batch)
    # One small exchange after the checks, so a bad batch on one rank fails every rank of the group.
    with fail_together(None if group is None else group.comm, "the batch check of shard_batch"):
        _check_batch(batch)
        if tp_mismatch is not None:
            raise tp_mismatch
        b, n = batch_shape(batch)
        documents = _documents(batch, _text_positions(batch.get("position_ids")), b, n)
        by_row = row_labels(batch.get("labels"), b, n)
        if batch.get("labels") is not None and not by_row:
            shifted = _shifted_labels(batch, batch["labels"], documents)
        elif batch.get("shift_labels") is not None:
            raise ValueError("shift_labels without labels: pass labels (shard_batch shifts them on the global rows)"
                             if not by_row else "shift_labels beside one label per row: a sequence classifier's "
                             "labels are not next-token targets; drop shift_labels")
    ids = batch.get("input_ids")
    tokens = ids if ids is not None else batch["inputs_embeds"]
    b, n = tokens.shape[:2]
    rank, size, layout, ulysses = ((0, 1, "contiguous", 1) if group is None else
                                   (group.sp_rank, group.sp_size, group.layout, group.ulysses_size))
    layout = batch_layout(layout, documents, n, size // ulysses, CAUSAL if group is None else group.work)
    pos = local_positions(n, rank, size, layout, ulysses).to(tokens.device)
    placeholder = pos.numel() == 0 and n > 0
    if placeholder:  # model code cannot run on zero rows: one row that nothing sees and no loss reads
        pos = torch.zeros(PLACEHOLDER_ROWS, dtype=torch.long, device=tokens.device)

    media = has_media(batch)
    out: Dict[str, Any] = {k: v for k, v in batch.items() if k not in PER_TOKEN + VARLEN_KEYS}
    split_now = LOSS_INPUTS[2:] if media else ("input_ids", "inputs_embeds", "attention_mask", "token_type_ids",
                                                "completion_mask", "assistant_masks")
    for key in split_now:
        if batch.get(key) is not None:
            out[key] = batch[key][:, pos]
    mask = batch.get("attention_mask")
    positions = batch.get("position_ids")
    if media:  # the model's own inputs stay whole: its language model's call is split (entry.media)
        out.update({k: batch[k] for k in ("input_ids", "inputs_embeds", "attention_mask", "token_type_ids",
                                          "position_ids") if batch.get(k) is not None})
    else:
        if positions is None:
            positions = torch.arange(n, device=tokens.device).expand(b, n)
        out["position_ids"] = positions[:, pos]
    if by_row:  # read by a loss over the whole batch, which every rank computes (see integration.readout)
        out["labels"] = batch["labels"]
    if shifted is not None:
        out["labels"] = batch["labels"][:, pos]
        out["shift_labels"] = shifted[:, pos]
        out["num_items_in_batch"] = int((shifted != IGNORE_INDEX).sum())
        if placeholder:
            out["labels"] = torch.full_like(out["labels"], IGNORE_INDEX)
            out["shift_labels"] = torch.full_like(out["shift_labels"], IGNORE_INDEX)
    forward = ShardedForward.over(
        group, n, layout, padded=mask is not None and not bool(mask.all()), left_padding=left_padding(mask),
        positions=_text_positions(positions), positions_given=batch.get("position_ids") is not None,
        shift_given=batch.get("shift_labels") is not None,
        contents=0 if group is None else (
            fingerprint(tokens, documents)),
        documents=documents,
        placeholder=placeholder,
    )
    out[CONTEXT_KEY] = MediaForward(forward, pos) if media else forward
    out.setdefault("use_cache", False)  # a KV cache of a training shard is never read
    return out


def layout_of(batch: Mapping[str, Any], sp: Optional[SequenceParallel] = None) -> Layout:
    """The layout :func:`shard_batch` splits the global ``batch`` by: the setup's, or under ``balanced`` the plan
    chosen from the batch's documents (for :func:`gather_sequence` and :func:`model_rows`)."""
    group = _sp(sp)
    if group is None:
        return "contiguous"
    b, n = batch_shape(batch)
    documents = _documents(batch, _text_positions(batch.get("position_ids")), b, n)
    return batch_layout(group.layout, documents, n, group.sp_size // group.ulysses_size, group.work)


def _given_layout(group: SequenceParallel, layout: Optional[Layout], what: str) -> Layout:
    if layout is not None:
        return layout
    if group.layout == "balanced":
        raise ValueError(f"{what} under layout='balanced' needs the batch's layout, chosen from its documents: pass "
                         "layout=hf_ring.layout_of(batch) (the global batch given to shard_batch)")
    return group.layout


def model_rows(seq_len: int, sp: Optional[SequenceParallel] = None, layout: Optional[Layout] = None) -> int:
    """Rows the model runs on this rank for a global length: its shard, or the placeholder row of an empty one
    (``layout``: the batch's, :func:`layout_of`; needed under ``balanced``)."""
    group = _sp(sp)
    if group is None:
        return seq_len
    layout = _given_layout(group, layout, "model_rows")
    rows = len(local_positions(seq_len, group.sp_rank, group.sp_size, layout, group.ulysses_size))
    return PLACEHOLDER_ROWS if rows == 0 and seq_len > 0 else rows


def gather_sequence(tensor: torch.Tensor, seq_len: int, dim: int = 1,
                    sp: Optional[SequenceParallel] = None, layout: Optional[Layout] = None) -> torch.Tensor:
    """Reassemble a tensor sharded along ``dim`` by :func:`shard_batch` into global order (every rank gets it).

    Meant for outputs such as logits in evaluation: the result has the global length. ``layout``: the batch's
    (:func:`layout_of`), needed under ``layout="balanced"``, where each batch has its own.
    """
    group = _sp(sp)
    if group is None:
        return tensor
    layout = _given_layout(group, layout, "gather_sequence")
    moved = tensor.movedim(dim, 0).contiguous()
    sizes = shard_sizes(seq_len, group.sp_size, layout, group.ulysses_size)
    if sizes[group.sp_rank] == 0 and moved.shape[0] == PLACEHOLDER_ROWS:
        moved = moved[:0]  # the placeholder row of a rank that holds none of the sequence
    if moved.shape[0] != sizes[group.sp_rank]:
        raise ValueError(
            f"this rank holds {moved.shape[0]} rows along dim {dim}, but seq_len={seq_len} gives it {sizes[group.sp_rank]}"
        )
    padded = moved.new_zeros((max(sizes),) + moved.shape[1:])
    padded[: moved.shape[0]] = moved
    parts = all_gather(padded, group.sp_group, "the sequence gather")
    return in_global_order(parts, seq_len, group.sp_size, layout, group.ulysses_size).movedim(0, dim)
