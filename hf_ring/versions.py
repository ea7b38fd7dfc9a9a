"""The torch, transformers and accelerate releases hf_ring is tested on, checked before any of them is imported.

hf_ring reaches into transformers' internals (attention and mask registries,
cache classes, rotary classes, CausalLM forwards, tensor-parallel plans),
which change between minor releases. Every release inside :data:`SUPPORTED`
runs the compatibility suite (``tests/test_compat.py``, the floor job of
``.ci/run``); a release outside it is refused at ``import hf_ring`` with one
line naming the installed version, the range and the fix, instead of a
``ModuleNotFoundError`` or a silently different result deep inside a forward.
"""
from __future__ import annotations

import os
import re
import warnings
from importlib import metadata
from typing import Dict, Optional, Tuple

SUPPORTED: Dict[str, Tuple[str, str]] = {
    "torch": ("2.11", "2.14"),
    "transformers": ("5.17", "5.25"),
    "accelerate": ("1.10.1", "1.16"),
}
"""Per package, the tested releases as ``[lowest, first untested)``; pyproject.toml states the same ranges."""
ALLOW_UNTESTED = "HF_RING_ALLOW_UNTESTED"
"""Set to 1 to import hf_ring beside an untested release anyway, with a warning instead of the refusal."""


def parse(version: str) -> Tuple[int, ...]:
    """``"5.17.0"``, ``"2.11.0+cu130"``, ``"5.25.0.dev0"`` -> the leading release numbers, ``(5, 17, 0)``."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"cannot read a release number from version {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def within(version: str, low: str, high: str) -> bool:
    """Whether ``low <= version < high``, on release numbers (a local tag such as ``+cu130`` is ignored)."""
    got = parse(version)
    return parse(low) <= got < parse(high)


def installed(package: str) -> Optional[str]:
    """The installed version of ``package`` (from its metadata, without importing it), or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def problem(package: str, version: Optional[str]) -> Optional[str]:
    """One line saying why ``version`` of ``package`` is refused, or None when it is supported."""
    low, high = SUPPORTED[package]
    if version is not None and within(version, low, high):
        return None
    found = "is not installed" if version is None else f"{version} is installed"
    return (f"hf_ring needs {package}>={low},<{high} (the releases it is tested on), but {found}; "
            f"fix: pip install '{package}>={low},<{high}'")


def check_installed() -> None:
    """Raise ImportError, one line per refused package, unless every package is in :data:`SUPPORTED`.

    With ``HF_RING_ALLOW_UNTESTED=1`` an untested release that is installed only warns (a missing one still
    raises): the exactness checks of the test suite are then the user's to run."""
    found = {p: installed(p) for p in SUPPORTED}
    lines = [line for line in (problem(p, v) for p, v in found.items()) if line is not None]
    if not lines:
        return
    if os.environ.get(ALLOW_UNTESTED) == "1" and all(v is not None for v in found.values()):
        warnings.warn("; ".join(lines) + f" ({ALLOW_UNTESTED}=1: importing anyway)", stacklevel=3)
        return
    raise ImportError("\n".join(f"{line} (or set {ALLOW_UNTESTED}=1 to try it untested)" for line in lines))
