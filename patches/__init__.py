"""What a model needs for sequence-sharded runs (shipped as ``hf_ring.patches``).

Two questions, both answered from the model itself where possible, once per
model object (:func:`needs`):

* Can its sequence be split? :func:`check_supported` refuses models whose
  layers mix tokens other than through what hf_ring computes (state-space and
  linear-attention layers of a family :mod:`.hybrids` does not hook,
  convolutions, attention outside transformers' interface) with a ValueError
  naming the model type and the reason.
* What must change while it is split? Length-dependent RoPE (``dynamic``,
  ``longrope``) must see the global length, and a hybrid's recurrent layers
  must pass their state between ranks: :func:`apply`, the one place this is
  installed, patches the class of every rotary module of a model (:mod:`.rope`)
  and hooks a hybrid family's decoder layers (:mod:`.hybrids`), reversibly.
  Outside sequence parallelism the patched classes behave exactly like the
  unpatched ones. A query scale by position (Llama 4's temperature tuning) is
  moved to the shard's global positions by the backend (:func:`at_global_positions`).

The tested families (:mod:`.families`) are patched up front by
:func:`apply_all`, which ``setup_sequence_parallel`` calls before any model is
loaded; a model of another family is checked the same way, and gets a
warning that it is untested.

Every change hf_ring makes outside itself (these patches, the import-time
guard of ``PreTrainedModel.__call__``, a prepared trainer's class and methods,
and the scoped ones: a hybrid's kernels for one layer's call, a sampling
trainer's accelerator while it samples) is recorded in :mod:`.registry`:
:func:`applied` lists them, :func:`revert_all` (which ``clear_sequence_parallel``
calls) puts the lasting ones back by identity.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from . import hybrids, registry, rope, structure, tiling
from .families import FAMILIES, MULTIMODAL, Family, Multimodal
from .temperature import at_global_positions

from .registry import Patch, applied

__all__ = ["FAMILIES", "MULTIMODAL", "Family", "Multimodal", "Needs", "Patch", "applied", "apply", "apply_all",
           "at_global_positions", "check_supported", "is_applied", "multimodal_problem", "needs", "revert",
           "revert_all", "rotary_modules", "supported"]


def supported() -> Tuple[str, ...]:
    """Model types tested under sequence parallelism (others pass :func:`check_supported` with a warning)."""
    return tuple(sorted(FAMILIES))


def _config(model_or_config: Any):
    return model_or_config.config if isinstance(model_or_config, torch.nn.Module) else model_or_config


def _model_type(model_or_config: Any) -> str:
    if isinstance(model_or_config, str):
        return model_or_config
    config = _config(model_or_config)
    return getattr(config, "model_type", None) or type(model_or_config).__name__


def tested() -> Tuple[str, ...]:
    """Every model type tested under sequence parallelism: the decoder families, the multimodal ones and their
    language models, the hybrids whose recurrent layers hf_ring computes over shards."""
    decoders = {t for m in MULTIMODAL.values() for t in m.decoders}
    return tuple(sorted(set(FAMILIES) | set(MULTIMODAL) | decoders | set(hybrids.HYBRIDS)))


def _decoder(model_or_config: Any) -> Any:
    """What a multimodal model splits: its language model (or that model's config)."""
    if isinstance(model_or_config, torch.nn.Module):
        return model_or_config.get_decoder()
    return model_or_config.get_text_config(decoder=True)


def check_supported(model_or_config: Any) -> str:
    """Return the model type if its sequence can be split; raise ValueError naming the type and the reason.

    Takes a model (config and modules are checked) or its config (the config,
    and whether its causal-LM class uses transformers' attention interface).
    A multimodal model of a tested family (:data:`MULTIMODAL`) is checked by
    its language model, the part whose sequence is split.
    """
    model_type = _model_type(model_or_config)
    if isinstance(model_or_config, str):
        if model_type not in tested():
            raise ValueError(f"model type {model_type!r} is not a tested family ({', '.join(tested())}); "
                             "pass the model or its config so that its structure can be checked")
        return model_type
    target = _decoder(model_or_config) if model_type in MULTIMODAL else model_or_config
    found = structure.problems(target)
    if isinstance(target, torch.nn.Module):
        found += _rotary_problems(target)
    if found:
        raise ValueError(f"model type {model_type!r} cannot run with its sequence split across ranks: "
                         + "; ".join(found))
    if model_type not in tested():
        warnings.warn(f"model type {model_type!r} passes hf_ring's structural checks but is not among the tested "
                      f"families ({', '.join(tested())}); compare a sharded run with an unsharded one before "
                      "relying on it", stacklevel=2)
    return model_type


def multimodal_problem(model: torch.nn.Module, given_media: bool = True) -> Optional[str]:
    """Why ``model`` cannot have its sequence split as a multimodal model (None: it can, see :data:`MULTIMODAL`);
    ``given_media``: it was handed images, so a text model is refused too."""
    model_type = _model_type(model)
    if model_type in MULTIMODAL:
        return None
    name = f"{type(model).__name__} (model type {model_type!r})"
    if structure.multimodal_keys(_config(model)):
        return (f"{name} is a multimodal family whose sequence split is not tested (tested: "
                f"{', '.join(sorted(MULTIMODAL))}); train its language model alone, or run it in one process")
    if not given_media:
        return None
    return (f"{name} takes no images, but the batch given to hf_ring.shard_batch holds them (pixel_values or "
            "video); shard a text batch for it")


def _rotary_problems(model: torch.nn.Module) -> List[str]:
    """Rotary modules whose length-dependent RoPE the global-length patch cannot reach."""
    return [
        f"{type(m).__name__} has RoPE type {t!r}, which reads the call's length, but its forward is not "
        "transformers' dynamic_rope_update, so the shards' lengths cannot be made global"
        for m in rotary_modules(model) for t in rope.rope_types(m)
        if rope.is_length_dependent(t) and not rope.reads_call_length(type(m))
    ]


def rotary_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Every rotary embedding module of ``model``."""
    return list(rope.rotary_modules(model))


def _rotary_classes(model_or_type: Any) -> Tuple[type, ...]:
    if isinstance(model_or_type, torch.nn.Module):
        return tuple(dict.fromkeys(type(m) for m in rope.rotary_modules(model_or_type)))
    model_type = _model_type(model_or_type)
    if model_type not in FAMILIES:
        raise ValueError(f"model type {model_type!r} is not a tested family ({', '.join(supported())}); "
                         "pass the model instance, whose rotary modules are found from its structure")
    return FAMILIES[model_type].rotary_classes()


class Needs(NamedTuple):
    """What a model object needs to have its sequence split, worked out once (:func:`needs`)."""

    error: Optional[ValueError]  # why its sequence cannot be split (:func:`check_supported`); None: it can
    rotary: Tuple[type, ...]  # its rotary classes, which see the global length while it is split
    hybrid: Optional[hybrids.HybridFamily]  # its hybrid family, whose kernels are hooked; None: no recurrent layer
    counting: Optional[torch.nn.Module]  # the embeddings that count its positions from its padding


_NEEDS: "weakref.WeakKeyDictionary[torch.nn.Module, Needs]" = weakref.WeakKeyDictionary()
"""Per model object, its :class:`Needs`: its modules do not change between forwards, and the check walks all of
them."""


def needs(model: torch.nn.Module) -> Needs:
    """What ``model`` needs to have its sequence split (:class:`Needs`), once per model object."""
    if model not in _NEEDS:
        try:
            check_supported(model)
            error = None
        except ValueError as err:
            error = err
        hybrid = hybrids.family(_model_type(model))  # the table names a multimodal type beside its text one
        if hybrid is not None and not any(type(m).__name__ in hybrid.mixers for m in model.modules()):
            hybrid = None  # a hybrid type configured with attention layers only
        _NEEDS[model] = Needs(error, _rotary_classes(model), hybrid, structure.counting_embeddings(model))
    return _NEEDS[model]


def apply(model_or_type: Any) -> None:
    """Install what a model (or a tested family, by type or config) needs while its sequence is split: its rotary
    classes see the global length, its recurrent layers' kernels are hooked. The one place hooks are installed.

    A model that cannot be split raises its :func:`check_supported` error. Reversible with :func:`revert_all`,
    idempotent (made again after :func:`revert_all` undid it).
    """
    if isinstance(model_or_type, torch.nn.Module):
        found = needs(model_or_type)
        if found.error is not None:
            raise found.error
        rotary, hybrid = found.rotary, found.hybrid
    else:
        rotary, hybrid = _rotary_classes(model_or_type), hybrids.family(_model_type(model_or_type))
    for cls in rotary:
        rope.patch_rotary(cls)
    if hybrid is not None:
        hybrids.apply(hybrid)


def revert(model_or_type: Any) -> None:
    """Undo :func:`apply` for this model's (or family's) rotary classes."""
    for cls in _rotary_classes(model_or_type):
        rope.unpatch_rotary(cls)


def is_applied(model_or_type: Any) -> bool:
    """Whether every rotary class that reads the call's length is patched."""
    return all(rope.is_patched(cls) for cls in _rotary_classes(model_or_type) if rope.reads_call_length(cls))


def apply_all() -> None:
    """Patch the rotary classes of every tested family and the sequence tiling of the families it
    knows (before any model exists); tiling then switches on under sequence parallelism."""
    for family in FAMILIES.values():
        family.apply()
    tiling.apply_all()


def revert_all() -> None:
    """Undo every change hf_ring made outside itself (:func:`applied`) but the import-time guard of
    ``PreTrainedModel.__call__``: rotary and tiling patches, a prepared trainer's class."""
    registry.restore_all()
