"""A mixture-of-experts router's load-balancing loss over the whole sequence while it is split.

transformers' causal LMs add ``coef · load_balancing_loss_func(router_logits, E, k, attention_mask)`` to their
loss when ``output_router_logits`` is on: ``E · Σ_e f_e · P_e``, with ``f_e`` the share of (unmasked) token
slots routed to expert ``e`` and ``P_e`` its mean router probability, both means over every token of the batch
and every layer. Each rank holds its own tokens' router logits, so it sums its counts, probabilities and rows,
and one all-reduce of those sums per forward (all layers at once, as the function receives them) gives the
whole sequence's means. A rank's loss gets its share, ``E · Σ_e f_e · p_e / N`` with ``p_e`` its own
probability sums: the shares add up to the whole loss, and a share's gradient is the part of the whole
loss's gradient that flows through this rank's logits (``f_e`` has none), so gradients summed over the group
are one process's. The output's ``aux_loss`` is reported as transformers reports it, the whole sequence's
value, carrying the share's gradient (a trainer that adds it to a loss it computes whole, as TRL's DPO does,
gets one process's gradient the same way); a trainer that adds it to a rank's share of a token loss without
scaling it for the average over the ranks, as TRL's SFT does with its fused LM head, is handed it with that
gradient times the group's size (:func:`report`'s ``scale``).

The function is the modeling module's own name, read where the class's forward reads it: a family whose
function is not this loss (measured on random logits, not read from its source) or whose forward adds a
router term some other way is refused, naming the term.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from hf_ring.integration.context import ShardedForward

from . import registry

NAME = "load_balancing_loss_func"
"""The module function transformers' mixture-of-experts causal LMs compute their router loss with."""
OTHER_TERMS = ("aux_loss", "router_aux_loss_coef", "z_loss", "router_z_loss")
"""Names a forward that adds a router term reads (beside :data:`NAME`)."""
CHECK_TOLERANCE = 1e-6
_MATCHES: Dict[Callable, bool] = {}
"""Per module function, whether it is the load-balancing loss :func:`sums` reduces (measured once)."""


def sums(gate_logits: Tuple[torch.Tensor, ...], num_experts: int, top_k: int,
         weights: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over every layer's ``(rows, E)`` router logits: the (weighted) count of token slots routed to each expert,
    the (weighted) sum of each expert's router probability, and the (weighted) rows, in float32 as transformers
    sums them; ``weights``: one per row (None: every row counts once)."""
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    w = torch.ones(gate_logits[0].shape[0], dtype=torch.float32, device=device) if weights is None else \
        weights.to(device=device, dtype=torch.float32)  # every layer routes the same rows
    slots = w.repeat_interleave(top_k)
    for layer in gate_logits:
        routing = torch.softmax(layer.to(device), dim=-1)
        chosen = torch.topk(routing, top_k, dim=-1).indices
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), slots)
        probs = probs + (routing.float() * w.unsqueeze(-1)).sum(dim=0)
    return counts, probs, w.sum() * len(gate_logits)


def balancing_loss(counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``E · Σ_e (counts_e / rows) · (probs_e / rows)``."""
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def _weights(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if attention_mask is None else attention_mask.reshape(-1)


def _standard(gate_logits, num_experts, top_k, attention_mask):
    counts, probs, rows = sums(gate_logits, num_experts, top_k, _weights(attention_mask))
    return balancing_loss(counts, probs, rows, num_experts)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / scale if scale else float((got != want).any())


def matches(function: Callable) -> bool:
    """Whether ``function`` computes :func:`balancing_loss` (value and gradient of the logits), on two layers of
    random router logits with and without a padding mask; measured once per function."""
    if function not in _MATCHES:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(0)
            logits = tuple(torch.randn(12, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
            mask = torch.ones(2, 6, dtype=torch.long)
            mask[1, :2] = 0
            worst = 0.0
            try:
                for m in (None, mask):
                    got, want = function(logits, 6, 2, m), _standard(logits, 6, 2, m)
                    worst = max(worst, _relative(torch.as_tensor(got).detach(), want.detach()))
                    for g, w in zip(torch.autograd.grad(got, logits), torch.autograd.grad(want, logits)):
                        worst = max(worst, _relative(g, w))
            except Exception:  # noqa: BLE001 -- another signature: not this loss
                worst = float("inf")
        _MATCHES[function] = worst <= CHECK_TOLERANCE
    return _MATCHES[function]


def _module(cls: type) -> Any:
    return sys.modules.get(cls.__module__)


def _names(cls: type) -> Tuple[str, ...]:
    forward = inspect.unwrap(getattr(cls, "forward", None))
    return getattr(getattr(forward, "__code__", None), "co_names", ())


def function_of(cls: type) -> Optional[Callable]:
    """The module function ``cls``'s forward computes its router loss with, unreplaced (None: it calls none)."""
    module = _module(cls)
    if NAME not in _names(cls) or not callable(getattr(module, NAME, None)):
        return None
    return registry.original(module, NAME)


COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")
"""The names a causal LM keeps its router term's coefficient by (copied from its config when built)."""


def coefficient(model: torch.nn.Module) -> float:
    """The coefficient ``model``'s forward multiplies its router loss by (0.0: it has none)."""
    config = getattr(model, "config", None)
    for holder in (model, config):
        for name in COEFFICIENTS:
            value = getattr(holder, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return 0.0


def problem(model: torch.nn.Module, asked: Optional[bool] = None) -> Optional[str]:
    """Why ``model``'s router loss cannot be computed over shards (None: it can, or the call adds none);
    ``asked``: the call's ``output_router_logits`` (None: the config's)."""
    config = getattr(model, "config", None)
    coef = coefficient(model)
    wanted = getattr(config, "output_router_logits", False) if asked is None else asked
    if not (wanted and coef):
        return None
    cls = type(model)
    function = function_of(cls)
    if function is not None:
        if matches(function):
            return None
        return (f"output_router_logits=True adds {cls.__module__}.{NAME} (coefficient {coef}), which is not the "
                "Switch Transformer load-balancing loss hf_ring reduces over the sequence-parallel group; set "
                "config.output_router_logits=False to train with the sequence split")
    read = [n for n in OTHER_TERMS if n in _names(cls)]
    if read:
        return (f"output_router_logits=True adds a router term ({', '.join(read)}) that {cls.__name__}'s forward "
                f"computes without {NAME}, which hf_ring cannot reduce over the sequence-parallel group; set "
                "config.output_router_logits=False to train with the sequence split")
    return None


class ShardedRouterLoss:
    """A modeling module's load-balancing function for one sharded forward: each rank's share of the whole
    sequence's loss (see the module docstring), the whole sequence's value kept on the forward."""

    def __init__(self, forward: ShardedForward):
        self.forward = forward

    def __call__(self, gate_logits, num_experts=None, top_k=2, attention_mask=None):
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        weights = _weights(attention_mask)
        if self.forward.placeholder:  # a copy of row 0 no loss reads
            weights = torch.zeros(gate_logits[0].shape[0], dtype=torch.float32, device=gate_logits[0].device)
        counts, probs, rows = sums(gate_logits, num_experts, top_k, weights)
        totals = torch.cat([counts, probs.detach(), rows.reshape(1)])
        if self.forward.comm is not None:
            self.forward.comm.all_reduce(totals, "the router load-balancing sums over the sequence-parallel group")
        counts, whole_probs, rows = totals[:num_experts], totals[num_experts:-1], totals[-1]
        self.forward.router_loss = balancing_loss(counts, whole_probs, rows, num_experts)
        return balancing_loss(counts, probs, rows, num_experts)


WHY = ("computes a mixture-of-experts causal LM's router load-balancing loss over the whole sequence while its "
       "sequence is split, for the call of one sharded forward")


def _modules_read(model: torch.nn.Module) -> Tuple[Any, ...]:
    """The modules whose :data:`NAME` ``model``'s forward calls: its class's modeling module, and any module an
    instance's own forward imports it from (TRL's fused LM head reads Mixtral's)."""
    modules = [_module(type(model))] if function_of(type(model)) is not None else []
    for names in _own_forward_names(model):
        if NAME in names:  # ``from <module> import NAME``: the module is a name of the code too
            for name in names:
                module = _imported(name)
                if callable(getattr(module, NAME, None)) and module not in modules:
                    modules.append(module)
    return tuple(modules)


def _own_forward_names(model: torch.nn.Module) -> Iterator[Tuple[str, ...]]:
    """The names each function of an instance's own forward reads, down its ``__wrapped__`` chain (TRL's fused
    head wraps itself to look like the class's forward)."""
    function = vars(model).get("forward")
    function = getattr(function, "__func__", function)
    while function is not None:
        yield getattr(getattr(function, "__code__", None), "co_names", ())
        function = getattr(function, "__wrapped__", None)


def _imported(name: str) -> Any:
    """The transformers module ``name`` names (imported now: a forward that imports it on its first call would
    otherwise read the function unscoped), None for any other name."""
    if not name.startswith("transformers.models."):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@contextlib.contextmanager
def over_shards(model: torch.nn.Module, forward: ShardedForward) -> Iterator[None]:
    """Within the block, the load-balancing function ``model``'s forward calls computes over ``forward``'s
    shards."""
    modules = _modules_read(model) if forward.world_size > 1 else ()
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(registry.scoped(module, NAME, ShardedRouterLoss(forward), WHY))
        yield


_OPEN = "_hf_ring_router_scope"
"""Set on a model between :func:`enter` and :func:`leave`: the :func:`over_shards` block of its call."""


def enter(model: torch.nn.Module, forward: ShardedForward) -> None:
    """Open :func:`over_shards` for a call of ``model`` whose batch a forward pre-hook sharded (the trainers'):
    the call itself passed the model's guard unsharded. :func:`leave`, from a forward hook that runs however the
    call ends, closes it."""
    leave(model)  # a block a call left open (its end not seen) is closed first
    if not isinstance(forward, ShardedForward):
        return  # a multimodal forward, split where its language model starts: that call is a sharded call itself
    stack = contextlib.ExitStack()
    stack.enter_context(over_shards(model, forward))
    setattr(model, _OPEN, stack)


def leave(model: torch.nn.Module, forward: Optional[ShardedForward] = None, out: Any = None,
          scale: int = 1) -> Any:
    """Close what :func:`enter` opened for ``model``'s call; ``out`` (the call's output) reported as
    :func:`report` does with ``scale``."""
    stack = vars(model).pop(_OPEN, None)
    if stack is not None:
        stack.close()
    if not isinstance(forward, ShardedForward) or out is None:
        return out
    return report(out, forward, scale)


def whole(aux: Any, forward: Any, scale: int = 1) -> Any:
    """A rank's share ``aux`` of the router loss as the whole sequence's value, carrying ``scale`` times the
    share's gradient (``aux`` unchanged where ``forward`` computed no router loss)."""
    value = getattr(forward, "router_loss", None)
    if value is None or not isinstance(aux, torch.Tensor):
        return aux
    carried = aux * scale if scale != 1 else aux
    return carried + (value.to(aux) - carried).detach()


def report(out: Any, forward: ShardedForward, scale: int = 1) -> Any:
    """``out`` with its ``aux_loss`` the whole sequence's value (:func:`whole`, ``scale`` times the share's
    gradient: the caller knows how the loss it feeds is averaged over the ranks)."""
    if getattr(out, "aux_loss", None) is None or getattr(forward, "router_loss", None) is None:
        return out
    out.aux_loss = whole(out.aux_loss, forward, scale)
    return out


def router_term(model: torch.nn.Module, router_logits: Any, attention_mask: Optional[torch.Tensor]
                ) -> Optional[torch.Tensor]:
    """The router loss (before its coefficient) ``model``'s forward adds to its loss, for a loss made from its
    decoder's outputs (the tiled loss): its module function (over the shards inside :func:`over_shards`) with the
    model's own settings; None where the decoder returned no router logits or the model has no such function.
    Whether this is what the model's own forward adds is measured by the tiled loss's reproduction check."""
    if not router_logits or function_of(type(model)) is None:
        return None
    function = getattr(_module(type(model)), NAME)
    return function(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)
