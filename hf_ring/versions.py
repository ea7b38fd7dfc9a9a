"""The torch, transformers and accelerate releases hf_ring is tested on, checked before any of them is imported.

A library's policy, not an application's: :data:`FLOORS` are the oldest
releases tested (pyproject.toml declares the same floors and nothing above
them, so pip never replaces a user's newer torch), :data:`NEWEST_TESTED` the
newest, and :data:`KNOWN_BROKEN` the releases known to break hf_ring. At
``import hf_ring``:

- a release below its floor is refused in one line naming it and the fix;
- a release known to break is refused in one line naming what breaks;
- a newer, untested release imports with one warning naming it and the
  newest tested release, and how to silence the warning (on the first rank of
  a launch only: every rank imports hf_ring).

What bends on an unknown release is checked where it is used, and fails
loudly with the family and release named: the transformers internals hf_ring
reads (:mod:`hf_ring.integration.seams`), the mask pieces it reads (:mod:`hf_ring.integration.masks`,
each checked against its meaning) and the tiled loss (measured against the
class's own, :mod:`hf_ring.patches.tiling`).
"""
from __future__ import annotations

import os
import re
import warnings
from importlib import metadata
from typing import Dict, Optional, Tuple

FLOORS: Dict[str, str] = {"torch": "2.11", "transformers": "5.17", "accelerate": "1.10.1"}
"""Per package, the oldest release tested; pyproject.toml declares these floors."""
NEWEST_TESTED: Dict[str, str] = {"torch": "2.15.0", "transformers": "5.25.0", "accelerate": "1.16.0"}
"""Per package, the newest release the compatibility rows (docs/bench/compat.json) were run on."""
KNOWN_BROKEN: Dict[Tuple[str, str], str] = {}
"""``(package, release)`` -> what breaks with it (pyproject.toml excludes each with ``!=``)."""
QUIET = "HF_RING_QUIET_UNTESTED"
"""Set to 1 to silence the warning about a release newer than the newest tested one."""


class UntestedReleaseWarning(UserWarning):
    """A torch, transformers or accelerate release newer than the newest hf_ring was tested on."""


def parse(version: str) -> Tuple[int, ...]:
    """``"5.17.0"``, ``"2.11.0+cu130"``, ``"5.25.0.dev0"`` -> the leading release numbers, ``(5, 17, 0)``."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"cannot read a release number from version {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def _padded(version: str, width: int = 3) -> Tuple[int, ...]:
    numbers = parse(version)
    return numbers + (0,) * (width - len(numbers))


def installed(package: str) -> Optional[str]:
    """The installed version of ``package`` (from its metadata, without importing it), or None."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def problem(package: str, version: Optional[str]) -> Optional[str]:
    """One line saying why ``version`` of ``package`` is refused, or None when it may be imported."""
    low = FLOORS[package]
    if version is None:
        return f"hf_ring needs {package}>={low}, which is not installed; fix: pip install '{package}>={low}'"
    if _padded(version) < _padded(low):
        return (f"hf_ring needs {package}>={low} (the oldest release it is tested on), but {version} is "
                f"installed; fix: pip install '{package}>={low}'")
    broken = KNOWN_BROKEN.get((package, ".".join(map(str, parse(version)))))
    if broken is not None:
        return (f"{package} {version} is known to break hf_ring: {broken}; fix: install another release, "
                f"e.g. pip install '{package}=={NEWEST_TESTED[package]}'")
    return None


def untested(package: str, version: Optional[str]) -> Optional[str]:
    """The warning for ``version`` of ``package`` when it is of a minor release newer than the newest tested one
    (a patch release of a tested minor release is tested), else None."""
    if version is None or _padded(version)[:2] <= _padded(NEWEST_TESTED[package])[:2]:
        return None
    return (f"{package} {version} is newer than the newest release hf_ring is tested on "
            f"({NEWEST_TESTED[package]}); run `python -m bench compat --suite` in a checkout to check it "
            f"here (set {QUIET}=1 to silence this warning)")


def check_installed() -> None:
    """Raise ImportError, one line per refused package; warn once for each release newer than the newest tested (on
    rank 0 of a launch, or where no launcher set ``RANK``)."""
    found = {p: installed(p) for p in FLOORS}
    lines = [line for line in (problem(p, v) for p, v in found.items()) if line is not None]
    if lines:
        raise ImportError("\n".join(lines))
    if os.environ.get(QUIET) == "1" or os.environ.get("RANK", "0") != "0":
        return  # said once a launch: every rank of a torchrun or accelerate launch imports hf_ring
    for package, version in found.items():
        told = untested(package, version)
        if told is not None:
            warnings.warn(told, UntestedReleaseWarning, stacklevel=3)
