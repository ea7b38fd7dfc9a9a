import torch

# Inputs in the tests are unit-normal, so outputs and gradients are O(1). When
# a reference tensor is (nearly) zero, e.g. dq of a row that sees one key, the
# error is measured against this floor instead of against ~0.
SCALE_FLOOR = 1.0


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error over the reference's scale (its max abs value, at least SCALE_FLOOR)."""
    scale = max(ref.abs().max().item() if ref.numel() else 0.0, SCALE_FLOOR)
    return (got.double() - ref.double()).abs().max().item() / scale


def strict_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error over the reference's max abs value; a reference exactly zero must be matched exactly."""
    diff = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return diff / scale if scale > 0 else diff
