from typing import Callable, Dict, List, Optional

import torch

RECORDING: List[Dict[str, float]] = []
"""While ``pytest --record-errors FILE`` runs, one dict per running test: per norm, the largest error :func:`close`
was given (conftest.py writes them out). Empty otherwise."""


def close(err: float, tol: float, norm: str = "max") -> bool:
    """``err <= tol``: a relative error against an independent reference, within its tolerance.

    ``err`` is also kept as the running test's measured error for ``pytest
    --record-errors`` (``python -m bench exactness``), so a figure the docs
    give is the one the test asserted on; ``norm`` says how it was measured:
    ``"max"`` for ``max|a - b| / max|b|`` (:func:`rel_err`), ``"l2"`` for
    ``||a - b|| / ||b||`` (:func:`norm_rel_err`).
    """
    if RECORDING:
        kept = RECORDING[-1]
        kept[norm] = max(kept.get(norm, 0.0), err)
    return err <= tol


def rel_err(got: torch.Tensor, ref: torch.Tensor, zero_scale: Optional[float] = None) -> float:
    """Relative error of one tensor: ``max|got - ref| / max|ref|``.

    No floor: a tensor of small values (e.g. the gradient of an attention
    projection, ~1e-4) is held to the same relative bound as one of O(1)
    values. When the reference is exactly zero there is no scale of its own:
    the result is 0.0 if ``got`` is exactly zero too and inf otherwise, unless
    the caller names ``zero_scale``, the size of the terms whose exact
    cancellation makes the reference zero (floating point cannot cancel them
    exactly, so ``got`` is measured against them).
    """
    if got.shape != ref.shape:
        raise AssertionError(f"shapes differ: got {tuple(got.shape)}, reference {tuple(ref.shape)}")
    if not ref.numel():
        return 0.0
    diff = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    if scale == 0.0:
        scale = zero_scale or 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def scalar_rel_err(got: float, want: float) -> float:
    """``|got - want| / |want|`` of two numbers (a loss, a count); when ``want`` is zero, 0.0 if ``got`` is zero too
    and inf otherwise."""
    diff, scale = abs(float(got) - float(want)), abs(float(want))
    return diff / scale if scale else (0.0 if diff == 0.0 else float("inf"))


def norm_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` of one tensor in float64 (inf when the reference is zero and ``got`` is not)."""
    if got.shape != ref.shape:
        raise AssertionError(f"shapes differ: got {tuple(got.shape)}, reference {tuple(ref.shape)}")
    diff, scale = (got.double() - ref.double()).norm().item(), ref.double().norm().item()
    return diff / scale if scale else (0.0 if diff == 0.0 else float("inf"))


def dilated_sdpa_mask(n: int, branches, heads: int) -> torch.Tensor:
    """A 4-D additive mask ``(1, heads, n, n)`` of ``log m`` (LongNet multiplicities, -inf where 0).

    Given as ``attention_mask`` to a transformers ``sdpa`` or ``eager`` model it makes that
    model compute dilated attention with transformers' own code: an implementation of the
    dilated model independent of hf_ring (the multiplicities come from tests/reference.py).
    """
    from reference import dilated_multiplicity

    return torch.stack([torch.log(dilated_multiplicity(n, branches, h).double()) for h in range(heads)]).float()[None]


def cancelling_scale(name, q, k, v, dout):
    """The size of the terms that cancel when dq or dk is exactly zero (e.g. one key per query).

    With one key per softmax row, dS = P * (dout·v - rowsum(dout * out)) is the difference
    of two equal O(|dout||v|) numbers: exactly 0, but fp32 leaves rounding of that size,
    times the scaled q or k it multiplies. Only used where the reference is exactly zero.
    """
    if name not in ("dq", "dk"):
        return None
    other = k if name == "dq" else q
    terms = (dout.double() * v.double().repeat_interleave(q.shape[1] // v.shape[1], 1)).sum(-1).abs().max()
    return float(terms * other.double().abs().max() / q.shape[-1] ** 0.5)


def worst_rel_err(got: dict, ref: dict, err: Callable[[torch.Tensor, torch.Tensor], float] = rel_err) -> float:
    """The largest ``err`` (:func:`rel_err`, or :func:`norm_rel_err`) over tensors of the same names (e.g. every
    parameter gradient)."""
    assert got.keys() == ref.keys() and ref, (sorted(got), sorted(ref))
    return max(err(got[k], ref[k]) for k in ref)


def raises_on_rank(fn, *args, **kwargs):
    """Run fn and return (exception type name, message), or None if it did not raise (for rank functions, whose
    exceptions the pool would otherwise raise in the test)."""
    try:
        fn(*args, **kwargs)
    except Exception as err:  # the test inspects type and message
        return type(err).__name__, str(err)
    return None


def cancelling(name, grads):
    """The scale of the terms that cancel in a bias gradient that is zero in exact arithmetic (a key projection's
    bias: the softmax does not change when one query's scores all move together): its weight's gradient, made of
    the same per-pair terms. Only where the bias gradient is below a millionth of it; None otherwise."""
    if not name.endswith(".bias") or name[:-5] + ".weight" not in grads:
        return None
    weight = grads[name[:-5] + ".weight"].abs().max().item()
    return weight if 0 < weight and grads[name].abs().max().item() <= 1e-6 * weight else None


def gradient_errors(got: dict, want: dict) -> dict:
    """Each gradient's relative error (one that cancels to zero in exact arithmetic: against its terms' scale)."""
    errs = {}
    for name, g in want.items():
        scale = cancelling(name, want)
        errs[name] = rel_err(got[name], g) if scale is None else (got[name] - g).abs().max().item() / scale
    return errs
