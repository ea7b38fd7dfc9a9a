"""Differentiable all-gathers, one per way the ranks read what they gathered, and ties that make every rank join an
exchange's backward.

Every rank gets every rank's tensor, stacked by rank. What its gradient is depends on how the ranks read it:

- :func:`gather`: each rank reads its own part of the whole (the end states it composes for its runs, the rows
  before its runs), so the gradient of a rank's tensor is the sum of what every rank's reading of it received
  (one all-reduce in the backward);
- :func:`gather_for_one_loss`: every rank computes the same loss from the whole (a batch's per-token values, each
  row's score), so each rank holds the whole's gradient already and the gradient of its tensor is its own slice
  (no exchange in the backward); the ranks' parameter gradients then add up over the group as a shard loss's do.

A collective's backward is a collective too, and every rank must join it: :func:`tied` makes a result depend on
an exchange without arithmetic, for a rank whose result does not read what the exchange brought.
"""
from __future__ import annotations

from typing import Optional

import torch

from .comm import RingComm

Tensor = torch.Tensor


class _Gather(torch.autograd.Function):
    """Every rank's tensor, stacked by rank; the gradient of this rank's tensor is the sum over the ranks of what
    their readings of it received."""

    @staticmethod
    def forward(ctx, tensor: Tensor, comm: RingComm, what: str) -> Tensor:
        ctx.comm, ctx.what = comm, what
        return comm.all_gather(tensor, what)

    @staticmethod
    def backward(ctx, grad: Tensor):
        summed = ctx.comm.all_reduce(grad.contiguous(), f"the gradients of {ctx.what}")
        return summed[ctx.comm.rank], None, None


class _GatherForOneLoss(torch.autograd.Function):
    """Every rank's tensor, stacked by rank; the gradient of this rank's tensor is its slice of the gradient of the
    whole, which every rank computes alike."""

    @staticmethod
    def forward(ctx, tensor: Tensor, comm: RingComm, what: str) -> Tensor:
        ctx.rank = comm.rank
        flag = tensor.dtype == torch.bool  # gloo gathers no booleans
        every = comm.all_gather(tensor.to(torch.uint8) if flag else tensor, what)
        return every.to(tensor.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.rank], None, None


class _Tie(torch.autograd.Function):
    """``tensor`` unchanged, with ``others`` among its inputs: their backward runs whenever the tensor's does."""

    @staticmethod
    def forward(ctx, tensor: Tensor, *others: Tensor) -> Tensor:
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (grad,) + tuple(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes)


def tied(tensor: Tensor, *others: Tensor) -> Tensor:
    """``tensor``, made to depend on ``others`` in autograd (without arithmetic, so no value of theirs can leak in).

    A rank whose result happens not to read what an exchange brought (the rank holding the sequence's first rows)
    ties it in anyway, and a rank whose contribution needs no gradient (a placeholder row) ties it to an input that
    does, so every rank joins the exchange's backward.
    """
    others = tuple(o for o in others if o.requires_grad)
    return _Tie.apply(tensor, *others) if others and torch.is_grad_enabled() else tensor


def gather(comm: Optional[RingComm], tensor: Tensor, what: str, anchor: Optional[Tensor] = None) -> Tensor:
    """``(world size, *tensor.shape)``: every rank's ``tensor``, each rank reading its own part of it (see the module
    docstring); ``comm`` None: this process's.

    ``anchor``: an input of the caller's that needs a gradient on every rank alike (see :func:`tied`); the caller
    ties the result into what it returns.
    """
    if anchor is not None:
        tensor = tied(tensor, anchor)
    if comm is None or comm.world_size == 1:
        return tensor[None]
    return _Gather.apply(tensor, comm, what)


def gather_for_one_loss(comm: Optional[RingComm], tensor: Tensor, what: str) -> Tensor:
    """``(world size, *tensor.shape)``: every rank's ``tensor``, for a loss every rank computes alike from the whole
    (see the module docstring); ``comm`` None: this process's."""
    if comm is None or comm.world_size == 1:
        return tensor[None]
    return _GatherForOneLoss.apply(tensor, comm, what)
