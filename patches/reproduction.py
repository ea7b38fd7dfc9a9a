"""Whether the tiled loss reproduces a CausalLM class's own loss, measured on a tiny model of the class.

Releases and families change a CausalLM forward's loss in ways no source
reading follows (a logit scale, a router term, an inlined slice), so the tiled
loss stands in for a class's own only where one tiny model of it, with every
optional loss term on, gives the same loss and every parameter gradient.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

_CHECK_SIZES = {"vocab_size": 61, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 1,
               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
"""The tiny model the reproduction check builds from a config: every other setting kept as the config has it."""
LOSS_SWITCHES: Dict[str, Any] = {"output_router_logits": True}
"""Config switches that add a term to a CausalLM's loss: the check turns each one on, so a term the tiled loss
leaves out shows."""
CHECK_TOLERANCE = 1e-5
"""Largest relative difference per tensor (loss, every parameter gradient) the check accepts; a logit scale or a
loss term the reproduction lacks differs by orders of magnitude more."""
_VERDICTS: Dict[Tuple[type, Any, str], Optional[str]] = {}
"""Memo of :func:`reproduction_problem`: the check runs once per class, original forward and config."""


def _tiny_model(cls: type, config: Any, own_key: str) -> nn.Module:
    """A float32 ``cls`` of small layers, one of each kind ``config.layer_types`` names, with ``config``'s other
    settings, eager attention and weights large enough that every logit transformation (caps, scales) changes the
    loss."""
    config = config if config is not None else cls.config_class()
    values = config.to_dict()
    values.update(_CHECK_SIZES)
    values.update({k: v for k, v in LOSS_SWITCHES.items() if k in values})
    if isinstance(values.get("layer_types"), list):  # one layer of each kind, in their order
        kinds = list(dict.fromkeys(values["layer_types"]))
        values["layer_types"], values["num_hidden_layers"] = kinds, len(kinds)
    values.pop(own_key, None)
    for key in [k for k in values if k.endswith("_token_id")]:
        values[key] = None  # the released ids lie outside the tiny vocabulary
    tiny = type(config).from_dict(values)
    tiny._attn_implementation = "eager"
    with torch.device("cpu"):
        model = cls(tiny).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def _loss_and_grads(model: nn.Module, loss_of) -> list:
    ids = torch.randint(0, _CHECK_SIZES["vocab_size"], (2, 7))
    labels = ids.clone()
    labels[0, :3] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    loss = loss_of(ids, labels)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [loss.detach()] + [g for g in grads if g is not None]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    return diff / scale if scale else (0.0 if diff == 0 else float("inf"))


def _check_reproduction(cls: type, config: Any, original: Callable, tiled_loss: Callable,
                        own_key: str) -> Optional[str]:
    signature = inspect.signature(inspect.unwrap(original))
    missing = [p for p in ("input_ids", "labels", "logits_to_keep") if p not in signature.parameters]
    if missing:
        return f"its forward takes no {missing}"
    # Seeded and forked: the check must not move the caller's random stream. Autocast, no_grad and a default
    # device would each change what the tiny model computes.
    with torch.random.fork_rng(devices=[]), torch.autocast("cpu", enabled=False), torch.enable_grad():
        torch.manual_seed(0)
        try:
            model = _tiny_model(cls, config, own_key)
            torch.manual_seed(1)
            want = _loss_and_grads(model, lambda ids, labels: original(model, input_ids=ids, labels=labels).loss)
            torch.manual_seed(1)
            got = _loss_and_grads(model, lambda ids, labels: tiled_loss(model, signature, (),
                                                                         {"input_ids": ids, "labels": labels})[0])
        except Exception as e:  # the check could not run: the tiled loss is not known to be right
            return f"the check on a tiny model could not run ({type(e).__name__}: {e})"
    if len(got) != len(want):
        return "its loss reaches parameters the tiled loss does not"
    worst = max(_relative(g, w) for g, w in zip(got, want))
    if worst > CHECK_TOLERANCE:
        return (f"on a tiny model its loss or a gradient differs from the tiled loss by {worst:.1e} relative (a logit "
                "scale, an extra loss term or another head)")
    return None


def _config_key(config: Any) -> str:
    return "" if config is None else config.to_json_string(use_diff=False)


def problem(cls: type, config: Any, original: Callable, tiled_loss: Callable, own_key: str) -> Optional[str]:
    """Why ``tiled_loss`` does not reproduce ``original``'s (``cls.forward`` unpatched) loss and gradients, or None.

    Measured, not read from the source: a tiny model of ``cls`` with ``config``'s settings (the class's default
    config when None) runs its own forward and the tiled loss on the same batch, with every optional loss term
    of :data:`LOSS_SWITCHES` on; ``own_key``, the config's tiling settings, is dropped. Memoised per class,
    original forward and config.
    """
    key = (cls, original, _config_key(config))
    if key not in _VERDICTS:
        _VERDICTS[key] = _check_reproduction(cls, config, original, tiled_loss, own_key)
    return _VERDICTS[key]
