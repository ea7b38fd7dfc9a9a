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


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _TiledRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunk, inputs, *tensors):
        # ``tensors``: the ``inputs`` row-aligned inputs, then the parameters. The parameters are inputs so that
        # autograd routes their gradients; fn reads them itself, so they are kept on ctx rather than saved.
        rows, params = tensors[:inputs], tensors[inputs:]
        ctx.fn, ctx.chunk, ctx.inputs, ctx.params = fn, chunk, inputs, params
        x = rows[0]
        ctx.rng = torch.get_rng_state(), (torch.cuda.get_rng_state(x.device) if x.is_cuda else None)
        flats = [_flat(t) for t in rows]
        out = None
        for s in range(0, flats[0].shape[0], chunk):
            y = fn(*(f[s:s + chunk] for f in flats))
            if out is None:
                out = y.new_empty((flats[0].shape[0],) + tuple(y.shape[1:]))
            out[s:s + chunk] = y
            del y
        ctx.save_for_backward(*rows)
        ctx.out_tail = tuple(out.shape[1:])
        return out.reshape(tuple(x.shape[:-1]) + ctx.out_tail)

    @staticmethod
    def backward(ctx, grad_out):
        rows = ctx.saved_tensors
        needs_rows, needs_params = ctx.needs_input_grad[3:3 + ctx.inputs], ctx.needs_input_grad[3 + ctx.inputs:]
        params = [p for p, need in zip(ctx.params, needs_params) if need]
        flats = [_flat(t) for t in rows]
        grad_flat = grad_out.reshape((flats[0].shape[0],) + ctx.out_tail)
        grad_rows = [torch.empty_like(f) if need else None for f, need in zip(flats, needs_rows)]
        grads: List[Optional[torch.Tensor]] = [None] * len(params)
        with _replayed_rng(ctx, rows[0]):
            for s in range(0, flats[0].shape[0], ctx.chunk):
                chunks = [f[s:s + ctx.chunk].detach().requires_grad_(need) for f, need in zip(flats, needs_rows)]
                with torch.enable_grad():
                    y = ctx.fn(*chunks)
                wanted = [c for c, need in zip(chunks, needs_rows) if need]
                got = torch.autograd.grad(y, wanted + params, grad_flat[s:s + ctx.chunk], allow_unused=True)
                del y
                for g_rows, g in zip([g for g in grad_rows if g is not None], got):
                    g_rows[s:s + ctx.chunk] = 0 if g is None else g
                for i, g in enumerate(got[len(wanted):]):
                    if g is not None:
                        grads[i] = g if grads[i] is None else grads[i].add_(g)
        it = iter(grads)
        param_grads = [next(it) if need else None for need in needs_params]
        row_grads = [None if g is None else g.view_as(t) for g, t in zip(grad_rows, rows)]
        return (None, None, None, *row_grads, *param_grads)


class _TiledRowsZero3(torch.autograd.Function):
    """:class:`_TiledRows` for parameters DeepSpeed ZeRO-3 partitions (see :func:`tiled_rows`)."""

    @staticmethod
    def forward(ctx, fn, chunk, inputs, params, *rows):
        return _TiledRows.forward(ctx, fn, chunk, len(rows), *rows, *params)

    @staticmethod
    def backward(ctx, grad_out):
        rows = ctx.saved_tensors
        needs_rows = ctx.needs_input_grad[4:]
        params = [p for p in ctx.params if p.requires_grad]
        flats = [_flat(t) for t in rows]
        grad_flat = grad_out.reshape((flats[0].shape[0],) + ctx.out_tail)
        grad_rows = [torch.empty_like(f) if need else None for f, need in zip(flats, needs_rows)]
        starts = range(0, flats[0].shape[0], ctx.chunk)
        try:
            with _replayed_rng(ctx, rows[0]):
                for s in starts:
                    for p in params:  # ZeRO-3 reduces a parameter's gradient once, after the last chunk added to it
                        p.ds_grad_is_ready = s == starts[-1]
                    chunks = [f[s:s + ctx.chunk].detach().requires_grad_(need) for f, need in zip(flats, needs_rows)]
                    with torch.enable_grad():
                        y = ctx.fn(*chunks)
                    if y.requires_grad:
                        torch.autograd.backward(y, grad_flat[s:s + ctx.chunk])
                    for g_rows, c in zip(grad_rows, chunks):
                        if g_rows is not None:
                            g_rows[s:s + ctx.chunk] = 0 if c.grad is None else c.grad
        finally:
            for p in params:
                p.ds_grad_is_ready = True
        row_grads = [None if g is None else g.view_as(t) for g, t in zip(grad_rows, rows)]
        return (None, None, None, None, *row_grads)


@torch.compiler.disable  # an autograd Function that recomputes its chunks in the backward
def tiled_rows(fn: Callable[..., torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor],
               chunk_rows: Optional[int] = None, others: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """``fn(x, *others)`` computed ``chunk_rows`` rows of ``x`` (and of each of ``others``, of ``x``'s leading
    shape) at a time, all leading dims flattened into rows.

    ``params`` are the tensors ``fn`` reads that may need gradients (a module's
    parameters). Exact when ``fn`` acts on each row alone; random draws inside
    ``fn`` (dropout) repeat identically in the recomputation.
    """
    chunk = ROW_CHUNK_ROWS if chunk_rows is None else chunk_rows
    positive_int(chunk, "chunk_rows")
    if x.dim() < 2 or x[..., 0].numel() <= chunk:
        return fn(x, *others)
    for t in others:
        if t.shape[:-1] != x.shape[:-1]:
            raise ValueError(f"tiled_rows: every input has the rows of the first, {tuple(x.shape[:-1])}; got one of "
                             f"{tuple(t.shape[:-1])}")
    if zero3_partitioned(params):
        # ZeRO-3 gathers a module's parameters only around its calls and checks their gradients against the
        # partitioned shapes, so they cannot be inputs whose gradients the backward returns: the backward adds
        # them up in place, chunk by chunk, as DeepSpeed's own tiled MLP does.
        return _TiledRowsZero3.apply(fn, chunk, 1 + len(others), list(params), x, *others)
    return _TiledRows.apply(fn, chunk, 1 + len(others), x, *others, *params)
