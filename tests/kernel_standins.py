"""Torch code in place of the GPU kernel packages' launches, so that their own Python entry points run on a CPU.

The packages run as installed: flash-linear-attention's ``chunk_gated_delta_rule``,
``chunk_kda`` and step-by-step kernels, causal-conv1d's ``causal_conv1d_fn`` and
mamba-ssm's ``mamba_chunk_scan_combined`` and ``selective_scan_fn`` check their
arguments, fill their defaults, apply their autograd Functions and cast as they
do on a GPU. Only what launches compiled code is replaced, by torch code taking
and returning what it does: the Python launchers of Triton kernels
(:data:`LAUNCHERS`: states in float32, the initial state's gradient in float32,
``cu_seqlens`` sequences) and the compiled extension modules
(:data:`EXTENSIONS`, with the extension's own argument checks). The recurrences
run one row at a time, in float32, or float64 for float64 inputs, which the
real kernels do not take (:func:`_state_dtype`), so that a float64 model
measures the hooks. Each forward launch is recorded in :data:`CALLS`.

:func:`install` applies what the installed packages need; it must run before
transformers imports a modeling module, which resolves its kernels then.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import reference

Tensor = torch.Tensor


def _acc(*tensors: Optional[Tensor]) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _state_dtype(x: Tensor) -> torch.dtype:
    """fla's states and their gradients are float32; float64 inputs (which its kernels do not take) keep float64, so
    that a float64 model measures the hooks' error, not a float32 state's."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


CALLS: List[Tuple[str, int, int, bool]] = []
"""Each forward launch in this process: (kernel, rows, value width, started from a given state)."""


def _sequences(rows: int, cu_seqlens: Optional[Tensor]) -> List[Tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, rows)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _vjp(given: Dict[str, Optional[Tensor]], compute: Callable[..., Sequence[Tensor]],
         cotangents: Sequence[Optional[Tensor]]) -> Dict[str, Tensor]:
    """The gradient of ``compute(**given)``'s outputs against ``cotangents`` (an output whose cotangent is None left
    out) for each given tensor (one given as None has none), recomputed under autograd; zeros for an unused input.
    A Triton launcher's backward runs inside an autograd Function's backward, where grad mode is off (causal-conv1d's
    extension, called from a custom op, runs below autograd and is differentiated by hand instead)."""
    leaves = {k: v.detach().requires_grad_() for k, v in given.items() if v is not None}
    with torch.enable_grad():
        pairs = [(out, ct) for out, ct in zip(compute(**leaves), cotangents) if ct is not None]
        found = torch.autograd.grad([out for out, _ in pairs], list(leaves.values()),
                                    [ct.to(out.dtype) for out, ct in pairs], allow_unused=True)
    return {k: (torch.zeros_like(t) if f is None else f.to(t.dtype)) for (k, t), f in zip(leaves.items(), found)}


def _gated_delta(q, k, v, g, beta, scale, h0):
    """One sequence ``(B, T, H, K)`` from the state ``h0`` ``(B, HV, K, V)``: the output and end state."""
    group = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    h, outs = h0, []
    for t in range(q.shape[1]):
        decay = g[:, t].exp()  # (B, HV) for the gated delta rule, (B, HV, K) per key channel for KDA
        h = h * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        kt = k[:, t]
        delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, h)) * beta[:, t][..., None]
        h = h + kt[..., None] * delta[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, h))
    return torch.stack(outs, dim=1), h


def _gated_delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first):
    acc = _acc(q, k, v, initial_state)
    b, rows, hv, dv = v.shape
    dk = k.shape[-1]
    q, k, v, g, beta = (t.to(acc) for t in (q, k, v, g, beta))
    spans = _sequences(rows, cu_seqlens)
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    outs, finals = [], []
    for i, (start, end) in enumerate(spans):
        h0 = (torch.zeros(b, hv, dk, dv, dtype=acc, device=v.device) if initial_state is None
              else initial_state[i:i + 1 if cu_seqlens is not None else b].to(acc))
        o, h = _gated_delta(*(t[:, start:end] for t in (q, k, v, g, beta)), scale, h0)
        outs.append(o)
        finals.append(h)
    final = torch.cat(finals) if cu_seqlens is not None else finals[0]
    return torch.cat(outs, dim=1), (final.transpose(-1, -2) if state_v_first else final)


def _unsupported(what: str, **given) -> None:
    used = [name for name, value in given.items() if value not in (None, False)]
    if used:
        raise NotImplementedError(f"the CPU stand-in for {what} does not take {', '.join(used)}")


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first=False,
                               cu_seqlens=None, cp_context=None, chunk_indices=None, use_gate_in_kernel=False,
                               A_log=None, dt_bias=None, chunk_size=64):
    """fla's launcher: ``(g, o, A, final_state, initial_state, g_input)``; ``g`` and ``A`` are what its backward
    reads (here the log gates as given, and nothing)."""
    _unsupported("chunk_gated_delta_rule_fwd", cp_context=cp_context, use_gate_in_kernel=use_gate_in_kernel)
    with torch.no_grad():
        o, final = _gated_delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    CALLS.append(("chunk_gated_delta_rule", v.shape[1], v.shape[-1], initial_state is not None))
    final = final.to(_state_dtype(q)) if output_final_state else None
    return g, o.to(q.dtype), None, final, initial_state, None


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, scale, initial_state, do, dht, cu_seqlens=None, cp_context=None,
                               chunk_indices=None, state_v_first=False, use_gate_in_kernel=False, g_input=None,
                               A_log=None, dt_bias=None, chunk_size=64):
    """fla's launcher: ``(dq, dk, dv, db, dg, dh0, dA_log, ddt_bias)``, the initial state's gradient in float32."""
    _unsupported("chunk_gated_delta_rule_bwd", cp_context=cp_context, use_gate_in_kernel=use_gate_in_kernel)
    got = _vjp({"q": q, "k": k, "v": v, "g": g, "beta": beta, "h0": initial_state},
               lambda q, k, v, g, beta, h0=None: _gated_delta_rule(q, k, v, g, beta, scale, h0, cu_seqlens,
                                                                   state_v_first), (do, dht))
    dh0 = got["h0"].to(_state_dtype(q)) if "h0" in got else None
    return got["q"], got["k"], got["v"], got["beta"], got["g"], dh0, None, None


def fused_recurrent_gated_delta_rule_fwd(q, k, v, g=None, gk=None, gv=None, beta=None, A_log=None, dt_bias=None,
                                         scale=None, initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                         allow_neg_eigval=False, state_v_first=False, cu_seqlens=None):
    """fla's launcher of the step-by-step delta rule (decoding): ``(o, final_state)``, ``o`` like ``v``."""
    _unsupported("fused_recurrent_gated_delta_rule_fwd", gv=gv, A_log=A_log,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
    decay = gk if g is None else (g if gk is None else g[..., None] + gk)
    decay = torch.zeros_like(v[..., 0]) if decay is None else decay
    o, final = _gated_delta_rule(q, k, v, decay, beta, scale, initial_state, cu_seqlens, state_v_first)
    CALLS.append(("fused_recurrent_gated_delta_rule", v.shape[1], v.shape[-1], initial_state is not None))
    return o.to(v.dtype), (final.to(_state_dtype(q)) if output_final_state else None)


def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                            output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                            ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                            use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                            lower_bound=None, out=None, **kwargs):
    """fla's launcher of the step-by-step KDA (decoding): ``(o, final_state)``; with ``inplace_final_state`` the
    end state is written into ``initial_state``."""
    _unsupported("fused_recurrent_kda_fwd", use_gate_in_kernel=use_gate_in_kernel, ssm_state_indices=ssm_state_indices,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, num_accepted_tokens=num_accepted_tokens)
    if inplace_final_state:
        assert initial_state is not None
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
    o, final = _gated_delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    CALLS.append(("fused_recurrent_kda", v.shape[1], v.shape[-1], initial_state is not None))
    if out is not None:
        out.copy_(o)
        o = out
    if inplace_final_state:
        initial_state.copy_(final)
        return o.to(v.dtype), initial_state
    return o.to(v.dtype), (final.to(_state_dtype(q)) if output_final_state else None)


def chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first=False, cu_seqlens=None,
                  cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, safe_gate=False, lower_bound=None,
                  use_gate_in_kernel=False, A_log=None, dt_bias=None, disable_recompute=False,
                  return_intermediate_states=False, cp_context=None, use_graph=False, chunk_offsets=None):
    """fla's KDA launcher: ``(o, final_state, g_cumsum, Aqk, Akk, w, u, qg, kg, v_new, h, initial_state)``; of
    what its backward reads, ``g_cumsum`` is here the log gates as given, the rest nothing."""
    _unsupported("chunk_kda_fwd", cp_context=cp_context, use_gate_in_kernel=use_gate_in_kernel, safe_gate=safe_gate,
                 return_intermediate_states=return_intermediate_states, use_graph=use_graph)
    with torch.no_grad():
        o, final = _gated_delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first)
    CALLS.append(("chunk_kda", v.shape[1], v.shape[-1], initial_state is not None))
    final = final.to(_state_dtype(q)) if output_final_state else None
    return (o.to(q.dtype), final, g) + (None,) * 8 + (initial_state,)


def chunk_kda_bwd(q, k, v, beta, Aqk, Akk, scale, initial_state, do, dht, g, g_org=None, state_v_first=False,
                  cu_seqlens=None, chunk_indices=None, chunk_size=64, safe_gate=False, lower_bound=None,
                  use_gate_in_kernel=False, A_log=None, dt_bias=None, disable_recompute=False, cp_context=None,
                  w=None, u=None, qg=None, kg=None, v_new=None, h=None, use_graph=False, chunk_offsets=None):
    """fla's KDA launcher: ``(dq, dk, dv, db, dg, dh0, dA, dbias)``."""
    _unsupported("chunk_kda_bwd", cp_context=cp_context, use_gate_in_kernel=use_gate_in_kernel)
    return chunk_gated_delta_rule_bwd(q, k, v, g, beta, None, scale, initial_state, do, dht, cu_seqlens,
                                      state_v_first=state_v_first)


def l2norm_fwd(x: Tensor, eps: float = 1e-6, output_dtype: Optional[torch.dtype] = None):
    """fla's launcher: ``x / sqrt(sum(x^2) + eps)`` and that reciprocal (float32)."""
    acc = _acc(x)
    rstd = 1 / torch.sqrt((x.to(acc) ** 2).sum(-1) + eps)
    y = x.to(acc) * rstd[..., None]
    return y.to(output_dtype or x.dtype), rstd.to(torch.float32 if acc == torch.float32 else acc)


def l2norm_bwd(y: Tensor, rstd: Tensor, dy: Tensor, eps: float = 1e-6):
    """fla's launcher: the input's gradient from the output ``y``, its reciprocal norm and ``dy``."""
    acc = _acc(y, dy)
    y32, dy32, r = y.to(acc), dy.to(acc), rstd.to(acc)[..., None]
    return (dy32 * r - (dy32 * y32).sum(-1, keepdim=True) * y32 * r).to(y.dtype)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)  # as TORCH_CHECK raises


_CONV_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def _conv_checks(x: Tensor, weight: Tensor, bias: Optional[Tensor], seq_idx: Optional[Tensor],
                 states: Dict[str, Optional[Tensor]]) -> bool:
    """causal-conv1d's checks of its extension's arguments (csrc/causal_conv1d.cpp, 1.7), less the device's; whether
    ``x`` is channel-last."""
    _check(x.dtype in _CONV_TYPES and weight.dtype in _CONV_TYPES, "input and weight must be float32, float16 or "
           f"bfloat16 (got {x.dtype}, {weight.dtype})")
    batch, dim, rows = x.shape
    width = weight.shape[-1]
    _check(tuple(weight.shape) == (dim, width), "weight must have shape (dim, width)")
    _check(x.stride(2) == 1 or x.stride(1) == 1, "x must be contiguous in its rows or its channels")
    last = x.stride(1) == 1 and x.stride(2) > 1
    if last:
        _check(dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now")
        _check(x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, "causal_conv1d with channel last layout requires "
               "strides (x.stride(0) and x.stride(2)) to be multiples of 8")
    _check(2 <= width <= 4, "causal_conv1d only supports width between 2 and 4")
    if bias is not None:
        _check(bias.dtype == weight.dtype and tuple(bias.shape) == (dim,), "bias must be (dim,) of weight's dtype")
    if seq_idx is not None:
        _check(last, "seq_idx is only supported for channel last layout")
        _check(seq_idx.dtype == torch.int32 and tuple(seq_idx.shape) == (batch, rows), "seq_idx must be int32 "
               "(batch, seqlen)")
    for name, state in states.items():
        if state is not None:
            _check(last, f"{name} is only supported for channel last layout")
            _check(state.dtype == x.dtype and tuple(state.shape) == (batch, dim, width - 1) and state.stride(1) == 1,
                   f"{name} must be (batch, dim, width - 1) of x's dtype, channel-last")
    return last


def _conv_reference(x, weight, bias, seq_idx, initial_states, silu):
    """The convolution in float32 (as the kernel accumulates): output and the last ``width - 1`` input rows."""
    width = weight.shape[-1]
    acc = torch.float32
    rows = x.shape[-1]
    before = (x.new_zeros(x.shape[0], x.shape[1], width - 1) if initial_states is None else initial_states)
    padded = torch.cat([before, x], dim=-1).to(acc)
    windows = padded.unfold(-1, width, 1)  # (B, C, rows, width)
    if seq_idx is not None:
        ids = torch.cat([seq_idx.new_full((x.shape[0], width - 1), -1) if initial_states is None else
                         seq_idx[:, :1].expand(-1, width - 1), seq_idx], dim=-1).unfold(-1, width, 1)
        windows = windows * (ids == seq_idx[..., None])[:, None].to(acc)
    out = (windows * weight.to(acc)[None, :, None, :]).sum(-1)
    if bias is not None:
        out = out + bias.to(acc)[None, :, None]
    out = torch.nn.functional.silu(out) if silu else out
    return out[..., :rows], padded[..., -(width - 1):]


class CausalConv1dExtension:
    """``causal_conv1d_cuda``: the compiled extension's three functions, writing into the tensors given."""

    @staticmethod
    def causal_conv1d_fwd(x, weight, bias, seq_idx, initial_states, out, final_states_out, silu_activation):
        _conv_checks(x, weight, bias, seq_idx, {"initial_states": initial_states, "final_states": final_states_out})
        CALLS.append(("causal_conv1d_fwd", x.shape[-1], x.shape[1], initial_states is not None))
        with torch.no_grad():
            got, last = _conv_reference(x, weight, bias, seq_idx, initial_states, silu_activation)
            out.copy_(got)
            if final_states_out is not None:
                final_states_out.copy_(last)

    @staticmethod
    def causal_conv1d_bwd(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, dweight, dbias,
                          dinitial_states, silu_activation):
        _conv_checks(x, weight, bias, seq_idx, {"initial_states": initial_states, "dfinal_states": dfinal_states,
                                                "dinitial_states": dinitial_states})
        _check((bias is None) == (dbias is None), "bias and dbias go together")
        # By hand: the extension runs below autograd (a custom op), where no graph is recorded.
        width, rows, acc = weight.shape[-1], x.shape[-1], torch.float32
        before = x.new_zeros(x.shape[0], x.shape[1], width - 1) if initial_states is None else initial_states
        padded = torch.cat([before, x], dim=-1).to(acc)
        same = None
        if seq_idx is not None:
            ids = torch.cat([seq_idx.new_full((x.shape[0], width - 1), -1) if initial_states is None else
                             seq_idx[:, :1].expand(-1, width - 1), seq_idx], dim=-1).unfold(-1, width, 1)
            same = (ids == seq_idx[..., None])[:, None].to(acc)  # (B, 1, rows, width)
        windows = padded.unfold(-1, width, 1)
        if same is not None:
            windows = windows * same
        pre = (windows * weight.to(acc)[None, :, None, :]).sum(-1)
        if bias is not None:
            pre = pre + bias.to(acc)[None, :, None]
        grad = dout.to(acc)
        if silu_activation:
            sig = torch.sigmoid(pre)
            grad = grad * sig * (1 + pre * (1 - sig))
        dweight.copy_((grad[..., None] * windows).sum((0, 2)))
        if dbias is not None:
            dbias.copy_(grad.sum((0, 2)))
        taps = grad[..., None] * weight.to(acc)[None, :, None, :]  # (B, C, rows, width): d padded[t + j]
        if same is not None:
            taps = taps * same
        dpadded = torch.zeros_like(padded)
        for j in range(width):
            dpadded[..., j:j + rows] += taps[..., j]
        if dfinal_states is not None:
            dpadded[..., -(width - 1):] += dfinal_states.to(acc)
        dx.copy_(dpadded[..., width - 1:])
        if dinitial_states is not None:
            dinitial_states.copy_(dpadded[..., :width - 1])

    @staticmethod
    def causal_conv1d_update(x, conv_state, weight, bias, out, silu_activation, cache_seqlens, conv_state_indices):
        _check(cache_seqlens is None and conv_state_indices is None, "the CPU stand-in takes a plain conv_state")
        width = weight.shape[-1]
        rows = x.shape[-1] if x.dim() == 3 else 1
        x3 = x if x.dim() == 3 else x[..., None]
        joined = torch.cat([conv_state, x3.to(conv_state.dtype)], dim=-1)
        got, _ = _conv_reference(joined[..., -(width - 1 + rows):], weight, bias, None, None, silu_activation)
        conv_state.copy_(joined[..., -conv_state.shape[-1]:])
        out.copy_(got[..., -rows:].reshape(out.shape))




def _ssd(x, dt, A, B, C, D, dt_bias, initial_states, dt_softplus, dt_limit):
    """Mamba2's scan, one row at a time (:func:`reference.mamba2_scan`, float64): ``(y before the gate, end state)``,
    ``D`` of shape ``(H,)`` or ``(H, P)``."""
    y, state = reference.mamba2_scan(x, dt, A, B, C, dt_bias=dt_bias, initial_states=initial_states,
                                     dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True)
    if D is not None:
        y = y + (D.double() if D.dim() == 2 else D.double()[:, None]) * x.double()
    return y, state


def _ssd_checks(x, dt, A, B, C, D, z, initial_states, seq_idx):
    """mamba-ssm's launcher's checks of its arguments (ops/triton/ssd_combined.py, 2.3)."""
    batch, rows, heads, dim = x.shape
    groups, dstate = B.shape[2], B.shape[3]
    assert heads % groups == 0
    assert B.shape == (batch, rows, groups, dstate) and C.shape == B.shape
    assert dt.shape == (batch, rows, heads) and A.shape == (heads,)
    assert z is None or z.shape == x.shape
    assert D is None or D.shape in ((heads, dim), (heads,))
    assert seq_idx is None or seq_idx.shape == (batch, rows)
    assert initial_states is None or initial_states.shape == (batch, heads, dim, dstate)


def mamba_chunk_scan_combined_fwd(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                  seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """mamba-ssm's launcher: ``(out, out_x, dt, dA_cumsum, states, final_states)``; of the chunk intermediates its
    backward reads none here."""
    _ssd_checks(x, dt, A, B, C, D, z, initial_states, seq_idx)
    _unsupported("_mamba_chunk_scan_combined_fwd", seq_idx=seq_idx, cu_seqlens=cu_seqlens)
    with torch.no_grad():
        y, final = _ssd(x, dt, A, B, C, D, dt_bias, initial_states, dt_softplus, dt_limit)
    CALLS.append(("mamba_chunk_scan_combined", x.shape[1], x.shape[-1], initial_states is not None))
    out = y if z is None else y * torch.nn.functional.silu(z.double())
    return out.to(x.dtype), y.to(x.dtype), None, None, None, final.to(_state_dtype(x))


def mamba_chunk_scan_combined_bwd(dout, x, dt, A, B, C, out, chunk_size, D=None, z=None, dt_bias=None,
                                  initial_states=None, dfinal_states=None, seq_idx=None, dt_softplus=False,
                                  dt_limit=(0.0, float("inf")), dx=None, ddt=None, dB=None, dC=None, dz=None,
                                  recompute_output=False):
    """mamba-ssm's launcher: ``(dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states)``."""
    _unsupported("_mamba_chunk_scan_combined_bwd", seq_idx=seq_idx, recompute_output=recompute_output)

    def scan(x, dt, A, B, C, D=None, z=None, dt_bias=None, h0=None):
        y, final = _ssd(x, dt, A, B, C, D, dt_bias, h0, dt_softplus, dt_limit)
        return (y if z is None else y * torch.nn.functional.silu(z.double())), final

    got = _vjp({"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias, "h0": initial_states},
               scan, (dout, dfinal_states))
    return (got["x"], got["dt"], got["A"], got["B"], got["C"], got.get("D"), got.get("z"), got.get("dt_bias"),
            got.get("h0"))


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """mamba-ssm's one-step launcher (decoding), by the package's own torch reference of it, which takes the same
    arguments and updates ``state`` in place."""
    import importlib

    _unsupported("selective_state_update", state_batch_indices=state_batch_indices)
    module = importlib.import_module("mamba_ssm.ops.triton.selective_state_update")
    CALLS.append(("selective_state_update", 1, x.shape[-1], True))
    return module.selective_state_update_ref(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)


class SelectiveScanExtension:
    """``selective_scan_cuda``: the compiled extension's ``fwd`` and ``bwd``, with its argument checks
    (csrc/selective_scan/selective_scan.cpp, mamba-ssm 2.3) less the device's. ``fwd``'s second result holds each
    chunk's state in its odd columns (the interface reads the last chunk's as the end state): here one chunk."""

    @staticmethod
    def _checks(u, delta, A, B, C, D, z, delta_bias):
        _check(u.dtype in _CONV_TYPES, f"selective_scan takes float32, float16 or bfloat16 inputs (got {u.dtype})")
        _check(A.dtype == torch.float32, f"selective_scan takes float32 A (got {A.dtype})")
        _check(delta.dtype == u.dtype, "delta must have u's dtype")
        _check(B.dtype == u.dtype and C.dtype == u.dtype, "a variable B and C must have u's dtype")
        _check(A.shape[-1] <= 256, "selective_scan only supports state dimension <= 256")
        _check(D is None or D.dtype == torch.float32, "D must be float32")
        _check(delta_bias is None or delta_bias.dtype == torch.float32, "delta_bias must be float32")
        _check(z is None or z.dtype == u.dtype, "z must have u's dtype")
        _check(B.dim() == 4 and B.shape[1] == 1 and C.dim() == 4 and C.shape[1] == 1,
               "the stand-in takes one group of variable B and C")

    @staticmethod
    def _scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
        y, state = reference.selective_scan(u, delta, A, B[:, 0], C[:, 0], D=D, delta_bias=delta_bias,
                                            delta_softplus=delta_softplus, return_last_state=True)
        y = y.double()
        return y, (y if z is None else y * torch.nn.functional.silu(z.double())), state

    @staticmethod
    def fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
        SelectiveScanExtension._checks(u, delta, A, B, C, D, z, delta_bias)
        y, gated, state = SelectiveScanExtension._scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
        CALLS.append(("selective_scan_fwd", u.shape[-1], u.shape[1], False))
        x = torch.zeros(*state.shape[:2], 1, 2 * state.shape[-1], dtype=torch.float32, device=u.device)
        x[..., 0, 1::2] = state
        return [y.to(u.dtype), x] + ([gated.to(u.dtype)] if z is not None else [])

    @staticmethod
    def bwd(u, delta, A, B, C, D, z, delta_bias, dout, x, out, dz, delta_softplus, recompute_out_z):
        SelectiveScanExtension._checks(u, delta, A, B, C, D, z, delta_bias)
        got = _vjp({"u": u, "delta": delta, "A": A, "B": B, "C": C, "D": D, "z": z, "delta_bias": delta_bias},
                   lambda u, delta, A, B, C, D=None, z=None, delta_bias=None: SelectiveScanExtension._scan(
                       u, delta, A, B, C, D, z, delta_bias, delta_softplus)[1:2], (dout,))
        result = [got["u"], got["delta"], got["A"], got["B"], got["C"], got.get("D"), got.get("delta_bias")]
        return result + ([got["z"]] if z is not None else [])


EXTENSIONS = {"causal_conv1d_cuda": (CausalConv1dExtension, "causal_conv1d"),
              "selective_scan_cuda": (SelectiveScanExtension, "mamba_ssm")}
"""Compiled extension modules, by name: their stand-in, and the package that imports them (installed without
compiling)."""


LAUNCHERS: Dict[str, Dict[str, object]] = {
    "fla.ops.gated_delta_rule.chunk": {
        "chunk_gated_delta_rule_fwd": chunk_gated_delta_rule_fwd,
        "chunk_gated_delta_rule_bwd": chunk_gated_delta_rule_bwd,
        "l2norm_fwd": l2norm_fwd,
        "l2norm_bwd": l2norm_bwd,
    },
    "fla.ops.gated_delta_rule.fused_recurrent": {
        "fused_recurrent_gated_delta_rule_fwd": fused_recurrent_gated_delta_rule_fwd,
    },
    "mamba_ssm.ops.triton.selective_state_update": {
        "selective_state_update": selective_state_update,
    },
    "mamba_ssm.ops.triton.ssd_combined": {
        "_mamba_chunk_scan_combined_fwd": mamba_chunk_scan_combined_fwd,
        "_mamba_chunk_scan_combined_bwd": mamba_chunk_scan_combined_bwd,
    },
    "fla.ops.kda.fused_recurrent": {
        "fused_recurrent_kda_fwd": fused_recurrent_kda_fwd,
    },
    "fla.ops.kda.chunk": {
        "chunk_kda_fwd": chunk_kda_fwd,
        "chunk_kda_bwd": chunk_kda_bwd,
        "l2norm_fwd": l2norm_fwd,
        "l2norm_bwd": l2norm_bwd,
    },
}
"""The packages' Python launchers of compiled code, by the module that calls them (its own name for them is what is
replaced)."""


def function_layer(func: Callable, layer_name: str) -> torch.nn.Module:
    """What the ``kernels`` package (0.16 to 0.18, read from its source) makes of a function decorated with its
    ``use_kernel_forward_from_hub``, which transformers applies to each kernel function it resolves when ``kernels``
    is installed: an ``nn.Module`` instance whose ``forward`` calls the function (and carries its signature after
    ``self``), its class marked with the layer name ``kernelize`` looks up."""
    import inspect

    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    signature = inspect.signature(func)
    Func.forward.__signature__ = signature.replace(
        parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *signature.parameters.values()])
    Func.kernel_layer_name = layer_name
    return Func()


PACKAGES = ("fla", "causal_conv1d", "mamba_ssm")
"""The kernel packages transformers looks for, as imported."""


def install(packages: Sequence[str] = PACKAGES) -> List[str]:
    """Put the stand-ins in place for each of ``packages`` that is installed, and hide the other kernel packages from
    imports (transformers then takes its torch path for them); the packages found. Run before transformers imports
    a modeling module."""
    import importlib
    import importlib.util
    import sys
    import types

    for package in PACKAGES:
        if package not in packages:
            sys.modules[package] = None  # an import of it raises ImportError
    found = []
    for name, (standin, package) in EXTENSIONS.items():
        if package not in packages or importlib.util.find_spec(package) is None:
            continue
        module = types.ModuleType(name)
        for attr in dir(standin):
            if not attr.startswith("_"):
                setattr(module, attr, getattr(standin, attr))
        sys.modules[name] = module
        found.append(package)
    for module_name, names in LAUNCHERS.items():
        package = module_name.split(".")[0]
        if package not in packages or importlib.util.find_spec(package) is None:
            continue
        module = importlib.import_module(module_name)
        for name, fn in names.items():
            assert hasattr(module, name), f"{module_name} has no {name}: another release of the package"
            setattr(module, name, fn)
        if package not in found:
            found.append(package)
    # From transformers 5.25 a package's function runs only on the devices it supports (CUDA), CPU inputs taking the
    # torch path; with the launches stood in for, the CPU is such a device, as a GPU is on a GPU machine.
    devices = getattr(importlib.import_module("transformers.integrations.hub_kernels"), "_PACKAGE_SUPPORTED_DEVICES",
                      None)
    if devices is not None:
        for package in found:
            if package in devices and "cpu" not in devices[package]:
                devices[package] = (*devices[package], "cpu")
    return found
