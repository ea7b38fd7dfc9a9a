"""Checkpointed layer inputs kept in host memory between the forward and the backward.

With gradient checkpointing, what a training step keeps per layer until the
backward is the layer's input: one ``(B, S_local, hidden)`` tensor per layer,
the largest per-token cost left once attention is a ring and the loss, MLP
and norms are tiled. :func:`offload_checkpoints` moves each of those inputs
to host memory as the layer's forward finishes (pinned memory, an
asynchronous copy on the current stream, so the device memory is reused by
the next layer at once) and brings it back when the backward recomputes that
layer. This is how published stacks fit sequences of hundreds of thousands of
tokens on one 80 GB GPU; the arithmetic is the same, so losses and gradients
are exactly those of plain checkpointing.

The layers are checkpointed with torch's reentrant checkpoint, whose saved
inputs go through saved-tensor hooks (the non-reentrant one keeps them by
reference, out of the hooks' reach); nothing else is saved inside it.
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from ..integration.seams import CHECKPOINTING_METHOD

Tensor = torch.Tensor

ATTR = "_gradient_checkpointing_func"
"""Where transformers' checkpointed layers keep the function that checkpoints them."""


def _pack(t: Tensor) -> Tuple[torch.device, Tensor]:
    """A host copy of ``t`` (pinned when a GPU can read it directly), started asynchronously."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=t.is_cuda)
    return t.device, host


def _unpack(packed: Tuple[torch.device, Tensor]) -> Tensor:
    device, host = packed
    return host.to(device, non_blocking=device.type == "cuda")


class OffloadedCheckpoint:
    """A layer's checkpoint function whose saved inputs wait in host memory (see the module notes)."""

    def __call__(self, function: Callable, *args: Any) -> Any:
        if torch.is_grad_enabled() and not any(isinstance(a, Tensor) and a.requires_grad for a in args):
            # The reentrant checkpoint only gives the layer's parameters gradients through an input that needs one
            # (frozen embeddings under LoRA): let the first tensor input ask for one, as transformers does for PEFT.
            first = next(i for i, a in enumerate(args) if isinstance(a, Tensor))
            args = args[:first] + (args[first].detach().requires_grad_(),) + args[first + 1:]
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            return checkpoint(function, *args, use_reentrant=True)


def offload_checkpoints(model: torch.nn.Module, enable: bool = True) -> int:
    """Keep the inputs of ``model``'s checkpointed layers in host memory until the backward (``enable=False``: undo).

    Call it after ``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before
    transformers 5.23; re-enabling
    checkpointing resets it). Returns the number of layers changed; a model
    without checkpointing on is refused, since there would be nothing to offload.
    """
    layers = [m for m in model.modules()
              if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and hasattr(m, ATTR)]
    if not layers:
        raise ValueError(
            f"offload_checkpoints needs gradient checkpointing on: call model.{CHECKPOINTING_METHOD}() "
            "first (it keeps each layer's input, which is what is offloaded)"
        )
    for layer in layers:
        current = getattr(layer, ATTR)
        if enable and not isinstance(current, OffloadedCheckpoint):
            layer._hf_ring_checkpoint = current  # what to restore on enable=False
            setattr(layer, ATTR, OffloadedCheckpoint())
        elif not enable and isinstance(current, OffloadedCheckpoint):
            setattr(layer, ATTR, layer.__dict__.pop("_hf_ring_checkpoint"))
    return len(layers)
