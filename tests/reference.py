"""Independent float64 reference: dense softmax attention with an explicit mask.

Shares no code with hf_ring: every mask is built here from positions, on
the CPU, and moved to the inputs' device. The tests and ``python -m
bench gpu`` (from a checkout) measure the library against it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def dense_mask(n: int, causal: bool = True, window: Optional[int] = None) -> torch.Tensor:
    """Boolean ``(n, n)``: entry ``[t, k]`` is True when query t may see key k."""
    t = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    allowed = torch.ones(n, n, dtype=torch.bool)
    if causal:
        allowed &= k <= t
    if window is not None:
        allowed &= k > t - window
    return allowed


def attention(q, k, v, *, bias: torch.Tensor, scale: Optional[float] = None, softcap: Optional[float] = None,
              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``softmax(cap(scale·q·kᵀ) + bias)·v`` in float64; ``bias`` is ``(H or 1, n, n)`` or ``(B, H or 1, n, n)``
    with -inf for masked.

    ``softcap`` caps the scores as ``softcap·tanh(s/softcap)`` before the bias;
    ``sinks`` ``(H,)`` adds one more softmax column per head holding the sink
    logit, whose value vector is zero. Rows whose every entry is masked give 0.
    GQA is handled by repeating K/V here.
    """
    q, k, v = q.double(), k.double(), v.double()
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s + bias.to(device=s.device, dtype=torch.float64)
    if sinks is not None:
        b, h, nq = s.shape[:3]
        s = torch.cat([s, sinks.double().to(s.device).view(1, h, 1, 1).expand(b, h, nq, 1)], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[:, :, :1])], dim=2)
    empty = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return torch.einsum("bhqk,bhkd->bhqd", p, v)


def dense_attention(q, k, v, *, causal=True, window=None, scale=None) -> torch.Tensor:
    n = q.shape[2]
    m = dense_mask(n, causal, window)
    bias = torch.zeros(n, n, dtype=torch.float64).masked_fill(~m, float("-inf"))
    return attention(q, k, v, bias=bias[None], scale=scale)


def with_grads(fn, q, k, v, dout, **kw):
    """Output and (dq, dk, dv) of ``fn`` in float64 for upstream gradient ``dout``."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, **kw)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def dilated_multiplicity(n: int, branches, head: int, causal: bool = True) -> torch.Tensor:
    """``m[p, q]``: how many branches let query p see key q for query head ``head`` (LongNet eqs. 9-10)."""
    p = torch.arange(n)[:, None]
    q = torch.arange(n)[None, :]
    m = torch.zeros(n, n, dtype=torch.long)
    for w, r in branches:
        wt = min(w, n)
        same_seg = (p // wt) == (q // wt)
        rho_p, rho_q = p - (p // wt) * wt, q - (q // wt) * wt
        o = head % r
        ok = same_seg & (rho_p % r == o) & (rho_q % r == o)
        if causal:
            ok &= q <= p
        m += ok.long()
    return m


def dilated_attention(q, k, v, *, branches, causal=True, scale=None) -> torch.Tensor:
    """Dense attention with bias ``log m`` per query head: the multiplicity-weighted single softmax."""
    n, hq = q.shape[2], q.shape[1]
    bias = torch.stack([
        torch.log(dilated_multiplicity(n, branches, h, causal).double()) for h in range(hq)
    ])
    return attention(q, k, v, bias=bias, scale=scale)


def documents_of(position_ids: torch.Tensor) -> torch.Tensor:
    """``(B, n)`` document number of each row: a new document wherever a position id is not the previous + 1."""
    pos = position_ids.long()
    new = torch.ones_like(pos, dtype=torch.bool)
    new[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return torch.cumsum(new.long(), dim=1) - 1


def packed_bias(position_ids: torch.Tensor, hq: int, *, causal=True, window=None, branches=None) -> torch.Tensor:
    """``(B, hq, n, n)`` bias of packed rows: each document attended alone, as if it were its own sequence.

    Each document of length L gets the dense mask (or the dilated ``log m``
    of a length-L sequence) in its diagonal block; pairs across documents are -inf.
    """
    docs = documents_of(position_ids)
    b, n = docs.shape
    bias = torch.full((b, hq, n, n), float("-inf"), dtype=torch.float64)
    for i in range(b):
        for d in docs[i].unique().tolist():
            rows = torch.nonzero(docs[i] == d).flatten()
            lo, length = int(rows[0]), len(rows)
            for h in range(hq):
                if branches is None:
                    m = dense_mask(length, causal, window).double()
                else:
                    m = dilated_multiplicity(length, branches, h, causal).double()
                bias[i, h, lo:lo + length, lo:lo + length] = torch.log(m)
    return bias


def with_grads_sinks(fn, q, k, v, sinks, dout, **kw):
    """Output and (dq, dk, dv, dsinks) of ``fn(q, k, v, sinks=...)`` in float64."""
    q, k, v, sinks = (t.detach().double().requires_grad_(True) for t in (q, k, v, sinks))
    out = fn(q, k, v, sinks=sinks, **kw)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad, sinks.grad


def block_bias(block_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, *, causal=True,
               window=None) -> torch.Tensor:
    """``(B, 1, n, n)`` bias of rows with bidirectional blocks, as transformers composes it for Gemma 3 or
    PaliGemma: ``(causal ∧ window) ∨ (same block id >= 0)``, inside each packed document (``position_ids``).
    """
    b, n = block_ids.shape
    docs = torch.zeros(b, n, dtype=torch.long) if position_ids is None else documents_of(position_ids)
    base = dense_mask(n, causal, window)[None]
    same_block = (block_ids[:, :, None] == block_ids[:, None, :]) & (block_ids[:, :, None] >= 0)
    allowed = (base | same_block) & (docs[:, :, None] == docs[:, None, :])
    return torch.zeros(b, 1, n, n, dtype=torch.float64).masked_fill(~allowed[:, None], float("-inf"))


# Recurrences, step by step in float64 (transformers' torch paths of these layers compute in float32 whatever the
# input dtype; the hybrid tests put these in their place, in the one-process reference and the sharded run alike).


def delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule (``g`` ``(B, L, H)``) or KDA (``g`` ``(B, L, H, d_k)``), one row at a time:
    ``S = (I - β k kᵀ) diag(exp g) S + β k vᵀ``, ``o = Sᵀ q / √d_k``. Query and key heads serve
    ``H_v / H_k`` value heads each. Returns ``(o, S_end or None)``, ``o`` in the value's dtype."""
    dtype = value.dtype
    q, k, v, g, beta = (t.double() for t in (query, key, value, g, beta))
    heads = v.shape[2]
    q, k = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (q, k))
    if use_qk_l2norm_in_kernel:
        q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    q = q * q.shape[-1] ** -0.5
    b, n, _, dk = k.shape
    state = (torch.zeros(b, heads, dk, v.shape[-1], dtype=torch.float64, device=v.device) if initial_state is None
             else initial_state.double())
    outs = []
    for t in range(n):
        decay = g[:, t].exp()
        state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        delta = (v[:, t] - (state * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]
        state = state + k[:, t, ..., None] * delta[..., None, :]
        outs.append((state * q[:, t, ..., None]).sum(-2))
    return torch.stack(outs, 1).to(dtype), (state if output_final_state else None)


def mamba2_scan(hidden_states, dt, A, B, C, chunk_size=256, D=None, dt_bias=None, initial_states=None,
                dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    """Mamba2's scan, one row at a time: ``h = exp(A·dt) h + dt x Bᵀ`` per head, ``y = h C + D x``."""
    x, dt, A, B, C = (t.double() for t in (hidden_states, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    b, n, heads, p = x.shape
    B, C = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    state = (torch.zeros(b, heads, p, B.shape[-1], dtype=torch.float64, device=x.device) if initial_states is None
             else initial_states.double())
    outs = []
    for t in range(n):
        state = state * (A * dt[:, t]).exp()[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None]
        outs.append((state * C[:, t, :, None]).sum(-1))
    y = torch.stack(outs, 1)
    if D is not None:
        y = y + D.double()[:, None] * x
    return (y, state) if return_final_states else y


def selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, **kwargs):
    """Mamba's selective scan, one row at a time, over ``(B, D, L)``: ``h = exp(A·dt) h + dt B x``, ``y = C h + D x``,
    gated by ``silu(z)``."""
    dtype = hidden_states.dtype
    x, dt, A, B, C = (t.double() for t in (hidden_states, dt, A, B, C))
    if delta_bias is not None:
        dt = dt + delta_bias.double()[..., None]
    if delta_softplus:
        dt = torch.nn.functional.softplus(dt)
    state = torch.zeros(x.shape[0], x.shape[1], A.shape[-1], dtype=torch.float64, device=x.device)
    outs = []
    for t in range(x.shape[-1]):
        state = (A * dt[..., t, None]).exp() * state + dt[..., t, None] * B[:, None, :, t] * x[..., t, None]
        outs.append((state * C[:, None, :, t]).sum(-1))
    y = torch.stack(outs, -1)
    if D is not None:
        y = y + D.double()[:, None] * x
    if z is not None:
        y = y * torch.nn.functional.silu(z.double())
    y = y.to(dtype)
    return (y, state) if return_last_state else y


def rg_lru_scan(self, hidden_states, recurrent_gate, reset, recurrent_states=None, acc_dtype=torch.float64):
    """RecurrentGemma's RG-LRU recurrence, one row at a time in float64, over ``(B, L, W)``: ``h = a h + x`` with
    ``a`` zero where ``reset``, from ``recurrent_states`` (zero when None); the outputs and the end state (a method of
    ``RecurrentGemmaRglru``'s signature: ``self`` unused)."""
    x = hidden_states.double()
    a = recurrent_gate.double() * ~reset
    state = x.new_zeros(x.shape[0], x.shape[2]) if recurrent_states is None else recurrent_states.double()
    outs = []
    for t in range(x.shape[1]):
        state = a[:, t] * state + x[:, t]
        outs.append(state)
    return torch.stack(outs, 1).to(hidden_states.dtype), state


def wkv(time_decay, time_first, key, value, state=None, return_state=False):
    """RWKV's WKV, one row at a time in float64 over ``(B, L, C)``, as a plain numerator and denominator per channel:
    ``o_t = (num + e^{u + k_t} v_t) / (den + e^{u + k_t})``, then ``num = e^w num + e^{k_t} v_t`` and ``den = e^w den +
    e^{k_t}``, ``w = -exp(time_decay)``, ``u = time_first``. ``state``: ``(ratio, weight, log scale)`` as the model
    keeps it (``num = ratio · e^scale``); the end state is returned in that form with a scale of 0."""
    dtype = key.dtype
    decay, first = (-time_decay.double().exp()).exp(), time_first.double().exp()
    k, v = key.double().exp(), value.double()
    if state is None:
        num = k.new_zeros(k.shape[0], k.shape[2])
        den = num.clone()
    else:
        ratio, weight, scale = (t.double() for t in state)
        num, den = ratio * scale.exp(), weight * scale.exp()
    outs = []
    for t in range(k.shape[1]):
        now = first * k[:, t]
        outs.append((num + now * v[:, t]) / (den + now))
        num, den = decay * num + k[:, t] * v[:, t], decay * den + k[:, t]
    out = torch.stack(outs, 1).to(dtype)
    return out, ([num, den, torch.zeros_like(num)] if return_state or state is not None else None)


def lightning_attention(module, hidden):
    """MiniMax's lightning attention layer in float64, its recurrence one row at a time over ``(B, L, hidden)``:
    per head ``S_t = exp(-slope) S_{t-1} + k_tᵀ v_t``, ``o_t = q_t S_t`` from a zero state; then the layer's norm,
    output gate and projection (its own modules). Returns the output and the end state ``(B, H, d, d)``."""
    b, n, _ = hidden.shape
    h, d = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(hidden.double())).reshape(b, n, h, 3 * d)
    q, k, v = torch.split(qkv, d, dim=3)
    decay = torch.exp(-module.slope_rate.double())[None]  # (1, H, 1, 1)
    state = hidden.new_zeros(b, h, d, d, dtype=torch.float64)
    outs = []
    for t in range(n):
        state = decay * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhd,bhde->bhe", q[:, t], state))
    out = module.norm(torch.stack(outs, 1).reshape(b, n, h * d))
    out = torch.sigmoid(module.output_gate(hidden.double())) * out
    return module.out_proj(out), state
