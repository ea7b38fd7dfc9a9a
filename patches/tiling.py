"""Sequence tiling: the causal-LM loss, the MLP and the RMSNorms of a model family run over chunks of rows.

``apply(model_or_class)`` patches, at class level (reversible, idempotent), the
``...ForCausalLM.forward`` to compute the loss with
:func:`hf_ring.loss.tiled_causal_lm_loss` (no ``(rows x vocab)`` logits), and
the ``forward`` of the MLP and RMSNorm classes to run through
:func:`hf_ring.mlp.tiled_rows` (their intermediates exist for one chunk of rows;
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
"""
from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, Dict, Optional, Tuple

from torch import nn
from torch.distributed.tensor import DTensor

from hf_ring.arguments import positive_int
from hf_ring.config import runs_ring
from hf_ring.groups import current
from hf_ring.loss import tiled_causal_lm_loss
from hf_ring.mlp import tiled_rows
from hf_ring.zero import zero3_partitioned

from .families import FAMILIES

CONFIG_KEY = "ring_tiling"
SETTINGS = ("loss", "mlp", "norm", "loss_chunk_rows", "row_chunk_rows")
RETURN_LOGITS = "return_logits"
_ORIGINAL = "_hf_ring_tiling_original_forward"
_CONFIG_REF = "_hf_ring_tiling_config"
"""Set on MLP and norm modules (by :func:`configure`, or by the CausalLM's first forward, which marks itself with
it too): the model config holding their settings."""

TILED: Dict[str, Tuple[str, str, str, str]] = {
    name: (family.modeling, *family.tiled) for name, family in FAMILIES.items() if family.tiled}
"""Families whose CausalLM forward, MLP and norm are known to fit the tiled versions (module, class names),
from the one family table."""

# The lines of a standard CausalLM forward that touch logits or the loss; a
# forward with any other such line (a logit scale, say) is not tiled.
_STANDARD_LINES = {
    "logits_to_keep: int | torch.Tensor = 0,",
    "hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)",
    "logits = self.lm_head(hidden_states)",
    "loss = None",
    "loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)",
    "loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)",
    "loss=loss,",
    "logits=logits,",
    # Gemma-style final soft cap, reproduced by the tiled loss.
    "if self.config.final_logit_softcapping is not None:",
    "logits = logits / self.config.final_logit_softcapping",
    "logits = torch.tanh(logits)",
    "logits = logits * self.config.final_logit_softcapping",
}


def _forward_lines(fn) -> set:
    src = re.sub(r'[rbuRBU]?"""[\s\S]*?"""', "", inspect.getsource(inspect.unwrap(fn)))
    return {line.strip() for line in src.splitlines() if re.search(r"logit|lm_head|loss", line)}


def check_standard_forward(cls: type) -> None:
    """Raise TypeError unless ``cls.forward`` is the standard decoder CausalLM forward the tiled loss reproduces."""
    original = cls.__dict__.get(_ORIGINAL, cls.forward)
    params = inspect.signature(inspect.unwrap(original)).parameters
    missing = [p for p in ("input_ids", "labels", "logits_to_keep", "inputs_embeds") if p not in params]
    extra = sorted(_forward_lines(original) - _STANDARD_LINES)
    if missing or extra or "self.model(" not in inspect.getsource(inspect.unwrap(original)):
        why = f"missing arguments {missing}" if missing else f"it computes logits or loss differently: {extra}"
        raise TypeError(f"{cls.__name__}.forward is not the standard CausalLM forward the tiled loss reproduces "
                        f"({why}); train it with ring_tiling loss=False")


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
    apply(model)
    model.config.ring_tiling = {"loss": loss, "mlp": mlp, "norm": norm, "loss_chunk_rows": loss_chunk_rows,
                                "row_chunk_rows": row_chunk_rows}
    _point_rows_at_config(model)


def _point_rows_at_config(model: nn.Module) -> None:
    """Give the model's MLP and norm modules its config: norms carry none of their own."""
    _, mlp_cls, norm_cls = _classes(model)
    for module in model.modules():
        if type(module) in (mlp_cls, norm_cls):
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
    from transformers.loss.loss_utils import ForCausalLMLoss

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


def _tiled_causal_lm_forward(original):
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils.generic import can_return_tuple

    signature = inspect.signature(inspect.unwrap(original))

    @can_return_tuple
    def tiled(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
              inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             **kwargs)
        opts = settings(self.config)
        loss = tiled_causal_lm_loss(
            outputs.last_hidden_state, _whole(self.lm_head.weight), _whole(self.lm_head.bias), labels=labels,
            shift_labels=kwargs.get("shift_labels"), num_items_in_batch=kwargs.get("num_items_in_batch"),
            ignore_index=kwargs.get("ignore_index", -100),
            softcap=getattr(self.config, "final_logit_softcapping", None), chunk_rows=opts["loss_chunk_rows"])
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)

    def forward(self, *args, **kwargs):
        return_logits = kwargs.pop(RETURN_LOGITS, False)
        if _CONFIG_REF not in self.__dict__:  # once per model: its MLPs and norms read the switches from its config
            _point_rows_at_config(self)
            setattr(self, _CONFIG_REF, self.config)
        call = signature.bind(self, *args, **kwargs).arguments
        keep = call.get("logits_to_keep", 0)
        if (call.get("labels") is None or return_logits or not _on(settings(self.config)["loss"], self.config)
                or not (isinstance(keep, int) and keep == 0) or not _loss_is_standard(self)):
            return original(self, *args, **kwargs)
        return tiled(self, *args, **kwargs)

    forward.__wrapped__ = original
    forward.__doc__ = original.__doc__
    return forward


def _tiled_rows_forward(switch: str):
    def make(original):
        def forward(self, x, *args, **kwargs):
            config = getattr(self, _CONFIG_REF, None) or getattr(self, "config", None)
            opts = settings(config)
            if args or kwargs or not _on(opts[switch], config):
                return original(self, x, *args, **kwargs)
            params = [p for p in self.parameters() if p.requires_grad]
            return tiled_rows(lambda rows: original(self, rows), x, params, opts["row_chunk_rows"])

        forward.__wrapped__ = original
        return forward

    return make


def _patch(cls: type, make) -> None:
    if _ORIGINAL in cls.__dict__:
        return
    original = cls.forward
    setattr(cls, _ORIGINAL, original)
    cls.forward = make(original)


def _unpatch(cls: type) -> None:
    original = cls.__dict__.get(_ORIGINAL)
    if original is not None:
        cls.forward = original
        delattr(cls, _ORIGINAL)


def _classes(model_or_class: Any) -> Tuple[type, Optional[type], Optional[type]]:
    """The CausalLM class, its MLP class and its RMSNorm class, from a model, a CausalLM class or a family name."""
    if isinstance(model_or_class, str):
        if model_or_class not in TILED:
            raise ValueError(f"no tiling entry for model type {model_or_class!r}; known: {', '.join(sorted(TILED))}")
        module, causal, mlp, norm = TILED[model_or_class]
        mod = importlib.import_module(module)
        return getattr(mod, causal), getattr(mod, mlp), getattr(mod, norm)
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    mlp_cls = norm_cls = None
    if isinstance(model_or_class, nn.Module):
        layers = getattr(getattr(model_or_class, "model", None), "layers", None)
        if layers is not None and len(layers):
            mlp_cls = type(getattr(layers[0], "mlp", None))
            norm_cls = type(getattr(layers[0], "input_layernorm", None))
    else:
        for module, causal, mlp, norm in TILED.values():
            if cls.__name__ == causal and cls.__module__ == module:
                mod = importlib.import_module(module)
                mlp_cls, norm_cls = getattr(mod, mlp), getattr(mod, norm)
    return cls, (mlp_cls if mlp_cls is not type(None) else None), (norm_cls if norm_cls is not type(None) else None)


def _check_rowwise(cls: type, kind: str, index: int) -> None:
    known = {entry[index] for entry in TILED.values()}
    if cls.__name__ not in known:
        raise TypeError(f"{cls.__name__} is not a known row-wise {kind} (known: {', '.join(sorted(known))}); "
                        f"tiling it could change its result (e.g. a mixture of experts); pass {kind.lower()}=False")


def apply(model_or_class: Any, *, mlp: bool = True, norm: bool = True) -> None:
    """Patch the CausalLM class, and its MLP and RMSNorm classes unless told not to, of a model, class or family."""
    cls, mlp_cls, norm_cls = _classes(model_or_class)
    check_standard_forward(cls)
    mlp_cls = mlp_cls if mlp else None
    norm_cls = norm_cls if norm else None
    if mlp_cls is not None:
        _check_rowwise(mlp_cls, "MLP", 2)
    if norm_cls is not None:
        _check_rowwise(norm_cls, "Norm", 3)
    _patch(cls, _tiled_causal_lm_forward)
    if mlp_cls is not None:
        _patch(mlp_cls, _tiled_rows_forward("mlp"))
    if norm_cls is not None:
        _patch(norm_cls, _tiled_rows_forward("norm"))


def revert(model_or_class: Any) -> None:
    """Undo :func:`apply` for a model, class or family name."""
    for cls in _classes(model_or_class):
        if cls is not None:
            _unpatch(cls)


def is_applied(model_or_class: Any) -> bool:
    return _ORIGINAL in _classes(model_or_class)[0].__dict__


def apply_all() -> None:
    """Patch every family in :data:`TILED` (what sequence-parallel setup calls)."""
    for name in TILED:
        apply(name)


def revert_all() -> None:
    for name in TILED:
        revert(name)
