"""Sequence tiling: the causal-LM loss, the MLP and the RMSNorms of a model family run over chunks of rows.

``apply(model_or_class)`` patches, at class level (reversible, idempotent), the
``...ForCausalLM.forward`` to compute the loss with
:func:`hf_ring.training.loss.tiled_causal_lm_loss` (no ``(rows x vocab)`` logits), and
the ``forward`` of the MLP and RMSNorm classes to run through
:func:`hf_ring.training.mlp.tiled_rows` (their intermediates exist for one chunk of rows;
only their input is kept for the backward).

Whether a call is tiled is read at call time from ``model.config.ring_tiling``
(set with :func:`configure`): ``None`` (the default) tiles a model that runs
``ring_dilated`` attention under sequence parallelism with more than one rank
(another model beside it, a teacher or a reference model on ``sdpa``, runs
exactly as transformers runs it), ``True`` always, ``False`` never. A tiled
loss step returns ``loss`` and ``logits=None``; the untiled forward (with
logits) runs when no labels are given, when ``return_logits=True`` is passed,
or when the call needs something the tiled loss does not reproduce
(``logits_to_keep``, a wrapped ``lm_head``, a custom loss function).

The tiled loss stands in for a forward's own loss only where it is measured to
give the same numbers (:func:`reproduction_problem`: a tiny model of the class,
its own forward against the tiled loss), never where the forward's source
merely looks familiar; a class that fails keeps its own loss, with one warning
naming the family, the transformers release and the cost.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
import transformers
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from hf_ring.engine.arguments import positive_int
from hf_ring.integration.config import runs_ring
from hf_ring.integration.groups import current

from . import registry, reproduction, router_loss
from .families import FAMILIES
from .hybrids import HYBRIDS
from .tiled_loss import tiled_causal_lm_loss
from .tiled_rows import tiled_rows, zero3_partitioned

CONFIG_KEY = "ring_tiling"
SETTINGS = ("loss", "mlp", "norm", "loss_chunk_rows", "row_chunk_rows")
RETURN_LOGITS = "return_logits"
WHY = "loss, MLP and norm tiled over rows, so a long shard's logits and activations are never whole"
_CONFIG_REF = "_hf_ring_tiling_config"
"""Set on MLP and norm modules (by :func:`configure`, or by the CausalLM's first forward, which marks itself with
it too): the model config holding their settings."""

TILED: Dict[str, Tuple[str, str, str, str]] = {
    name: (family.modeling, *family.tiled) for table in (FAMILIES, HYBRIDS) for name, family in table.items()
    if family.tiled}
"""Families whose CausalLM forward, MLP and norm are known to fit the tiled versions (module, class names),
from the family tables (a hybrid's own table: its recurrent layers are computed apart)."""

_WARNED: set = set()
"""(class, reason) pairs already warned about: a family that stands down says so once per process."""


@torch.compiler.disable  # runs a tiny model of the class, once: outside a compiled graph
def reproduction_problem(cls: type, config: Any = None) -> Optional[str]:
    """Why the tiled loss does not reproduce ``cls.forward``'s loss and gradients, or None when it does
    (measured on a tiny model: :func:`.reproduction.problem`)."""
    return reproduction.problem(cls, config, registry.original(cls, "forward"), _tiled_loss, CONFIG_KEY)


def _family(cls: type, config: Any) -> str:
    model_type = getattr(config, "model_type", None) or getattr(cls.config_class, "model_type", "?")
    return f"{cls.__name__} (model type {model_type!r}, transformers {transformers.__version__})"


def _stand_down_message(cls: type, config: Any, why: str) -> str:
    return (f"hf_ring does not tile the loss of {_family(cls, config)}: {why}. That family trains with the untiled "
            "loss, whose rows x vocab logits exist whole on each rank; attention, the MLP and norm tiling and every "
            "other family are unaffected")


def _refusal(cls: type, config: Any, why: str) -> TypeError:
    return TypeError(f"ring_tiling loss=True cannot be honoured for {_family(cls, config)}: {why}; "
                     "train it with ring_tiling loss=False (configure_tiling(model, loss=False))")


def settings(config: Any) -> Dict[str, Any]:
    """The tiling settings of a config, every key present (None = default)."""
    got = getattr(config, CONFIG_KEY, None) or {}
    return {k: got.get(k) for k in SETTINGS}


def configure(model: nn.Module, *, loss: Optional[bool] = None, mlp: Optional[bool] = None,
              norm: Optional[bool] = None, loss_chunk_rows: Optional[int] = None,
              row_chunk_rows: Optional[int] = None) -> None:
    """Set ``model.config.ring_tiling`` (saved with the model) and patch the model's classes.

    ``loss``, ``mlp``, ``norm`` (the RMSNorms): ``None`` tiles under sequence
    parallelism only, ``True`` always, ``False`` never. ``loss_chunk_rows``
    defaults to a 128 MiB logits budget, ``row_chunk_rows`` (MLP and norms) to
    8192 rows.
    """
    for name, value in (("loss", loss), ("mlp", mlp), ("norm", norm)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True, False or None, got {value!r}")
    for name, value in (("loss_chunk_rows", loss_chunk_rows), ("row_chunk_rows", row_chunk_rows)):
        if value is not None:
            positive_int(value, name, "or None")
    apply(model, loss=loss, mlp=mlp is not False, norm=norm is not False)  # a class told False is not checked
    model.config.ring_tiling = {"loss": loss, "mlp": mlp, "norm": norm, "loss_chunk_rows": loss_chunk_rows,
                                "row_chunk_rows": row_chunk_rows}
    _point_rows_at_config(model)


def _point_rows_at_config(model: nn.Module) -> None:
    """Give the model's MLP and norm modules its config: norms carry none of their own."""
    _, mlp_cls, norms = _classes(model)
    for module in model.modules():
        if type(module) is mlp_cls or type(module) in norms:
            setattr(module, _CONFIG_REF, model.config)


def _on(setting: Optional[bool], config: Any) -> bool:
    if setting is not None:
        return setting
    sp = current()
    return sp is not None and sp.sp_size > 1 and config is not None and runs_ring(config)


def _output_hooks(module: nn.Module) -> list:
    """The forward hooks of ``module`` that may change what it computes (the tiled loss would bypass them).

    DeepSpeed ZeRO-3 hooks every module to gather its parameters and release them: those change nothing, and the
    engine gathers a weight the tiled loss reads directly as an external parameter of the calling module.
    """
    hooks = list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
    if zero3_partitioned(module.parameters()):
        hooks = [h for h in hooks if not getattr(h, "__module__", "").startswith("deepspeed.")]
    return hooks


def _loss_is_standard(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    return (type(head) is nn.Linear and not _output_hooks(head)
            and ("forward" not in vars(head) or _tensor_parallel(head))
            and model.loss_function is ForCausalLMLoss)


def _tensor_parallel(head: nn.Module) -> bool:
    """Whether tensor parallelism split the head (it replaces the instance's forward): the tiled loss then reads
    the weight whole (:func:`_whole`) instead of its ``rows x vocab`` logits, which the head would gather."""
    return isinstance(head.weight, DTensor) and "tp" in (head.weight.device_mesh.mesh_dim_names or ())


def _whole(t: Any) -> Any:
    """A tensor-parallel weight gathered whole (its gradient goes back to this rank's shard), else as it is.

    Every rank of a tp group computes the loss of the same rows, so the gathered weight's gradients agree and
    the shard keeps its slice of them."""
    return t.full_tensor() if isinstance(t, DTensor) else t


_OUTPUT_FIELDS = frozenset(f.name for f in dataclasses.fields(CausalLMOutputWithPast)) - {"loss", "logits"}
_MOE_FIELDS = frozenset(f.name for f in dataclasses.fields(MoeCausalLMOutputWithPast)) - {"loss", "aux_loss", "logits"}
_VERDICT = "_hf_ring_tiling_verdict"
"""Set on a model by its first tiled-eligible forward: :func:`reproduction_problem` for its class and config."""


def _tiled_loss(model: nn.Module, signature: inspect.Signature, args: tuple, kwargs: Dict[str, Any]):
    """The CausalLM's loss from its decoder's last hidden state, with the tiled loss (a mixture of experts' router
    term added, :func:`router_loss.router_term`); that router term (None: none); and the decoder's outputs.

    The call is bound to the original forward's own signature and handed to the decoder by the names it has
    there, so a renamed argument (the cache's, say) travels as the release names it."""
    call = signature.bind(model, *args, **kwargs).arguments
    extra = {}
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            extra = call.pop(name, {})
    call.pop(next(iter(signature.parameters)))  # self
    labels = call.pop("labels", None)
    call.pop("logits_to_keep", None)
    outputs = model.model(**call, **extra)
    router = router_loss.router_term(model, getattr(outputs, "router_logits", None), call.get("attention_mask"))
    loss = tiled_causal_lm_loss(
        outputs.last_hidden_state, _whole(model.lm_head.weight), _whole(model.lm_head.bias), labels=labels,
        shift_labels=extra.get("shift_labels"), num_items_in_batch=extra.get("num_items_in_batch"),
        ignore_index=extra.get("ignore_index", -100),
        softcap=getattr(model.config, "final_logit_softcapping", None),
        chunk_rows=settings(model.config)["loss_chunk_rows"])
    if router is not None:  # a mixture of experts' load-balancing term, as its own forward adds it
        loss = loss + router_loss.coefficient(model) * router.to(loss.device)
    return loss, router, outputs


def _tiled_causal_lm_forward(original):
    signature = inspect.signature(inspect.unwrap(original))

    @can_return_tuple
    def tiled(self, *args, **kwargs):
        loss, router, outputs = _tiled_loss(self, signature, args, kwargs)
        if router is None:
            return CausalLMOutputWithPast(loss=loss, logits=None,
                                          **{k: v for k, v in outputs.items() if k in _OUTPUT_FIELDS})
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=router, logits=None,
                                         **{k: v for k, v in outputs.items() if k in _MOE_FIELDS})

    def forward(self, *args, **kwargs):
        return_logits = kwargs.pop(RETURN_LOGITS, False)
        if _CONFIG_REF not in self.__dict__:  # once per model: its MLPs and norms read the switches from its config
            _point_rows_at_config(self)
            setattr(self, _CONFIG_REF, self.config)
        call = signature.bind(self, *args, **kwargs).arguments
        keep = call.get("logits_to_keep", 0)
        asked = settings(self.config)["loss"]
        if (call.get("labels") is None or return_logits or not _on(asked, self.config)
                or not (isinstance(keep, int) and keep == 0) or not _loss_is_standard(self)):
            return original(self, *args, **kwargs)
        if _VERDICT not in self.__dict__:  # this model's own config, checked once (the same on every rank)
            why = reproduction_problem(type(self), self.config)
            self.__dict__[_VERDICT] = why
            if why is not None and asked is not True:
                _stand_down(type(self), self.config, why)
        why = self.__dict__[_VERDICT]
        if why is not None:
            if asked is True:
                raise _refusal(type(self), self.config, why)
            return original(self, *args, **kwargs)
        return tiled(self, *args, **kwargs)

    forward.__wrapped__ = original
    forward.__doc__ = original.__doc__
    return forward


def _row_aligned(x: Any, args: tuple) -> bool:
    """Whether every positional argument after ``x`` is a tensor of its rows (a gated norm's gate)."""
    return all(isinstance(a, torch.Tensor) and a.shape[:-1] == x.shape[:-1] for a in args)


def _tiled_rows_forward(switch: str):
    def make(original):
        def forward(self, x, *args, **kwargs):
            config = getattr(self, _CONFIG_REF, None) or getattr(self, "config", None)
            opts = settings(config)
            if kwargs or not _row_aligned(x, args) or not _on(opts[switch], config):
                return original(self, x, *args, **kwargs)
            params = [p for p in self.parameters() if p.requires_grad]
            return tiled_rows(lambda rows, *more: original(self, rows, *more), x, params, opts["row_chunk_rows"],
                              others=args)

        forward.__wrapped__ = original
        return forward

    return make


def _patch(cls: type, make) -> None:
    registry.replace(cls, "forward", make, WHY)


def _unpatch(cls: type) -> None:
    registry.restore(cls, "forward")


def _classes(model_or_class: Any) -> Tuple[type, Optional[type], Tuple[type, ...]]:
    """The CausalLM class, its MLP class and its norm classes (the RMSNorm, then any gated norm of a hybrid's
    recurrent layers the table names), from a model, a CausalLM class or a family name."""
    if isinstance(model_or_class, str):
        if model_or_class not in TILED:
            raise ValueError(f"no tiling entry for model type {model_or_class!r}; known: {', '.join(sorted(TILED))}")
        module, causal, mlp, *norms = TILED[model_or_class]
        mod = importlib.import_module(module)
        return getattr(mod, causal), getattr(mod, mlp), tuple(getattr(mod, n) for n in norms)
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    mlp_cls, norms = None, ()
    entry = next((e for e in TILED.values() if cls.__name__ == e[1] and cls.__module__ == e[0]), None)
    if isinstance(model_or_class, nn.Module):
        layers = getattr(getattr(model_or_class, "model", None), "layers", None)
        if layers is not None and len(layers):
            mlp_cls = type(getattr(layers[0], "mlp", None))
            norms = (type(getattr(layers[0], "input_layernorm", None)),)
        if entry is not None and norms and norms[0] is not type(None):
            mod = importlib.import_module(entry[0])
            norms += tuple(getattr(mod, n) for n in entry[4:])
    elif entry is not None:
        mod = importlib.import_module(entry[0])
        mlp_cls, norms = getattr(mod, entry[2]), tuple(getattr(mod, n) for n in entry[3:])
    return cls, (mlp_cls if mlp_cls is not type(None) else None), tuple(n for n in norms if n is not type(None))


_MLPS = {entry[2] for entry in TILED.values()}
_NORMS = {name for entry in TILED.values() for name in entry[3:]}
"""The MLP and norm class names of :data:`TILED`: the row-wise ones tiling takes."""


def _check_rowwise(cls: type, kind: str, known: set) -> None:
    if cls.__name__ not in known:
        raise TypeError(f"{cls.__name__} is not a known row-wise {kind} (known: {', '.join(sorted(known))}); "
                        f"tiling it could change its result (e.g. a mixture of experts); pass {kind.lower()}=False")


def apply(model_or_class: Any, *, loss: Optional[bool] = True, mlp: bool = True, norm: bool = True,
          check_now: bool = True) -> None:
    """Patch the CausalLM class, and its MLP and RMSNorm classes unless told not to, of a model, class or family.

    The CausalLM's loss is patched only where :func:`reproduction_problem` finds the tiled loss exact for it
    (checked with the model's own config when given a model): ``loss=True`` raises TypeError naming the family
    and the transformers release where it is not, ``loss=None`` warns once and leaves that loss untiled,
    ``loss=False`` leaves it alone. ``check_now=False`` leaves the check to each model's first tiled forward
    (which runs it with the model's config either way), so patching a family no model of which runs costs nothing.
    """
    cls, mlp_cls, norms = _classes(model_or_class)
    config = getattr(model_or_class, "config", None) if isinstance(model_or_class, nn.Module) else None
    why = None if loss is False or (loss is None and not check_now) else reproduction_problem(cls, config)
    if why is not None and loss is True:
        raise _refusal(cls, config, why)
    mlp_cls = mlp_cls if mlp else None
    norms = norms if norm else ()
    if mlp_cls is not None:
        _check_rowwise(mlp_cls, "MLP", _MLPS)
    for norm_cls in norms:
        _check_rowwise(norm_cls, "Norm", _NORMS)
    if why is not None:
        _stand_down(cls, config, why)
    elif loss is not False:
        _patch(cls, _tiled_causal_lm_forward)
    if mlp_cls is not None:
        _patch(mlp_cls, _tiled_rows_forward("mlp"))
    for norm_cls in norms:
        _patch(norm_cls, _tiled_rows_forward("norm"))


def _stand_down(cls: type, config: Any, why: str) -> None:
    """Warn, once per class and reason, that a family's loss runs untiled."""
    if (cls, why) not in _WARNED:
        _WARNED.add((cls, why))
        warnings.warn(_stand_down_message(cls, config, why), stacklevel=3)


def revert(model_or_class: Any) -> None:
    """Undo :func:`apply` for a model, class or family name."""
    cls, mlp_cls, norms = _classes(model_or_class)
    for patched in (cls, mlp_cls, *norms):
        if patched is not None:
            _unpatch(patched)


def is_applied(model_or_class: Any) -> bool:
    return registry.is_replaced(_classes(model_or_class)[0], "forward")


def apply_all() -> None:
    """Patch every family in :data:`TILED` (what sequence-parallel setup calls); a family whose loss the tiled
    loss does not reproduce on this transformers release keeps its own loss, with one warning at its first model's
    tiled forward (checked there, not here: a tiny model of every family would be built at every setup, and a
    hybrid's would run its kernels, whose fallback messages a user of another family has no use for)."""
    for name in TILED:
        apply(name, loss=None, check_now=False)


def revert_all() -> None:
    for name in TILED:
        revert(name)
