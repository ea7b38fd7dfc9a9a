"""Which kernel each kind of block the ring computes takes on CUDA, checked op by op.

A dispatch-mode spy (:class:`OpSpy`) records every aten op a block's forward
and backward run, with what it is given and what it allocates. Under
``FakeTensorMode`` that runs on a CPU-only build with fake ``device="cuda"``
tensors (only shapes, strides and dtypes exist), so the CUDA route of every
block kind is checked without a GPU; on a GPU the same spy watches the real
kernels. :func:`check` asserts, for one block kind, that its fused kernel ran
in the forward and the backward, that no math-path op did, that every fused
call met the contracts the CUDA kernels check at run time (one dtype, a
contiguous last dimension, an fp32 contiguous logsumexp, ``cum_seq`` None for
a dense flash backward, aligned biases), that K/V reached the kernel with
their own head count (never repeated), and that nothing as large as the
block's scores was allocated.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_ring.engine import kernels

aten = torch.ops.aten

FUSED = {
    "cuda_flash": ("_flash_attention_forward", "_flash_attention_backward"),
    "cuda_efficient": ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"),
}
"""The aten ops of each fused route: (forward, backward)."""

MATH_OPS = frozenset({"bmm", "mm", "baddbmm", "addmm", "matmul", "_softmax", "logsumexp", "repeat_interleave",
                      "_scaled_dot_product_flash_attention_for_cpu"})
"""Ops that only the exact math path (or a repeat of K/V) runs."""


@dataclass
class Call:
    op: str
    args: tuple
    kwargs: dict
    outputs: List[Tuple[Tuple[int, ...], torch.dtype]]  # of tensors it allocated (none for a view)


class OpSpy(TorchDispatchMode):
    """Records every aten op under it: its name, arguments and the shapes and dtypes it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = out if isinstance(out, (tuple, list)) else [out]
        # A view allocates nothing: only ops that make new tensors count as allocations.
        shapes = [] if func.is_view else [(tuple(t.shape), t.dtype) for t in flat if isinstance(t, torch.Tensor)]
        self.calls.append(Call(func.overloadpacket.__name__, args, kwargs, shapes))
        return out

    def ops(self) -> List[str]:
        return [c.op for c in self.calls]


@dataclass(frozen=True)
class BlockCase:
    """One kind of block as the ring hands it to the kernels: shapes, strides, dtype, mask, and the expected route."""

    name: str
    dtype: torch.dtype
    sq: int
    sk: int
    hq: int = 32
    hkv: int = 8
    d: int = 128
    b: int = 1
    causal: bool = False
    band: Optional[Tuple[Optional[int], int]] = None
    mask: Optional[str] = None  # "keys", "documents", "log_m"
    softcap: Optional[float] = None
    rate: int = 1  # a dilated branch's rows and query heads: every rate-th, from offset 1
    expect: str = "cuda_flash"

    @property
    def scores(self) -> int:
        """Elements of the block's scores over all its heads (what no fused route may allocate)."""
        return self.b * self.hq // self.rate * self.sq * self.sk


def block_cases() -> List[BlockCase]:
    """Every kind of block the ring, dilated branches, packed documents and decoding make, with its CUDA route."""
    bf = torch.bfloat16
    return [
        BlockCase("dense causal, diagonal block", bf, 4096, 4096, causal=True),
        BlockCase("dense, an earlier rank's half shard", bf, 4096, 2048),
        BlockCase("sliding window across a shard border", bf, 2048, 2048, band=(-511, 1024)),
        BlockCase("sliding window, partial band", bf, 2048, 2048, band=(-300, 200)),
        BlockCase("causal band of an offset block", bf, 2048, 3072, band=(None, 1024)),
        BlockCase("dilated branch: strided rows and query heads", bf, 4096, 4096, causal=True, rate=2),
        BlockCase("dilated branch, partial band", bf, 2048, 2048, band=(None, 512), rate=4),
        BlockCase("multi-query (1 K/V head)", bf, 4096, 4096, hkv=1, causal=True),
        BlockCase("fp16 dense causal", torch.float16, 4096, 4096, causal=True),
        BlockCase("fp32 dense causal", torch.float32, 4096, 4096, causal=True, expect="cuda_efficient"),
        BlockCase("fp32 earlier block", torch.float32, 4096, 2048, expect="cuda_efficient"),
        BlockCase("fp32 sliding window", torch.float32, 2048, 2048, band=(-511, 1024), expect="cuda_efficient"),
        BlockCase("fp32 causal band of a whole shard (masked in tiles)", torch.float32, 4096, 4096, hq=8, hkv=2,
                  d=64, band=(None, 1024), expect="cuda_efficient"),
        BlockCase("padded keys", bf, 2048, 2048, b=2, causal=True, mask="keys", expect="cuda_efficient"),
        BlockCase("packed documents", bf, 1024, 1024, mask="documents", expect="cuda_efficient"),
        BlockCase("dilated inside documents (log m bias)", bf, 512, 512, mask="log_m", rate=2,
                  expect="cuda_efficient"),
        BlockCase("decoding over a cache", bf, 1, 16384),
        BlockCase("decoding over a padded cache", bf, 1, 16384, b=2, mask="keys", expect="cuda_efficient"),
        BlockCase("soft-capping (no fused kernel takes it)", bf, 2048, 2048, causal=True, softcap=30.0,
                  expect="math"),
    ]


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    kw: Dict = field(default_factory=dict)


def _rows_major(b: int, h: int, s: int, d: int, dtype, device) -> torch.Tensor:
    """A ``(B, H, S, D)`` view of ``(B, S, H, D)`` memory: how the model's projections lay q, k, v out."""
    return torch.randn(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)


def _every(x: torch.Tensor, dim: int, rate: int) -> torch.Tensor:
    return x if rate == 1 else aten.slice.Tensor(x, dim, 1, None, rate)


def make_inputs(case: BlockCase, device: str = "cuda") -> Inputs:
    """The block's tensors as the ring passes them: strided views of rows-major shards, a strided LSE slice."""
    r = case.rate
    q = _every(_every(_rows_major(case.b, case.hq, case.sq * r, case.d, case.dtype, device), 1, r), 2, r)
    kv_heads = case.hkv if case.hq // r >= case.hkv else case.hq // r
    k = _every(_rows_major(case.b, kv_heads, case.sk * r, case.d, case.dtype, device), 2, r)
    v = _every(_rows_major(case.b, kv_heads, case.sk * r, case.d, case.dtype, device), 2, r)
    dout = _every(_every(_rows_major(case.b, case.hq, case.sq * r, case.d, case.dtype, device), 1, r), 2, r)
    out = _every(_every(_rows_major(case.b, case.hq, case.sq * r, case.d, case.dtype, device), 1, r), 2, r)
    lse = _every(_every(torch.randn(case.b, case.hq, case.sq * r, device=device), 1, r), 2, r)
    kw: Dict = {"causal": case.causal, "band": case.band, "softcap": case.softcap}
    if case.mask == "keys":
        kw["mask"] = torch.ones(case.b, 1, case.sq, case.sk, dtype=torch.bool, device=device)
    elif case.mask == "documents":
        kw["mask"] = torch.ones(case.b, 1, case.sq, case.sk, dtype=torch.bool, device=device)
    elif case.mask == "log_m":
        kw["mask"] = torch.zeros(case.b, q.shape[1], case.sq, case.sk, dtype=torch.float32, device=device)
    return Inputs(q, k, v, dout, out, lse, kw)


@dataclass
class Run:
    fwd: OpSpy
    bwd: OpSpy
    inputs: Inputs
    result: Tuple[torch.Tensor, torch.Tensor]  # out, lse
    grads: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    @property
    def limit(self) -> int:
        """The most elements a fused route may allocate at once: twice the largest tensor it was handed (the
        ring hands masks of one tile at most), so a mask or scores of a whole larger block are caught."""
        given = [self.inputs.q, self.inputs.k, self.inputs.dout, self.inputs.kw.get("mask")]
        return 2 * max(t.numel() for t in given if t is not None)


def run(case: BlockCase, device: str = "cuda") -> Run:
    """The ops of one block's forward and of its backward (under ``FakeTensorMode`` when there is no GPU)."""
    inp = make_inputs(case, device)
    with warnings.catch_warnings():  # a fused kernel that refuses its block fails the run instead of falling back
        warnings.filterwarnings("error", message=kernels.FALLBACK_WARNING)
        with OpSpy() as fwd:
            result = kernels.block_forward(inp.q, inp.k, inp.v, scale=case.d ** -0.5, **inp.kw)
        with OpSpy() as bwd:
            grads = kernels.block_backward(inp.dout, inp.q, inp.k, inp.v, inp.out, inp.lse, scale=case.d ** -0.5,
                                           **inp.kw)
    return Run(fwd, bwd, inp, result, grads)


def _tensors(call: Call, idx) -> List[torch.Tensor]:
    return [call.args[i] for i in idx]


def contract_problems(call: Call, case: BlockCase) -> List[str]:
    """What a fused call was given that the CUDA kernel would refuse or misread."""
    problems = []
    name = call.op
    if name.startswith("_flash_attention"):
        backward = name.endswith("backward")
        data = _tensors(call, range(5) if backward else range(3))
        heads_of_k = call.args[2 if backward else 1].shape[2]  # (B, S, H, D)
        heads_of_q = call.args[1 if backward else 0].shape[2]
        if backward:
            lse = call.args[5]
            if lse.dtype != torch.float32 or lse.dim() != 3 or not lse.is_contiguous():
                problems.append("flash backward: logsumexp not fp32, 3-D and contiguous")
            if call.args[6] is not None or call.args[7] is not None:
                problems.append("flash backward: cum_seq_q/k given, which selects the varlen kernel")
        elif call.args[3] is not None or call.args[4] is not None:
            problems.append("flash forward: cum_seq_q/k given for a dense block")
    else:
        backward = name.endswith("backward")
        data = _tensors(call, (0, 1, 2, 3, 5) if backward else (0, 1, 2))
        heads_of_q, heads_of_k = call.args[1 if backward else 0].shape[1], call.args[2 if backward else 1].shape[1]
        if heads_of_q != heads_of_k:
            problems.append("efficient attention: query and key head counts differ")
        bias = call.args[4 if backward else 3]
        if bias is not None:
            if bias.dtype != data[0].dtype or bias.stride(-1) != 1 or bias.stride(2) % 16:
                problems.append("efficient attention: bias not in q's dtype with rows aligned to 16")
        if backward:
            lse = call.args[6]
            if lse.dtype != torch.float32 or lse.dim() != 3 or not lse.is_contiguous() or lse.shape[-1] % 32:
                problems.append("efficient backward: logsumexp not fp32, contiguous, rows padded to 32")
            for t, what in ((call.args[0], "dout"), (call.args[5], "out")):
                if t.transpose(1, 2).stride(2) != t.shape[-1]:
                    problems.append(f"efficient backward: {what} heads not head_dim apart")
    if len({t.dtype for t in data}) != 1:
        problems.append(f"{name}: q, k, v (out, dout) in different dtypes")
    if any(t.stride(-1) != 1 for t in data):
        problems.append(f"{name}: an input with a non-contiguous last dimension")
    expected_kv = case.hkv if case.hq // case.rate >= case.hkv else case.hq // case.rate
    if heads_of_k != expected_kv and not (name.startswith("_scaled") and heads_of_k == heads_of_q):
        problems.append(f"{name}: K/V reached the kernel with {heads_of_k} heads, not their own {expected_kv}")
    return problems


def check(case: BlockCase, fwd: OpSpy, bwd: OpSpy, limit: Optional[int] = None) -> None:
    """Raise AssertionError unless the block ran its expected route, forward and backward, as the module says.

    ``limit``: the most elements one fused-route allocation may hold (:attr:`Run.limit`).
    """
    for spy, phase, i in ((fwd, "forward", 0), (bwd, "backward", 1)):
        ops = spy.ops()
        math = sorted(set(ops) & MATH_OPS)
        if case.expect == "math":
            assert math, f"{case.name}: {phase} expected the math path, ran {sorted(set(ops))}"
            limit = case.b * case.hq * kernels.MATH_TILE ** 2
            biggest = max((_numel(s) for c in spy.calls for s, _ in c.outputs), default=0)
            assert biggest <= 4 * limit, f"{case.name}: {phase} allocated {biggest} elements, beyond its tiles"
            continue
        fused = [c for c in spy.calls if c.op == FUSED[case.expect][i]]
        assert fused, f"{case.name}: {phase} did not run {FUSED[case.expect][i]} (ran {sorted(set(ops))})"
        assert not math, f"{case.name}: {phase} ran the math path ({math})"
        for c in fused:
            problems = contract_problems(c, case)
            assert not problems, f"{case.name}: {phase}: {problems}"
        biggest = max((_numel(s) for c in spy.calls for s, _ in c.outputs), default=0)
        assert biggest < max(case.scores, 1) or case.sq * case.sk <= kernels.MATH_TILE ** 2, (
            f"{case.name}: {phase} allocated {biggest} elements, as many as the block's scores ({case.scores})")
        assert limit is None or biggest <= limit, (
            f"{case.name}: {phase} allocated {biggest} elements, more than twice what it was handed ({limit // 2})")


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Fake ``device="cuda"`` tensors: CUDA kernels' shape functions run, no GPU needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):
        yield


def routes(device: str = "cuda", fake: bool = True) -> List[Dict]:
    """Each block kind's route and checked outcome, for the benchmark's table."""
    rows = []
    for case in block_cases():
        ctx: Callable = fake_cuda if fake else contextlib.nullcontext
        with ctx():
            got = run(case, device)
        fwd, bwd = got.fwd, got.bwd
        try:
            check(case, fwd, bwd, got.limit)
            ok = "yes"
        except AssertionError as err:
            ok = f"no: {err}"
        names = {op for spy in (fwd, bwd) for op in spy.ops()}
        taken = [k for k, (f, b) in FUSED.items() if f in names or b in names] or ["math"]
        rows.append({"block": case.name, "dtype": str(case.dtype).replace("torch.", ""), "kernel": taken[0],
                     "expected": case.expect, "checked": ok})
    return rows
