"""One fingerprint for whatever the ranks compare by value: a batch, a prompt, options, the name of an exchange.

A fingerprint is a 31-bit integer, equal on every rank for equal values, so a
row of them travels in one small all-gather. Tensors are read where they live
(one weighted sum over their bit patterns, no copy to the host), anything else
by its ``repr``.
"""
from __future__ import annotations

import zlib
from typing import Any

import torch

MOD = 2147483647
"""2**31 - 1: fingerprints fit the int64 rows the ranks exchange, with room to spare."""

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _of_tensor(t: torch.Tensor) -> int:
    t = t.detach()
    if t.is_floating_point() or t.is_complex():
        t = t.contiguous().view(_BITS[t.element_size()])
    if t.dim() >= 2:
        t = t.long().sum(-1)  # per row first: the weighted sum below then runs over rows, not elements
    flat = t.reshape(-1).long()
    weights = (torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.long) * 2654435761) % MOD
    return int((flat * weights).sum() % MOD)


def fingerprint(*values: Any) -> int:
    """The fingerprint of ``values`` (tensors by their contents, anything else, None included, by its repr)."""
    total = 0
    for value in values:
        part = _of_tensor(value) if isinstance(value, torch.Tensor) else zlib.crc32(repr(value).encode())
        total = (total * 1000003 + part) % MOD
    return total
