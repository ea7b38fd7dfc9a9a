"""Every change hf_ring makes outside itself, in one place: what was replaced, where, why, and the original.

hf_ring changes other code in three ways, each defensible, none visible from
a model's own code: ``import hf_ring`` guards ``PreTrainedModel.__call__``;
:func:`hf_ring.setup_sequence_parallel` patches the rotary, CausalLM, MLP and
norm classes of the tested families; :func:`hf_ring.prepare_trainer` swaps the
trainer's class. Each goes through :func:`replace`, which keeps the original
attribute exactly as its owner held it, so :func:`applied` lists them and
:func:`restore` / :func:`restore_all` put every one back by identity.

Like the classes it changes, the record belongs to the process: one table here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

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
        owner = self.owner if isinstance(self.owner, type) else type(self.original)
        where = f"{owner.__module__}.{owner.__qualname__}"
        target = f"{where}.{self.name}" if isinstance(self.owner, type) else f"a {where} instance's {self.name}"
        return f"{target}: {self.why}"


_APPLIED: Dict[Tuple[int, str], Patch] = {}


def _own(owner: Any, name: str) -> Any:
    if isinstance(owner, type):
        return owner.__dict__.get(name, _ABSENT)
    return getattr(owner, name)  # an instance's __class__: always its own


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
    """What ``owner.name`` resolves to without hf_ring's replacement (the inherited value when it held none)."""
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


def applied() -> List[Patch]:
    """Every change hf_ring has made and not undone, oldest first."""
    return list(_APPLIED.values())


def restore_all(everything: bool = False) -> None:
    """Undo every change, newest first; the import-time guard stays unless ``everything``."""
    for patch in reversed(applied()):
        if everything or not patch.kept:
            restore(patch.owner, patch.name)
