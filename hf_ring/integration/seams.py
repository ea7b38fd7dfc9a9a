"""Where hf_ring meets a transformers internal that differs between the supported releases: one lookup per concern.

Each entry names the releases it was checked on (every minor release of
:data:`hf_ring.versions.SUPPORTED`); the CausalLM forward's loss, the other
internal that moves, is checked numerically by :mod:`hf_ring.patches.tiling`
instead of being looked up.

========================  ===========================================  ===================
concern                   lookup                                       checked on
========================  ===========================================  ===================
the cache keyword         ``cache`` from 5.24 (``past_key_values``     5.17 - 5.24
                          deprecated), ``past_key_values`` before
tensor parallelism of a   ``PreTrainedModel._resolve_parallel_plans``  5.17 - 5.24
loaded model              and the plan-taking
                          ``apply_tensor_parallelism``: 5.23 on
the Trainer's token count ``Trainer._get_num_items_in_batch`` divides  5.17 - 5.24
of a shared batch         by ``get_cp_size()`` from 5.19; before, by
                          accelerate's parallelism config alone
a Trainer over a model    the Trainer leaves a model sharded by        5.17 - 5.24
sharded at load time      ``from_pretrained(distributed_config=...)``
                          to itself from 5.19; before, it wraps its
                          DTensor parameters in DDP, which fails
activation checkpointing  ``activation_checkpointing_enable`` and      5.17 - 5.24
                          ``TrainingArguments(activation_checkpointing``
                          from 5.23 (``gradient_...`` deprecated),
                          ``gradient_checkpointing...`` before
where a layer is          a ``GradientCheckpointingLayer``'s           5.17 - 5.24
checkpointed              ``forward`` is wrapped when its class is
                          made from 5.23 (the wrapper checkpoints
                          only as the class's own ``forward``); its
                          ``__call__`` checkpoints before
which kernel a modeling   ``use_kernel_func_from_hub_with_fallback``   5.17 - 5.24
module's kernel function  puts a wrapper in its place that calls the
runs                      package function it found at import
                          (flash-linear-attention, causal-conv1d,
                          mamba-ssm), held in its closure
========================  ===========================================  ===================

The other internals hf_ring imports are the same on every supported release
and each is imported by one module: ``AttentionInterface`` and
``masking_utils`` (backend), ``cache_utils.Cache``/``DynamicLayer`` (cache),
``modeling_rope_utils.dynamic_rope_update`` (patches.rope),
``MODEL_FOR_CAUSAL_LM_MAPPING`` (patches.structure), ``ForCausalLMLoss``,
``CausalLMOutputWithPast`` and ``can_return_tuple`` (patches.tiling),
``GradientCheckpointingLayer`` (offload, and here), accelerate's
``DataLoaderDispatcher`` and ``recursively_apply`` (trainer).
"""
from __future__ import annotations

import dataclasses
import inspect
from types import CodeType
from typing import Any, Dict, Optional

import transformers
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, TrainingArguments
from transformers.integrations import hub_kernels
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..versions import parse

CACHE_NAMES = ("cache", "past_key_values")
"""The names a model's forward and ``generate`` take the KV cache by, newest first."""
STATE_NAMES = ("cache_params", "state")
"""Other names a model takes what it carries from an earlier call by: a state-space model's (Mamba's
``cache_params``, the cache's deprecated name from 5.24; RWKV's ``state``, a list of tensors)."""
CACHE_KEYWORD = next(name for name in CACHE_NAMES if name in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)})
"""What the installed transformers calls the cache, in forwards, ``generate`` and model outputs."""
TENSOR_PARALLEL_SINCE = "5.23"
TRAINER_KEEPS_LOADED_SHARDING_SINCE = "5.19"
TRAINER_DIVIDES_TOKEN_COUNT_SINCE = "5.19"


def since(release: str) -> bool:
    """Whether the installed transformers is ``release`` or newer."""
    return parse(transformers.__version__) >= parse(release)


TRAINER_DIVIDES_TOKEN_COUNT = since(TRAINER_DIVIDES_TOKEN_COUNT_SINCE)
"""Whether the Trainer's count of a batch's label tokens is divided by ``get_cp_size()``, the ranks that share the
batch; before 5.19 it divides by accelerate's parallelism config, which a sequence-parallel setup does not set."""
CHECKPOINTING_METHOD = next(name for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable")
                            if hasattr(PreTrainedModel, name))
"""The model method that turns activation (gradient) checkpointing on, by the installed release's name."""
CHECKPOINTING_ARGUMENT = next(name for name in ("activation_checkpointing", "gradient_checkpointing")
                              if name in {f.name for f in dataclasses.fields(TrainingArguments)})
"""The ``TrainingArguments`` field that turns it on."""


def enable_checkpointing(model: Any, **kwargs: Any) -> None:
    """Turn on ``model``'s activation checkpointing by whichever name the installed transformers gives it."""
    getattr(model, CHECKPOINTING_METHOD)(**kwargs)


def checkpointing_on(model: Any) -> bool:
    """Whether ``model``'s activation checkpointing is on (``is_activation_checkpointing`` from 5.23)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(model, name, None)  # on the instance: a PEFT wrapper hands attributes to its model
        if value is not None:
            return bool(value)
    return False


def cache_argument(kwargs: Dict[str, Any], pop: bool = False) -> Any:
    """The cache a call was given, under either name (the older one is still accepted where it is deprecated);
    ``pop``: both names are removed from ``kwargs``. A cache given under both names is a ValueError."""
    given = [name for name in CACHE_NAMES if kwargs.get(name) is not None]
    if len(given) > 1:
        raise ValueError(f"pass the cache once: got both {given[0]} and {given[1]}")
    cache = kwargs[given[0]] if given else None
    if pop:
        for name in CACHE_NAMES:
            kwargs.pop(name, None)
    return cache


def holds_nothing(kwargs: Dict[str, Any]) -> bool:
    """Whether what a call was given to carry on from (its cache under any name, :data:`STATE_NAMES`) holds no rows
    and no recurrent state yet: a prefill's, or none (the model makes a new one if it caches). Read by the layers of
    transformers' caches (their rows, a linear-attention layer's ``has_previous_state``); anything else given
    counts as holding something."""
    given = [kwargs[name] for name in CACHE_NAMES + STATE_NAMES if kwargs.get(name) is not None]
    return all(_empty(cache) for cache in given)


def _empty(cache: Any) -> bool:
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return False
    for layer in layers:
        if any(getattr(layer, "has_previous_state", {}).values()):
            return False
        rows = getattr(layer, "get_seq_length", None)
        if rows is not None and rows() > 0:
            return False
    return True


def generate_cache_problem(model: Any) -> Optional[str]:
    """Why ``model.generate`` of this release hands the model no cache under :data:`CACHE_KEYWORD` (a model whose
    state lives in an argument of its own: Mamba's ``cache_params`` in transformers 5.17), or None. transformers
    decides which of generate's keywords a model uses by those of ``prepare_inputs_for_generation``, with
    ``forward``'s where it takes ``**kwargs``; so does this."""
    names = set(inspect.signature(model.prepare_inputs_for_generation).parameters)
    if "kwargs" in names or "model_kwargs" in names:
        names |= set(inspect.signature(model.forward).parameters)
    if CACHE_KEYWORD in names:
        return None
    name = type(model).__name__
    return (f"{name}.generate of transformers {transformers.__version__} hands the model no {CACHE_KEYWORD} (its state "
            f"lives in an argument of its own), so there is no cache to shard; generate in one process with "
            f"model.generate, or with a transformers release whose {name} takes {CACHE_KEYWORD}")


def trainer_sharding_problem(model: Any) -> Optional[str]:
    """Why this release's Trainer cannot train ``model``, sharded at load time (DTensor parameters), or None."""
    if since(TRAINER_KEEPS_LOADED_SHARDING_SINCE):
        return None
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    return (f"a model sharded at load time (from_pretrained(distributed_config=...), DTensor parameters) trains under "
            f"transformers' Trainer from transformers {TRAINER_KEEPS_LOADED_SHARDING_SINCE} on; "
            f"transformers {transformers.__version__} wraps it in DDP, which cannot take its shards: pip install "
            f"'transformers>={TRAINER_KEEPS_LOADED_SHARDING_SINCE}', or load the model whole")


def tensor_parallel_problem(model: Any) -> Optional[str]:
    """Why transformers cannot shard an already loaded ``model`` over a given mesh here, or None."""
    if callable(getattr(model, "_resolve_parallel_plans", None)):
        return None
    return (f"hf_ring.tensor_parallel shards a loaded model with transformers' own plan resolution, which "
            f"transformers {transformers.__version__} does not have; it needs transformers>={TENSOR_PARALLEL_SINCE} "
            f"(pip install 'transformers>={TENSOR_PARALLEL_SINCE}'), or use tp_size=1")


def peft_base(model: Any) -> Any:
    """The model under a PEFT wrapper (``get_base_model()``), or ``model`` itself when there is none: the module
    whose config, attention and forward hf_ring reads (a PEFT model's generate and forward call that one)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _checkpointing_wrapper() -> Optional[CodeType]:
    class Probe(GradientCheckpointingLayer):
        def forward(self) -> None:
            return None

    forward = Probe.__dict__["forward"]
    return forward.__code__ if "__wrapped__" in forward.__dict__ else None


CHECKPOINTING_WRAPPER = _checkpointing_wrapper()
"""The code of the wrapper this release puts around a checkpointed layer class's ``forward`` when the class is made
(5.23 on; it checkpoints only while it is the class's own ``forward``); None where ``__call__`` checkpoints."""


def _checkpointing(forward: Any) -> bool:
    return CHECKPOINTING_WRAPPER is not None and getattr(forward, "__code__", None) is CHECKPOINTING_WRAPPER


def layer_forward_inside(forward: Any) -> Any:
    """What a layer class's ``forward`` runs inside transformers' checkpointing: the forward as the modeling file
    wrote it where ``forward`` is that checkpointing's wrapper, else ``forward`` itself."""
    return forward.__wrapped__ if _checkpointing(forward) else forward


def as_layer_forward(forward: Any, replaced: Any) -> Any:
    """``forward``, made to replace the layer class's ``forward`` ``replaced``: wrapped in transformers'
    checkpointing as ``replaced`` was (by making a class with it), so a replaced forward still runs inside the
    checkpoint; itself where ``replaced`` was not wrapped."""
    if not _checkpointing(replaced):
        return forward
    return type("ReplacedForward", (GradientCheckpointingLayer,), {"forward": forward}).__dict__["forward"]


def kernel_function(kernel: Any) -> Any:
    """The function a modeling module's kernel name calls: ``kernel`` itself, or, where the ``kernels`` package is
    installed, the function inside the layer it made of it (``use_kernel_forward_from_hub`` on a function gives an
    ``nn.Module`` instance whose ``forward`` calls the function, so that ``kernelize`` can replace that forward).
    Its signature is the one the modeling code calls the kernel by. A layer made of a layer (a function layer
    wrapped again, as a patch that decorates the module's name once more makes it) is seen through to the end."""
    while True:
        forward = getattr(type(kernel), "forward", None)
        code = getattr(forward, "__code__", None)
        if not hasattr(type(kernel), "kernel_layer_name") or code is None or "func" not in code.co_freevars:
            return kernel
        kernel = forward.__closure__[code.co_freevars.index("func")].cell_contents


def _kernel_resolver() -> Optional[CodeType]:
    decorate = getattr(hub_kernels, "use_kernel_func_from_hub_with_fallback", None)
    if decorate is None:
        return None

    def probe(x: Any) -> Any:
        return x

    wrapped = kernel_function(decorate("hf_ring_probe", "hf_ring_probe_package")(probe))  # no such package: the
    # torch path
    code = getattr(wrapped, "__code__", None)
    return code if wrapped is not probe and code is not None and "implementation" in code.co_freevars else None


KERNEL_RESOLVER = _kernel_resolver()
"""The code of the wrapper transformers puts in place of a modeling module's kernel function (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ...): it calls the package's function found at import, or the torch path."""


def _resolved(kernel: Any, name: str) -> Any:
    kernel = kernel_function(kernel)
    code = getattr(kernel, "__code__", None)
    if KERNEL_RESOLVER is None or code is not KERNEL_RESOLVER:
        return None
    return kernel.__closure__[code.co_freevars.index(name)].cell_contents


def kernel_name(kernel: Any) -> Optional[str]:
    """The name transformers resolves a modeling module's kernel function under (``chunk_gated_delta_rule``,
    ``causal_conv1d_fn``, ``selective_scan_fn``: the package's, the hub's), whatever the modeling file calls it;
    None for a function transformers does not resolve."""
    return _resolved(kernel, "func_name")


def kernel_implementation(kernel: Any) -> Any:
    """What a modeling module's kernel function runs: the package function (flash-linear-attention's, causal-conv1d's,
    mamba-ssm's) or torch path transformers resolved it to, where ``kernel`` is that resolution's wrapper; else
    ``kernel`` itself. The wrapper keeps the torch path's signature, which is how the modeling code calls it."""
    found = _resolved(kernel, "implementation")
    return kernel if found is None else found
