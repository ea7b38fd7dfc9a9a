"""Layer patterns for the hybrid types of the installed transformers: with attention layers, and recurrent only.

A hybrid (linear attention, Mamba, convolutions or RG-LRU beside a few
attention layers) is built tiny by :mod:`sweep` from its own default config;
this table says how each type's config spells its layer pattern, so that it
can be built twice: four layers in a realistic pattern (three recurrent, then
one attention layer, as Qwen3.5 and Qwen3-Next alternate them), and four
recurrent layers with no attention at all. A type whose mixers cannot be told
apart (Falcon-H1 runs Mamba beside attention in every layer) has no
recurrent-only form.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional

HYBRID = "hybrid"
RECURRENT = "recurrent"
PATTERNS = (HYBRID, RECURRENT)

LAYERS = 4


def _types(recurrent: str, attention: str = "full_attention") -> Callable[[str], Dict]:
    """Three recurrent layers then one attention layer, or recurrent layers only (``config.layer_types``)."""
    def kwargs(pattern: str) -> Dict:
        last = attention if pattern == HYBRID else recurrent
        return {"layer_types": [recurrent] * (LAYERS - 1) + [last], "num_hidden_layers": LAYERS}
    return kwargs


def _nemotron_h(pattern: str) -> Dict:
    # Nemotron-H lists each mixer and each feed-forward block as a layer of its own ("M-M*-")
    last = "full_attention" if pattern == HYBRID else "mlp"
    return {"layers_block_type": ["linear_attention", "mlp", "linear_attention", last], "num_hidden_layers": LAYERS}


def _jamba(pattern: str) -> Dict:
    # every attn_layer_period-th layer from attn_layer_offset attends; a period past the layers leaves none
    period = LAYERS if pattern == HYBRID else 2 * LAYERS
    return {"num_hidden_layers": LAYERS, "attn_layer_period": period, "attn_layer_offset": period - 1,
            "expert_layer_period": 2, "expert_layer_offset": 1}


def _recurrent_gemma(pattern: str) -> Dict:
    blocks = ["recurrent", "recurrent", "recurrent", "attention"] if pattern == HYBRID else ["recurrent"]
    return {"num_hidden_layers": LAYERS, "block_types": blocks}


def _bamba(pattern: str) -> Dict:
    return {"num_hidden_layers": LAYERS, "attn_layer_indices": [LAYERS - 1] if pattern == HYBRID else []}


def _falcon_h1(pattern: str) -> Optional[Dict]:
    return {"num_hidden_layers": LAYERS} if pattern == HYBRID else None


def _attending(pattern: str) -> Optional[Dict]:
    """OLMo hybrid: its config refuses a pattern without attention."""
    return _types("linear_attention")(pattern) if pattern == HYBRID else None


def _zamba(pattern: str) -> Optional[Dict]:
    """Zamba: Mamba layers and hybrid ones (an attention block shared across depths, then Mamba); two hybrid
    layers, as the tying of the shared block's weights needs."""
    blocks = ["mamba", "hybrid", "mamba", "hybrid"]
    return {"num_hidden_layers": len(blocks), "layers_block_type": blocks} if pattern == HYBRID else None


def _pure(pattern: str) -> Optional[Dict]:
    return {"num_hidden_layers": 2} if pattern == RECURRENT else None


TYPES: Dict[str, Callable[[str], Optional[Dict]]] = {
    "qwen3_5_text": _types("linear_attention"),
    "qwen3_5_moe_text": _types("linear_attention"),
    "qwen3_next": _types("linear_attention"),
    "olmo_hybrid": _attending,
    "minimax": _types("linear_attention"),
    "kimi_linear": _types("linear_attention"),
    "bailing_hybrid": _types("linear_attention"),
    "granitemoehybrid": _types("linear_attention"),
    "lfm2": _types("conv"),
    "lfm2_moe": _types("conv"),
    "nemotron_h": _nemotron_h,
    "jamba": _jamba,
    "recurrent_gemma": _recurrent_gemma,
    "zamba": _zamba,
    "zamba2": _zamba,
    "bamba": _bamba,
    "falcon_h1": _falcon_h1,
    "mamba": _pure,
    "mamba2": _pure,
    "falcon_mamba": _pure,
    "rwkv": _pure,
    "xlstm": _pure,
}
"""Per hybrid (or purely recurrent) type, the config keywords of each pattern (None: the type has no such form)."""


SIZE_FIXES: Dict[str, Dict] = {
    "deepseek_v2": {"num_experts_per_tok": 2},  # None by default, which its router cannot take
    "mamba2": {"num_heads": 8},  # heads x head_dim = expand x hidden
    # derived from the hidden size before the shrinking: the attention block reads twice the hidden size
    "zamba": {"attention_hidden_size": 128, "attention_head_dim": 32, "mamba_dt_rank": 4},
    "zamba2": {"attention_hidden_size": 128, "attention_head_dim": 32},
    "rwkv": {"attention_hidden_size": None},
    "flint": {"mlp_only_layers": [0]},  # its default lists every layer the sweep keeps: no layer of experts  # the hidden size; its cached state is that wide whatever this says
    # no default for its attention's token indexer (a top-k of pooled key blocks per query); its heads as wide as
    # the attention's, whose rotary tables it shares
    **{t: {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 32, "indexer_budget": 8,
           "indexer_compress_ratio": 2} for t in ("qwen4_exp", "qwen4_exp_text")},
}
"""Sizes the sweep's shrinking leaves inconsistent for these types, set after it."""


def pattern_kwargs(model_type: str, pattern: Optional[str]) -> Optional[Dict]:
    """Config keywords that give ``model_type`` the layer ``pattern`` ({} for a type that is not a hybrid, or
    no pattern asked; None when the type has no such form)."""
    if pattern is None or model_type not in TYPES:
        return {} if pattern in (None, HYBRID) else None
    return TYPES[model_type](pattern)


def hybrid_types() -> List[str]:
    """Types that mix a recurrence or convolution with attention (built in both patterns by the sweep)."""
    return sorted(t for t in TYPES if TYPES[t](HYBRID) is not None)


REFERENCE_KERNELS = {"delta rule": "delta_rule", "Mamba2 scan": "mamba2_scan", "Mamba scan": "selective_scan",
                     "RG-LRU scan": "rg_lru_scan", "WKV": "wkv"}
"""The float64 recurrence of :mod:`reference` that stands in for each kind of kernel hf_ring hooks."""


def model_in_float64(model) -> contextlib.AbstractContextManager:
    """:func:`float64_kernels` for a built model (a multimodal one by its language model's type)."""
    return float64_kernels(model.config.get_text_config(decoder=True).model_type)


@contextlib.contextmanager
def float64_kernels(model_type: str) -> Iterator[None]:
    """A hybrid's scan kernels replaced by the float64 recurrences of :mod:`reference`; nothing for another type.
    Used alike by a one-process reference and a sharded run.

    transformers' torch paths compute in float32 whatever the input dtype, and the gradient of a delta rule's
    decay parameters (``A_log``, ``dt_bias``) sums terms that cancel to a thousandth of their size: float32
    rounding then differs between any two chunkings of the sequence (one process against shards) by up to 1e-3,
    which would hide the state passing behind it. The hooks under the real kernels are checked against the same
    recurrences at the kernel's level (``test_hybrids``)."""
    import importlib

    import reference
    from hf_ring.patches.hybrids import family, kernel_owner

    found = family(model_type)
    if found is None:
        yield
        return
    module = importlib.import_module(found.modeling)
    # a module-level function's module, or a method's class ("Class.method")
    owners = {name: kernel_owner(module, name) for name, kind in found.kernels if kind in REFERENCE_KERNELS}
    swapped = {name: getattr(owner, attr) for name, (owner, attr) in owners.items()}
    for name, kind in found.kernels:
        if name in owners:
            setattr(*owners[name], getattr(reference, REFERENCE_KERNELS[kind]))
    try:
        yield
    finally:
        for name, fn in swapped.items():
            setattr(*owners[name], fn)


_SAVED: Dict[tuple, str] = {}


def saved(model_type: str, vocab_size: Optional[int] = None, pattern: str = HYBRID) -> str:
    """A directory holding the type's tiny hybrid (three recurrent layers, one attention layer; ``pattern``
    :data:`RECURRENT`: recurrent layers only), float32, saved with safetensors (made once per process and argument
    set); ``vocab_size`` for a given tokenizer."""
    import tempfile

    import sweep

    key = (model_type, vocab_size, pattern)
    if key not in _SAVED:
        model, why = sweep.build(model_type, pattern=pattern, vocab_size=vocab_size)
        assert model is not None, why
        path = tempfile.mkdtemp(prefix=f"hf_ring_{model_type}_")
        model.save_pretrained(path, safe_serialization=True)
        _SAVED[key] = path
    return _SAVED[key]


class _InFloat64(__import__("ast").NodeTransformer):
    """``torch.float32`` as ``torch.float64``, ``x.float()`` as ``x.double()``: a kernel's source in float64."""

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if node.attr == "float32" and getattr(node.value, "id", None) == "torch":
            node.attr = "float64"
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if getattr(node.func, "attr", None) == "float" and not node.args and not node.keywords:
            node.func.attr = "double"
        return node


def undecorated_copy(module, name: str, float64: bool = True):
    """What a user assigns in place of a kernel of ``module`` (``name``: a module function, or ``Class.method``): the
    modeling file's own definition compiled again from its source without its decorators, computing in float64
    where ``float64`` (the experiment of replacing transformers' float32 torch path by a more precise copy of
    itself); run in the module's globals. It carries no mark of transformers' kernel resolution."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    owner, _, attr = name.rpartition(".")
    body = tree.body
    if owner:
        body = next(node for node in body if isinstance(node, ast.ClassDef) and node.name == owner).body
    fn = next(node for node in body if isinstance(node, ast.FunctionDef) and node.name == attr)
    fn.decorator_list = []
    if float64:
        fn = _InFloat64().visit(fn)
    code = compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), module.__file__, "exec")
    scope = dict(vars(module))
    exec(code, scope)
    return scope[attr]
