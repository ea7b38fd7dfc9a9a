"""Causal-LM loss over a long shard without a (rows x vocab) logits tensor.

The lm_head and the cross-entropy run over chunks of rows. When gradients
are wanted the forward turns each chunk's logits into that chunk's gradients
at once (the unit-gradient case; the backward scales them). So at most one
chunk of logits (and its softmax) lives at any time, and what is kept for the
backward is the gradient of the hidden states and of the weight, in place of
the hidden states the backward would otherwise recompute the logits from.

The numbers are those of transformers' ``ForCausalLMLoss`` on the full logits:
logits computed in the model dtype and upcast to fp32, an optional Gemma-style
final soft cap, ``ignore_index`` targets left out, the sum divided by
``num_items_in_batch`` when given and by the count of counted targets otherwise.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from hf_ring.engine.arguments import positive_int

IGNORE_INDEX = -100
LOSS_CHUNK_ELEMENTS = 1 << 25
"""Default budget of one chunk of fp32 logits (128 MiB); rows per chunk = this // vocab."""


def chunk_rows_for(vocab: int, chunk_rows: Optional[int] = None) -> int:
    """Rows per chunk: ``chunk_rows`` if given, else the default logits budget over ``vocab`` (at least 1)."""
    if chunk_rows is None:
        return max(1, LOSS_CHUNK_ELEMENTS // max(vocab, 1))
    return positive_int(chunk_rows, "loss chunk_rows")


def shifted_targets(labels: Optional[torch.Tensor], shift_labels: Optional[torch.Tensor],
                    ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The target of every row: ``shift_labels`` as given, else ``labels`` shifted left by one within the tensor."""
    if shift_labels is not None:
        return shift_labels
    if labels is None:
        raise ValueError("the causal-LM loss needs labels or shift_labels")
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  softcap: Optional[float]):
    """fp32 logits of a chunk (as the untiled model makes them) and, under a soft cap, d(capped)/d(raw)."""
    logits = F.linear(h, weight, bias).float()
    if softcap is None:
        return logits, None
    t = torch.tanh(logits / softcap)
    return t * softcap, 1.0 - t * t


def _chunk_loss_and_grad(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], t: torch.Tensor,
                         ignore_index: int, softcap: Optional[float], with_grad: bool, divisor: torch.Tensor):
    """Summed cross-entropy of one chunk and, with ``with_grad``, d(sum / divisor)/d(logits) in ``h.dtype``."""
    logits, dcap = _chunk_logits(h, weight, bias, softcap)
    counted = t != ignore_index
    rows = counted.nonzero().squeeze(1)
    lse = torch.logsumexp(logits, dim=-1)
    total = (lse[rows] - logits[rows, t[rows]]).sum()
    if not with_grad:
        return total, None
    # softmax - onehot on counted rows, 0 on ignored ones, built in the logits' own buffer.
    g = logits.sub_(lse.unsqueeze(1)).exp_()
    del logits
    g[rows, t[rows]] -= 1.0
    # Ignored rows get exactly 0, also when nothing in the batch is counted (divisor 0): transformers' loss then
    # is NaN with zero gradients, and so is this one.
    g.mul_(torch.where(counted, divisor.reciprocal(), 0.0).unsqueeze(1))
    if dcap is not None:
        g.mul_(dcap)
    return total, g.to(h.dtype)


class _TiledLoss(torch.autograd.Function):
    """Loss and gradients in one pass over the chunks.

    Each chunk's logits are made once: the forward turns them into the loss
    and, when a gradient will be wanted, at once into the gradients of the
    hidden states and the weight for a unit output gradient, which the
    backward hands on as they are (or scaled by any other output gradient).
    The three matrix products (logits, d hidden, d weight) then run once each,
    where recomputing in the backward would run the logits product twice.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, chunk, ignore_index, softcap, grad_enabled):
        # needs_input_grad does not see torch.no_grad() (an evaluation loss): the caller's mode says it.
        need_h, need_w, need_b = (need and grad_enabled for need in ctx.needs_input_grad[:3])
        with_grad = need_h or need_w or need_b
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            part, g = _chunk_loss_and_grad(h, weight, bias, targets[s:s + chunk], ignore_index, softcap,
                                           with_grad, divisor)
            total += part
            if g is None:
                continue
            if need_h:
                torch.mm(g, weight, out=grad_h[s:s + chunk])
            if need_w:
                grad_w.addmm_(g.t().float(), h.float())
            if need_b:
                grad_b += g.float().sum(0)
            del g
        ctx.save_for_backward(grad_h, grad_w, grad_b, divisor)
        ctx.dtypes = weight.dtype, None if bias is None else bias.dtype
        return total / divisor

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b, divisor = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        if bool(grad_loss == 1):  # the usual case: no second rows-sized tensor for a scaled copy
            return (grad_h, None if grad_w is None else grad_w.to(w_dtype),
                    None if grad_b is None else grad_b.to(b_dtype), None, None, None, None, None, None)
        scale = grad_loss.float()
        return (None if grad_h is None else grad_h * scale.to(grad_h.dtype),
                None if grad_w is None else (grad_w * scale).to(w_dtype),
                None if grad_b is None else (grad_b * scale).to(b_dtype), None, None, None, None, None, None)


@torch.compiler.disable  # an autograd Function that decides on the host how to scale its gradient
def tiled_causal_lm_loss(hidden_states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                         labels: Optional[torch.Tensor] = None, shift_labels: Optional[torch.Tensor] = None,
                         num_items_in_batch: Union[int, torch.Tensor, None] = None,
                         ignore_index: int = IGNORE_INDEX, softcap: Optional[float] = None,
                         chunk_rows: Optional[int] = None) -> torch.Tensor:
    """The causal-LM loss of ``lm_head(hidden_states)`` computed ``chunk_rows`` rows at a time.

    ``hidden_states`` is ``(..., rows, hidden)``; ``labels``/``shift_labels`` are
    ``(..., rows)``. Equal to transformers' ``ForCausalLMLoss`` on the full
    logits, in value and gradients, for any chunk size.
    """
    if hidden_states.dim() < 2:
        raise ValueError(f"hidden_states must be (..., rows, hidden), got shape {tuple(hidden_states.shape)}")
    targets = shifted_targets(labels, shift_labels, ignore_index)
    if tuple(targets.shape) != tuple(hidden_states.shape[:-1]):
        name = "shift_labels" if shift_labels is not None else "labels"
        raise ValueError(f"{name} of shape {tuple(targets.shape)} does not match the hidden states' rows "
                         f"{tuple(hidden_states.shape[:-1])}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    if num_items_in_batch is None:
        divisor = (targets != ignore_index).sum().float()
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    chunk = chunk_rows_for(weight.shape[0], chunk_rows)
    return _TiledLoss.apply(hidden, weight, bias, targets, divisor, chunk, ignore_index, softcap,
                            torch.is_grad_enabled())
