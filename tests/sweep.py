"""Every causal-LM type of the installed transformers, built tiny from its own default config.

A type's default config is shrunk (sizes, experts, layers: one layer of each
kind it mixes, windows and chunks shorter than the test rows), the model is
built with random weights and run with ``eager`` and ``ring_dilated`` on the
same input. What cannot be built that way is listed with the reason. A new
model type or a new release then shows up as a row of the sweep, never as a
user's wrong result.
"""
from __future__ import annotations

import copy
from fractions import Fraction
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch

import hybrid_models

ROWS = 61
"""Tokens of the sweep's rows: longer than every shrunk window and chunk, and not a multiple of anything."""
WINDOW = 8
CHUNK = 8
VOCAB = 97
"""Token ids drawn below this, clear of the special ids multimodal types keep high."""

SIZES = {
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 512,
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "intermediate_size_mlp": 96, "ffn_hidden_size": 96, "n_group": 1, "topk_group": 1,
    # multi-head latent attention
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16,
    # state-space and linear-attention layers of hybrids
    "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "ssm_state_size": 8, "state_size": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "conv_L_cache": 3, "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_d_ssm": 128,
    "mamba_headdim": 16, "n_mamba_heads": 8, "linear_num_heads": 4, "linear_head_dim": 16, "mamba_chunk_size": 16,
    "chunk_size": 16,
}
"""Sizes a tiny model of any type takes, where its config has the setting (aliases resolved by the config)."""

MAX_PARAMETERS = 64_000_000

LENGTHS = {"sliding_window": WINDOW, "attention_chunk_size": CHUNK, "window_size": WINDOW, "floor_scale": 4}
"""Windows and chunks, shrunk below the rows where the type has them."""
WINDOWS = ("sliding_window", "attention_chunk_size", "window_size")


def _per_layer_lists(cfg, layers: int) -> Dict[str, list]:
    return {k: v for k, v in vars(cfg).items() if isinstance(v, (list, tuple)) and len(v) == layers and layers > 1
            and not k.startswith("_")}


def _pick_layers(cfg) -> Optional[List[int]]:
    """One layer of each kind the config mixes (by everything its per-layer lists say), at most four."""
    layers = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        return None
    lists = _per_layer_lists(cfg, layers)
    seen, chosen = set(), []
    for i in range(layers):
        kind = tuple(repr(v[i]) for v in lists.values())
        if kind not in seen:
            seen.add(kind)
            chosen.append(i)
    chosen = chosen[:4]
    if len(chosen) == 1 and layers > 1:
        chosen.append(1)
    return chosen


def _set(cfg, name: str, value: Any) -> None:
    try:
        setattr(cfg, name, value)
    except (AttributeError, TypeError, ValueError):  # a derived setting: the config keeps its own
        pass


def _no_dropout(cfg) -> None:
    """Every dropout setting of ``cfg`` to 0, nested configs and dicts (MPT's ``attn_config``) included: a type is
    judged by its structure, not refused for its dropout."""
    for name, value in list(vars(cfg).items()):
        if "drop" in name and isinstance(value, (int, float)) and not isinstance(value, bool) and value:
            _set(cfg, name, 0.0)
        elif isinstance(value, dict):
            for key, inner in value.items():
                if isinstance(key, str) and "drop" in key and isinstance(inner, (int, float)) and not isinstance(inner, bool):
                    value[key] = 0.0
        elif hasattr(value, "to_dict") and value is not cfg and not name.startswith("_"):
            _no_dropout(value)


def _shrink_mrope(cfg) -> None:
    """mRoPE's sections (Qwen-VL, GLM-4V) cover half the head: cut them to the shrunk head, in their proportions."""
    rope = getattr(cfg, "rope_parameters", None)
    head = getattr(cfg, "head_dim", None) or SIZES["head_dim"]
    if not isinstance(rope, dict) or "mrope_section" not in getattr(cfg, "ignore_keys_at_rope_validation", ()):
        return
    sections = list(rope.get("mrope_section") or (16, 24, 24))  # the models' default when the config has none
    half, total = head // 2, sum(sections)
    cut = [max(1, s * half // total) for s in sections]
    cut[0] += half - sum(cut)
    rope["mrope_section"] = cut


MLA_WIDTHS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_ROPE = 8
"""A tiny multi-head latent attention's rotary width: the released widths are divided by what takes their rotary
part to this, so the values keep their released ratio to the keys (DeepSeek V3's 128 against 128 + 64: 16 against
16 + 8), as GLM-4-MoE-Lite's keep theirs (256 against 192 + 64: 32 against 24 + 8)."""


def _mla_widths(cfg, released: Dict[str, Any]) -> None:
    """``cfg``'s query/key and value head widths, shrunk from the ``released`` ones in their proportions."""
    if not all(isinstance(released[name], int) and released[name] > 0 for name in MLA_WIDTHS):
        return
    factor = max(1, released["qk_rope_head_dim"] // MLA_ROPE)
    for name in MLA_WIDTHS:
        _set(cfg, name, max(2, released[name] // factor))
    if isinstance(getattr(cfg, "qk_head_dim", None), int):
        _set(cfg, "qk_head_dim", cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)


EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""The names a config gives its routed experts' count (the first it has counts)."""


def _int(cfg, name: str) -> Optional[int]:
    try:
        value = getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 -- a per-layer setting a heterogeneous config will not read globally
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _latent(cfg) -> bool:
    return _int(cfg, "kv_lora_rank") is not None and _int(cfg, "qk_rope_head_dim") is not None


def _experts(cfg) -> Optional[str]:
    """The name under which ``cfg`` counts its routed experts (the first of :data:`EXPERTS` it sets; None: none)."""
    return next((n for n in EXPERTS if _int(cfg, n)), None)


def _absent_or_none(cfg, name: str) -> bool:
    try:
        return getattr(cfg, name, None) is None
    except Exception:  # noqa: BLE001 -- per layer (see _int)
        return False


def _side(ratio: Fraction) -> str:
    return "equal" if ratio == 1 else "wider" if ratio > 1 else "narrower"


def relations(cfg) -> Dict[str, Any]:
    """What of ``cfg``'s shape a tiny copy keeps (:func:`shrink`), as the released config's relations, not its
    sizes: query to key/value heads (multi-head, grouped, multi-query), the heads' width against
    ``hidden_size / num_attention_heads``, the latent attention's value and rotary widths against its keys', the
    rotary part of a head, windows and chunks shorter than the rows, experts per token (one, some, all)."""
    out: Dict[str, Any] = {}
    heads, kv, width, hidden = (_int(cfg, n) for n in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                        "hidden_size"))
    if heads is not None and (kv is not None or _absent_or_none(cfg, "num_key_value_heads")):
        out["heads"] = "multi-head" if kv in (None, heads) else "multi-query" if kv == 1 else "grouped"
    if _latent(cfg):
        keys = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        out["latent"] = (Fraction(cfg.v_head_dim, keys), Fraction(cfg.qk_rope_head_dim, keys))
    elif heads and hidden:  # no head_dim: the model derives it, hidden_size // num_attention_heads
        out["head_width"] = _side(Fraction(width * heads, hidden)) if width else "equal"
    if heads and hidden and _int(cfg, "rotary_dim"):
        out["rotary_dim"] = Fraction(cfg.rotary_dim, width or hidden // heads)
    if isinstance(getattr(cfg, "partial_rotary_factor", None), float):
        out["partial_rotary_factor"] = cfg.partial_rotary_factor
    for name in WINDOWS:
        if _int(cfg, name):
            out[name] = "windowed"  # shrunk below the rows, as a long row exceeds the released window
    experts, chosen = _int(cfg, _experts(cfg) or ""), _int(cfg, "num_experts_per_tok")
    if experts and chosen:
        out["experts_per_token"] = "one" if chosen == 1 else "all" if chosen >= experts else "some"
    return out


def _keep_relations(cfg, released: Dict[str, Any]) -> None:
    """Sizes of the tiny ``cfg`` that give it the ``released`` config's :func:`relations` (with the released
    head width's share of rotary dims and expert count :func:`_released` adds)."""
    heads, rotary = _int(cfg, "num_attention_heads"), released["_rotary"]
    if heads is None:
        return
    kind = released.get("heads")
    if kind and "latent" not in released and released["_has_kv_heads"]:
        kept = {"multi-head": heads, "multi-query": 1}.get(kind, SIZES["num_key_value_heads"])
        _set(cfg, "num_key_value_heads", kept)
    side = released.get("head_width")
    if side in ("wider", "narrower") and isinstance(getattr(cfg, "head_dim", None), int):
        # the released proportion, on the wider or narrower side of the hidden size's share as released
        scaled = 4 * round(SIZES["head_dim"] * released["_head_ratio"] / 4)
        _set(cfg, "head_dim", max(20, scaled) if side == "wider" else max(4, min(12, scaled)))
    if rotary and _int(cfg, "rotary_dim"):
        head = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        _set(cfg, "rotary_dim", max(2, 2 * round(head * rotary / 2)))
    share, name = released.get("experts_per_token"), _experts(cfg)
    if share and name:
        experts = min(SIZES[name], released["_experts"])
        _set(cfg, name, experts)
        _set(cfg, "num_experts_per_tok", {"one": 1, "all": experts}.get(share, 2))


def _released(cfg) -> Dict[str, Any]:
    """``cfg``'s :func:`relations`, with the widths and counts :func:`_keep_relations` scales from."""
    out = relations(cfg)
    heads, hidden, width = _int(cfg, "num_attention_heads"), _int(cfg, "hidden_size"), _int(cfg, "head_dim")
    head = width or (hidden // heads if heads and hidden else None)
    out["_head_ratio"] = Fraction(head * heads, hidden) if head and heads and hidden else 1
    out["_has_kv_heads"] = "num_key_value_heads" in vars(cfg)
    out["_rotary"] = Fraction(cfg.rotary_dim, head) if head and _int(cfg, "rotary_dim") else None
    out["_experts"] = _int(cfg, _experts(cfg) or "")
    return out


def shrink(cfg, vision: bool = False, keep_layers: bool = False):
    """A tiny copy of ``cfg`` (nested text and vision configs included) that keeps its :func:`relations`;
    ``keep_layers``: the layer pattern was chosen already (:mod:`hybrid_models`), so keep every layer."""
    cfg = copy.deepcopy(cfg)
    latent = {name: getattr(cfg, name, None) for name in MLA_WIDTHS}  # the released widths, before the sizes
    released = _released(cfg)
    for name, value in SIZES.items():
        current = getattr(cfg, name, False)
        if current is None and name in ("head_dim", "num_key_value_heads") or (
                isinstance(current, int) and not isinstance(current, bool)):
            _set(cfg, name, value)
    if _latent(cfg):
        # multi-head latent attention: every query head has its own key and value heads, made from one latent, and
        # the rotary part of a head is qk_rope_head_dim wide (what head_dim sizes the rotary tables by)
        _set(cfg, "num_key_value_heads", cfg.num_attention_heads)
        _mla_widths(cfg, latent)
        _set(cfg, "head_dim", cfg.qk_rope_head_dim)
    if not vision:
        _keep_relations(cfg, released)
    _shrink_mrope(cfg)  # to the head as kept
    for name, value in LENGTHS.items():
        if isinstance(getattr(cfg, name, None), int) and getattr(cfg, name) > 0:
            setattr(cfg, name, value)
    chosen = None if keep_layers else _pick_layers(cfg)
    if chosen is not None:
        layers = cfg.num_hidden_layers
        for name, values in _per_layer_lists(cfg, layers).items():
            setattr(cfg, name, type(values)(values[i] for i in chosen))
        cfg.num_hidden_layers = len(chosen)
    _no_dropout(cfg)
    if isinstance(getattr(cfg, "vocab_size", None), int) and cfg.vocab_size > 4096:
        special = [v for k, v in vars(cfg).items() if isinstance(v, int) and not isinstance(v, bool)
                   and (k.endswith("token_id") or k.endswith("token_index"))]
        cfg.vocab_size = max([4096] + [v + 1 for v in special])
    for name in ("text_config", "vision_config"):
        sub = getattr(cfg, name, None)
        if sub is not None and hasattr(sub, "to_dict") and sub is not cfg:
            setattr(cfg, name, shrink(sub, vision=name == "vision_config"))
    if vision:
        for name, value in (("image_size", 32), ("patch_size", 8), ("num_hidden_layers", 1),
                            ("hidden_size", 32), ("intermediate_size", 64), ("num_attention_heads", 2)):
            if isinstance(getattr(cfg, name, None), int):
                setattr(cfg, name, value)
    return cfg


def causal_lm_types() -> List[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def causal_lm_rows() -> List[Tuple[str, Optional[str]]]:
    """``(type, pattern)`` for every causal-LM type: a hybrid twice (with its attention layers, recurrent only), a
    purely recurrent type in its recurrent form, any other type from its default layers (pattern None)."""
    rows = []
    for t in causal_lm_types():
        if t in hybrid_models.TYPES:
            rows += [(t, p) for p in hybrid_models.PATTERNS if hybrid_models.pattern_kwargs(t, p) is not None]
        else:
            rows.append((t, None))
    return rows


IMAGE_TEXT = "image-text"
"""The ``head`` of the image-text-to-text sweep (else the causal-LM one)."""


def _auto(head: Optional[str]):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if head == IMAGE_TEXT else AutoModelForCausalLM


def image_text_types() -> List[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def tiny_config(model_type: str, chosen: Dict[str, Any]):
    """The shrunk default config of ``model_type`` (``chosen``: a hybrid's layer pattern, see
    :func:`hybrid_models.pattern_kwargs`), with the size fixes its type needs."""
    from transformers import AutoConfig

    cfg = shrink(AutoConfig.for_model(model_type, **chosen), keep_layers=bool(chosen))
    text = cfg.get_text_config(decoder=True)
    for name, value in hybrid_models.SIZE_FIXES.get(model_type, {}).items():
        for target in (cfg, text) if text is not cfg else (cfg,):  # a multimodal type's are its text model's
            _set(target, name, value)
    return cfg


def build(model_type: str, attn: str = "eager", dtype: torch.dtype = torch.float32,
          pattern: Optional[str] = None, head: Optional[str] = None,
          vocab_size: Optional[int] = None) -> Tuple[Any, Optional[str]]:
    """``(model, None)``, or ``(None, why it cannot be built tiny)``; ``pattern``: a hybrid's layers
    (:mod:`hybrid_models`), else one layer of each kind its default config mixes; ``head``: :data:`IMAGE_TEXT`
    for the image-text-to-text model of a multimodal type (else its causal LM)."""
    auto = _auto(head)

    chosen = hybrid_models.pattern_kwargs(model_type, pattern)
    if chosen is None:
        return None, f"no {pattern} form of {model_type}"
    try:
        cfg = tiny_config(model_type, chosen)
        if vocab_size is not None:  # a given tokenizer's: its special ids (pad 0, eos 1) inside it
            for name, value in (("vocab_size", vocab_size), ("pad_token_id", 0), ("eos_token_id", 1),
                                ("bos_token_id", None)):
                _set(cfg, name, value)
    except Exception as err:  # noqa: BLE001 -- the reason is the row
        return None, f"config: {type(err).__name__}: {str(err)[:160]}"
    try:
        with torch.device("meta"):  # sized first: a config the shrinking missed is listed, not allocated
            size = sum(p.numel() for p in auto.from_config(cfg, attn_implementation=attn).parameters())
    except Exception as err:  # noqa: BLE001
        return None, f"build: {type(err).__name__}: {str(err)[:160]}"
    if size > MAX_PARAMETERS:
        return None, f"still {size / 1e6:.0f}M parameters once shrunk"
    # float64 experts run one by one: the grouped matmul has no float64 kernel
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    try:
        torch.manual_seed(0)
        model = auto.from_config(cfg, attn_implementation=attn, dtype=dtype, **experts)
    except Exception:  # noqa: BLE001 -- a type that takes no experts setting is built as it comes
        try:
            torch.manual_seed(0)
            model = auto.from_config(cfg, attn_implementation=attn, dtype=dtype)
        except Exception as err:  # noqa: BLE001
            return None, f"build: {type(err).__name__}: {str(err)[:160]}"
    return model.eval(), None


def inputs(model_type: str, batch: int = 1, n: int = ROWS, seed: int = 0) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, VOCAB, (batch, n), generator=g)}


def logits_of(model, batch, attn: str) -> Tuple[torch.Tensor, int]:
    """The model's logits with attention ``attn``, and how many attention calls went to ``ring_dilated``."""
    from transformers import AttentionInterface

    from hf_ring.entry import backend

    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return backend.ring_dilated_attention(*args, **kwargs)

    model.set_attn_implementation(attn)
    AttentionInterface.register(backend.NAME, counted)
    try:
        with torch.no_grad():
            out = model(**batch, use_cache=False)
    finally:
        AttentionInterface.register(backend.NAME, backend.ring_dilated_attention)
    return out.logits.float(), calls[0]


def one_process_row(model_type: str, pattern: Optional[str] = None, head: Optional[str] = None) -> Dict[str, Any]:
    """``{"type", "status": exact | wrong | refused | unbuilt | eager-fails, "error" or "why"}`` for one type."""
    import hf_ring  # noqa: F401  (registers ring_dilated)

    model, why = build(model_type, pattern=pattern, head=head)
    if model is None:
        return {"type": model_type, "status": "unbuilt", "why": why}
    batch = inputs(model_type)
    try:
        ref, _ = logits_of(model, batch, "eager")
    except Exception as err:  # noqa: BLE001
        return {"type": model_type, "status": "eager-fails", "why": f"{type(err).__name__}: {str(err)[:160]}"}
    try:
        got, calls = logits_of(model, batch, "ring_dilated")
    except (NotImplementedError, ValueError, TypeError) as err:
        return {"type": model_type, "status": "refused", "why": f"{type(err).__name__}: {str(err)[:300]}"}
    except Exception as err:  # noqa: BLE001 -- a crash is a row of its own, not a refusal
        return {"type": model_type, "status": "crashed",
                "why": f"{type(err).__name__}: {str(err)[:200]} | {traceback.format_exc(limit=-3)[-600:]}"}
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    if err > 1e-5:  # where eager and sdpa part ways (a mask left out, which sdpa reads as causal), either is right
        try:
            sdpa, _ = logits_of(model, batch, "sdpa")
            err = min(err, ((got - sdpa).abs().max() / sdpa.abs().max()).item())
        except Exception:  # noqa: BLE001 -- a type without sdpa keeps eager's verdict
            pass
    if not calls:  # its own attention code ran: nothing of hf_ring's was compared
        return {"type": model_type, "status": "not-routed", "why": "its attention does not go through transformers' "
                f"attention interface (logits within {err:.1e} of eager)"}
    return {"type": model_type, "status": "exact" if err <= 1e-5 else "wrong", "error": err}


def _grads(model) -> Dict[str, torch.Tensor]:
    return {name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()}


def eager_step(model_type: str, seed: int = 1, dtype: torch.dtype = torch.float64,
               pattern: Optional[str] = None, head: Optional[str] = None) -> Dict[str, Any]:
    """One-process ``eager`` loss and every parameter gradient of the type's tiny model on the sweep's batch."""
    model, why = build(model_type, dtype=dtype, pattern=pattern, head=head)
    assert model is not None, why
    model.eval()  # gradients all the same; no stochastic routing (PhiMoE samples experts in training)
    batch = inputs(model_type, seed=seed)
    with hybrid_models.model_in_float64(model):
        out = model(**batch, labels=batch["input_ids"], use_cache=False)
        out.loss.backward()
    return {"loss": out.loss.detach(), "grads": _grads(model)}


def sharded_step_case(model_type: str, seed: int = 1, dtype: torch.dtype = torch.float64,
                      pattern: Optional[str] = None, head: Optional[str] = None, ulysses: int = 1) -> Dict[str, Any]:
    """Rank function: the same step with the sequence split over the pool's ranks (``shard_batch``, the loss and
    summed gradients; ``ulysses``: head-parallel groups of that size); what each rank raised, if anything, in place
    of the results."""
    import torch.distributed as dist

    import hf_ring

    sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses)
    try:
        model, why = build(model_type, "ring_dilated", dtype, pattern, head)
        if model is None:  # transformers itself cannot load it with ring_dilated (its attention ignores the interface)
            return {"unbuilt": why}
        model.eval()
        batch = inputs(model_type, seed=seed)
        try:  # the documented loop: the guard on the model's call checks the model itself
            data = hf_ring.shard_batch({**batch, "labels": batch["input_ids"]})
            with hybrid_models.model_in_float64(model):
                out = model(**data)
                out.loss.backward()
        except (NotImplementedError, ValueError, TypeError) as err:
            return {"refused": f"{type(err).__name__}: {err}", "built": model.config.model_type}
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        return {"loss": loss, "grads": _grads(model) if dist.get_rank() == 0 else None}
    finally:
        hf_ring.clear_sequence_parallel()
