"""What a loss reads from a forward over shards as a whole: rows in global order, and one score per sequence.

Post-training losses are per sequence: DPO, KTO, GRPO and RLOO sum each
sequence's per-token log-probabilities, a reward model reads the score of each
row's last real token. Over shards every rank holds part of each sum and one
rank holds that token. Both are small (a number or a few per token, a few per
row), so every rank is given all of them in global order and computes the
loss of the whole batch, as one process would.

Autograd: every rank computes the same loss from what it was given, so the
gradient of a rank's own part is its slice of the gradient of the whole (no
exchange in the backward). The ranks' parameter gradients then add up over the
sequence-parallel group to the whole batch's, as a shard's share of a
token-averaged loss does (:func:`hf_ring.sync_gradients`, ``sp.loss_scale``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..engine.gathers import gather_for_one_loss
from ..engine.layout import in_global_order, shard_sizes
from .context import ShardedForward

Tensor = torch.Tensor


def gather_rows(tensor: Tensor, forward: ShardedForward, what: str) -> Tensor:
    """``tensor`` ``(B, rows, ...)``, this rank's rows of a forward over shards, as ``(B, seq_len, ...)`` in global
    order on every rank, for a loss every rank computes alike (differentiable, see the module docstring); a
    placeholder row is dropped."""
    if forward.comm is None or forward.world_size == 1:
        return tensor
    shape = (forward.seq_len, forward.world_size, forward.layout, forward.ulysses)
    own = tensor[:, : len(forward.rows(tensor.device))].movedim(1, 0)  # a placeholder row is nobody's
    padding = own.new_zeros((max(shard_sizes(*shape)) - len(own),) + own.shape[1:])
    every = gather_for_one_loss(forward.comm, torch.cat([own, padding]), what)
    return in_global_order(every, *shape).movedim(0, 1)


PER_TOKEN_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
"""The per-token fields of a fused LM head's output (TRL's ``FusedCausalLMOutput``: one value per next-token label)."""


def fused_output(output: Any, forward: ShardedForward, num_items: Optional[Any]) -> Any:
    """A fused LM head's output over shards as one process returns it: every per-token field in global order, its
    last row dropped unless the caller gave ``shift_labels`` (one process scores ``n - 1`` next tokens), the loss
    over the whole batch (``num_items``: the caller's count of label tokens, None: the label mask's)."""
    fields = {}
    for name in PER_TOKEN_OUTPUTS:
        value = getattr(output, name, None)
        if value is not None:
            value = gather_rows(value, forward, f"the per-token {name} of the sequence")
            fields[name] = value if forward.shift_given else value[:, :-1]
    if "log_probs" in fields:
        mask = fields.get("label_mask")
        count = num_items if num_items is not None else (
            mask.sum().clamp(min=1) if mask is not None else None)
        if count is not None:
            fields["loss"] = -fields["log_probs"].sum() / count
    for name, value in fields.items():
        output[name] = value
    return output


def is_fused_output(output: Any) -> bool:
    """Whether a model returned a fused LM head's per-token values (``log_probs`` beside ``label_mask``)."""
    return getattr(output, "log_probs", None) is not None and hasattr(output, "label_mask")


def last_real_rows(forward: ShardedForward, ids: Optional[Tensor], pad: Optional[int], batch: int) -> Tensor:
    """``(B,)``: the global row of each batch row's last token that is not ``pad``, as transformers' sequence
    classifiers pool (the last row when there is no pad token or no ``input_ids``; row 0 for an all-padding row);
    one small all-gather over the group."""
    device = ids.device if ids is not None else torch.device("cpu")
    if pad is None or ids is None:
        return torch.full((batch,), forward.seq_len - 1, dtype=torch.long, device=device)
    rows = forward.rows(device)
    real = ids[:, : len(rows)].ne(pad)
    mine = torch.where(real, rows.expand_as(real), torch.full_like(real, -1, dtype=torch.long))
    mine = mine.max(1).values if len(rows) else torch.full((batch,), -1, dtype=torch.long, device=device)
    every = mine[None] if forward.comm is None else forward.comm.all_gather(mine, "the last real token of each row")
    return every.max(0).values.clamp(min=0)


def pooled_scores(scores: Tensor, forward: ShardedForward, last: Tensor) -> Tensor:
    """``scores`` ``(B, rows, L)`` (a sequence classifier's head over this rank's rows) with every row holding the
    score of its batch row's token at global row ``last``: what the classifier pools, whichever row it picks."""
    rows = forward.rows(scores.device)
    hit = rows[None, :] == last[:, None].to(rows.device)
    picked = (scores[:, : len(rows)] * hit[..., None].to(scores.dtype)).sum(1, keepdim=True)  # (B, 1, L)
    summed = gather_for_one_loss(forward.comm, picked.contiguous(), "the score of each row's last real token").sum(0)
    return summed.expand(-1, scores.shape[1], -1)


def pool_over_shards(model: Any, forward: Any, kwargs: Any) -> None:
    """For a sequence classifier called with ``kwargs`` (sharded by ``forward``), make its head hand every row the
    score of its last real token, wherever that token lies (:func:`pooled_scores`), for this call only: the hooks
    remove themselves when the model's call ends. Nothing for other models. A collective: every rank of the group
    calls it for the same model."""
    head = scores_head(model)
    if head is None:
        return
    if not isinstance(forward, ShardedForward):
        forward.fail(ValueError(f"{type(model).__name__} pools a multimodal sequence, which hf_ring does not split; "
                                "run it in one process (hf_ring.clear_sequence_parallel())"))
    ids = kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    batch = (ids if ids is not None else embeds).shape[0]
    pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    last = last_real_rows(forward, ids, pad, batch)
    pooling = head.register_forward_hook(lambda module, args, scores: pooled_scores(scores, forward, last))

    def remove(*_):
        pooling.remove()
        ending.remove()

    ending = model.register_forward_hook(remove, always_call=True)


SEQUENCE_HEADS = ("ForSequenceClassification",)
UNSPLIT_HEADS = ("ForTokenClassification", "ForQuestionAnswering")


def head_problem(model: Any, pools: bool) -> Optional[str]:
    """Why ``model``'s head cannot read a split sequence, or None. ``pools``: its class pools the sequence as
    transformers' generic sequence classifier does (the score of each row's last real token), which hf_ring
    reproduces over shards."""
    name = type(model).__name__
    if name.endswith(UNSPLIT_HEADS):
        return (f"{name} reads one label or span per token of the whole sequence with a loss averaged over the tokens "
                "it is given, and its labels are not next-token targets (shard_batch shifts labels); hf_ring does not "
                "split it: run it in one process (hf_ring.clear_sequence_parallel())")
    if name.endswith(SEQUENCE_HEADS) and not pools:
        return (f"{name} pools its sequence by code of its own, which hf_ring does not reproduce over shards (it "
                "reproduces transformers' generic sequence classifier, as Llama, Mistral and Qwen use); run it in one "
                "process (hf_ring.clear_sequence_parallel())")
    return None


def scores_head(model: Any) -> Optional[torch.nn.Module]:
    """The head whose per-row scores a sequence classifier pools (``score``), None for any other model."""
    head = getattr(model, "score", None)
    return head if type(model).__name__.endswith(SEQUENCE_HEADS) and isinstance(head, torch.nn.Module) else None
