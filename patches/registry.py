"""Every change hf_ring makes outside itself, in one place: what was replaced, where, why, and the original.

No change hf_ring makes to other code is visible from that code, so each one
goes through here and :func:`applied` lists what stands changed right now:

- :func:`replace` changes an attribute until it is undone: ``import hf_ring``
  guards ``PreTrainedModel.__call__`` (kept); :func:`hf_ring.setup_sequence_parallel`
  and a split model's first call patch rotary, CausalLM, MLP and norm classes
  and a hybrid's decoder layers; :func:`hf_ring.prepare_trainer` swaps a
  trainer's class and methods. :func:`restore` / :func:`restore_all` put every
  one back by identity (the original attribute exactly as its owner held it).
- :func:`scoped` changes one for the length of a ``with`` block: a hybrid's
  kernels bound to their hooks while one decoder layer runs over shards, a
  sampling trainer's accelerator and TRL's gathers while it samples, a
  distillation trainer's backbone call while it computes a loss.

Like the classes it changes, the record belongs to the process: one table here.
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Tuple

_ABSENT = object()
"""An attribute the owner inherited rather than held: restoring it deletes the replacement."""


@dataclass(frozen=True)
class Patch:
    """One replaced attribute: ``owner.name`` was ``original`` (as the owner itself held it) before hf_ring."""

    owner: Any
    name: str
    original: Any
    why: str
    kept: bool = False
    """True for the import-time guard: :func:`restore_all` leaves it unless asked (``everything=True``)."""

    def __str__(self) -> str:
        if isinstance(self.owner, (type, types.ModuleType)):
            name = self.owner.__name__ if isinstance(self.owner, types.ModuleType) else \
                f"{self.owner.__module__}.{self.owner.__qualname__}"
            target = f"{name}.{self.name}"
        else:  # an instance: named by its class (the class it had, for its __class__)
            cls = self.original if self.name == "__class__" else type(self.owner)
            target = f"a {cls.__module__}.{cls.__qualname__} instance's {self.name}"
        return f"{target}: {self.why}"


_APPLIED: Dict[Tuple[int, str], Patch] = {}


def _own(owner: Any, name: str) -> Any:
    if isinstance(owner, type):
        return owner.__dict__.get(name, _ABSENT)
    if name == "__class__" or not hasattr(owner, "__dict__"):
        return getattr(owner, name)  # an instance's __class__: always its own
    return vars(owner).get(name, _ABSENT)  # an instance's method comes from its class: nothing of its own to keep


def replace(owner: Any, name: str, make: Callable[[Any], Any], why: str, kept: bool = False) -> bool:
    """Set ``owner.name`` to ``make(current value)`` and record it; False (nothing done) when already replaced."""
    key = (id(owner), name)
    if key in _APPLIED:
        return False
    patch = Patch(owner, name, _own(owner, name), why, kept)
    setattr(owner, name, make(getattr(owner, name)))
    _APPLIED[key] = patch
    return True


def is_replaced(owner: Any, name: str) -> bool:
    """Whether ``owner.name`` itself (not a base class's) is hf_ring's replacement."""
    return (id(owner), name) in _APPLIED


def original(owner: Any, name: str) -> Any:
    """What ``owner.name`` resolves to without hf_ring's replacement or a scope's binding (the inherited value when
    it held none)."""
    for scope in _SCOPED:  # the outermost binding holds what was there before any
        if scope.owner is owner and scope.name == name and scope.original is not _ABSENT:
            return scope.original
    patch = _APPLIED.get((id(owner), name))
    if patch is None:
        return getattr(owner, name)
    if patch.original is not _ABSENT:
        return patch.original
    return getattr(super(owner, owner), name)  # type: ignore[arg-type]


def restore(owner: Any, name: str) -> bool:
    """Put ``owner.name`` back exactly as it was; False when hf_ring had not replaced it."""
    patch = _APPLIED.pop((id(owner), name), None)
    if patch is None:
        return False
    if patch.original is _ABSENT:
        delattr(owner, name)
    else:
        setattr(owner, name, patch.original)
    return True


_SCOPED: List[Patch] = []
"""The changes of :func:`scoped` blocks running now, innermost last."""


@contextlib.contextmanager
def scoped(owner: Any, name: str, value: Any, why: str) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the block (listed by :func:`applied` meanwhile) and put back exactly as
    it was on leaving it, an exception included."""
    patch = Patch(owner, name, _own(owner, name), why)
    setattr(owner, name, value)
    _SCOPED.append(patch)
    try:
        yield
    finally:
        _SCOPED[:] = [p for p in _SCOPED if p is not patch]
        if patch.original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, patch.original)


def applied() -> List[Patch]:
    """Every change hf_ring has made and not undone, oldest first; then those of the :func:`scoped` blocks running
    now."""
    return list(_APPLIED.values()) + list(_SCOPED)


def restore_all(everything: bool = False) -> None:
    """Undo every change, newest first; the import-time guard stays unless ``everything``."""
    for patch in reversed(applied()):
        if everything or not patch.kept:
            restore(patch.owner, patch.name)
