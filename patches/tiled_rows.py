"""A row-wise module (an MLP, a norm) run over chunks of rows, its activations recomputed in the backward.

The forward writes each chunk's output into one preallocated tensor without
recording a graph; only the input is saved. The backward recomputes one chunk
at a time with the same random state and backpropagates it, so the module's
intermediate activations (for an MLP, several tensors of ``intermediate_size``
per row) exist for one chunk only. The result equals running the module on
all rows whenever the module treats rows independently.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, List, Optional, Sequence

import torch

from hf_ring.engine.arguments import positive_int

ROW_CHUNK_ROWS = 8192
"""Default rows per chunk."""


def zero3_partitioned(params: Iterable[Any]) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions any of these parameters (it marks each with a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in params)


def _rng_devices(x: torch.Tensor) -> List[int]:
    return [x.device.index if x.device.index is not None else torch.cuda.current_device()] if x.is_cuda else []


@contextmanager
def _replayed_rng(ctx, x: torch.Tensor):
    """The random state of the forward, restored for the recomputation and dropped after it."""
    with torch.random.fork_rng(devices=_rng_devices(x)):
        torch.set_rng_state(ctx.rng[0])
        if ctx.rng[1] is not None:
            torch.cuda.set_rng_state(ctx.rng[1], x.device)
        yield


class _TiledRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunk, x, *params):
        # The parameters are inputs so that autograd routes their gradients; fn
        # reads them itself, so they are kept on ctx rather than saved.
        ctx.fn, ctx.chunk, ctx.params = fn, chunk, params
        ctx.rng = torch.get_rng_state(), (torch.cuda.get_rng_state(x.device) if x.is_cuda else None)
        flat = x.reshape(-1, x.shape[-1])
        out = None
        for s in range(0, flat.shape[0], chunk):
            y = fn(flat[s:s + chunk])
            if out is None:
                out = y.new_empty((flat.shape[0],) + tuple(y.shape[1:]))
            out[s:s + chunk] = y
            del y
        ctx.save_for_backward(x)
        ctx.out_tail = tuple(out.shape[1:])
        return out.reshape(tuple(x.shape[:-1]) + ctx.out_tail)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        params = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        flat = x.reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape((flat.shape[0],) + ctx.out_tail)
        grad_x = torch.empty_like(flat) if ctx.needs_input_grad[2] else None
        grads: List[Optional[torch.Tensor]] = [None] * len(params)
        with _replayed_rng(ctx, x):
            for s in range(0, flat.shape[0], ctx.chunk):
                xc = flat[s:s + ctx.chunk].detach().requires_grad_(grad_x is not None)
                with torch.enable_grad():
                    y = ctx.fn(xc)
                inputs = ([xc] if grad_x is not None else []) + params
                got = torch.autograd.grad(y, inputs, grad_flat[s:s + ctx.chunk], allow_unused=True)
                del y
                if grad_x is not None:
                    grad_x[s:s + ctx.chunk] = got[0]
                    got = got[1:]
                for i, g in enumerate(got):
                    if g is not None:
                        grads[i] = g if grads[i] is None else grads[i].add_(g)
        it = iter(grads)
        param_grads = [next(it) if need else None for need in ctx.needs_input_grad[3:]]
        return (None, None, None if grad_x is None else grad_x.view_as(x), *param_grads)


class _TiledRowsZero3(torch.autograd.Function):
    """:class:`_TiledRows` for parameters DeepSpeed ZeRO-3 partitions (see :func:`tiled_rows`)."""

    @staticmethod
    def forward(ctx, fn, chunk, x, params):
        return _TiledRows.forward(ctx, fn, chunk, x, *params)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        params = [p for p in ctx.params if p.requires_grad]
        flat = x.reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape((flat.shape[0],) + ctx.out_tail)
        grad_x = torch.empty_like(flat) if ctx.needs_input_grad[2] else None
        starts = range(0, flat.shape[0], ctx.chunk)
        try:
            with _replayed_rng(ctx, x):
                for s in starts:
                    for p in params:  # ZeRO-3 reduces a parameter's gradient once, after the last chunk added to it
                        p.ds_grad_is_ready = s == starts[-1]
                    xc = flat[s:s + ctx.chunk].detach().requires_grad_(grad_x is not None)
                    with torch.enable_grad():
                        y = ctx.fn(xc)
                    if y.requires_grad:
                        torch.autograd.backward(y, grad_flat[s:s + ctx.chunk])
                    if grad_x is not None:
                        grad_x[s:s + ctx.chunk] = 0 if xc.grad is None else xc.grad
        finally:
            for p in params:
                p.ds_grad_is_ready = True
        return None, None, None if grad_x is None else grad_x.view_as(x), None


@torch.compiler.disable  # an autograd Function that recomputes its chunks in the backward
def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor],
               chunk_rows: Optional[int] = None) -> torch.Tensor:
    """``fn(x)`` computed ``chunk_rows`` rows of ``x`` at a time (all leading dims flattened into rows).

    ``params`` are the tensors ``fn`` reads that may need gradients (a module's
    parameters). Exact when ``fn`` acts on each row alone; random draws inside
    ``fn`` (dropout) repeat identically in the recomputation.
    """
    chunk = ROW_CHUNK_ROWS if chunk_rows is None else chunk_rows
    positive_int(chunk, "chunk_rows")
    if x.dim() < 2 or x[..., 0].numel() <= chunk:
        return fn(x)
    if zero3_partitioned(params):
        # ZeRO-3 gathers a module's parameters only around its calls and checks their gradients against the
        # partitioned shapes, so they cannot be inputs whose gradients the backward returns: the backward adds
        # them up in place, chunk by chunk, as DeepSpeed's own tiled MLP does.
        return _TiledRowsZero3.apply(fn, chunk, x, list(params))
    return _TiledRows.apply(fn, chunk, x, *params)
