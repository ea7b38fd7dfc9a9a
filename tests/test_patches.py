"""Model-family patches: registry, structural refusal, reversibility, and unchanged unsharded behaviour."""
import re
import sys
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from transformers.models.qwen3_5 import modeling_qwen3_5

import hf_ring
from hf_ring import patches
from hf_ring.integration.seams import kernel_function, kernel_implementation
from hf_ring.patches.recurrent import package_problem
from hf_ring.patches.recurrent_runs import linear_kernel
from models import FAMILY_CONFIG, batch, length_dependent_rope, load, saved_model_dir, tiny_config

pytestmark = pytest.mark.compat  # the subset run on every supported transformers release

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, pad_token_id=0)


def test_registry_lists_tested_families():
    assert patches.supported() == tuple(sorted(FAMILY_CONFIG))
    with pytest.raises(ValueError, match="'gpt2' is not a tested family"):
        patches.apply("gpt2")


def test_every_family_patches_and_reverts_its_rotary_class():
    for model_type, family in patches.FAMILIES.items():
        apply, revert = family.apply, family.revert
        (cls,) = family.rotary_classes()
        original = cls.forward
        apply()
        apply()  # idempotent
        assert family.is_applied() and cls.forward is not original and patches.is_applied(model_type)
        revert()
        assert cls.forward is original and not family.is_applied()
    patches.apply_all()
    assert all(f.is_applied() for f in patches.FAMILIES.values())
    patches.revert_all()
    assert not any(f.is_applied() for f in patches.FAMILIES.values())


@pytest.mark.parametrize("kind", sorted(FAMILY_CONFIG))
def test_apply_and_revert_are_exact_and_leave_unsharded_runs_alone(kind):
    model = load(saved_model_dir(kind, **length_dependent_rope(kind)), "ring_dilated")
    (rotary,) = patches.rotary_modules(model)  # Gemma 3's one module serves both layer types
    rotary_cls = type(rotary)
    original = rotary_cls.forward
    data = batch(0, 1, 40)
    with torch.no_grad():
        before = model(**data).logits
        patches.apply(model)
        assert patches.is_applied(model) and rotary_cls.forward is not original
        patched = model(**data).logits
        patches.revert(model)
    assert rotary_cls.forward is original and not patches.is_applied(kind)
    assert torch.equal(before, patched)


REFUSED = {  # model type: (config overrides, words the refusal must contain)
    "xlstm": ({}, "xLSTMForCausalLM does not declare that its attention goes through"),
}
"""Recurrent models hf_ring has no state rule for (xLSTM), which no attention interface tells apart."""

HOOKED = {
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "falcon_h1": {},
    "recurrent_gemma": {},  # RG-LRU
    "minimax": dict(layer_types=["linear_attention", "full_attention"]),  # lightning attention
    "zamba": dict(num_hidden_layers=4),  # Mamba, and hybrid layers: an attention block shared across depths, then Mamba
    "mamba": {},  # state-space models with no attention
    "falcon_mamba": {},
    "mamba2": dict(num_heads=2, head_dim=64),  # heads x head_dim = expand x hidden
    "rwkv": {},  # WKV and row shifts, no attention
}
"""Hybrids whose recurrent layers hf_ring computes over shards (patches/recurrent.py): their configs pass."""


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_models_mixing_the_sequence_outside_attention_are_refused_from_the_config(model_type):
    from transformers import AutoConfig

    overrides, words = REFUSED[model_type]
    config = AutoConfig.for_model(model_type, **dict(TINY, **overrides))
    with pytest.raises(ValueError, match=f"model type '{model_type}' cannot run with its sequence split") as err:
        patches.check_supported(config)
    assert words in str(err.value)


@pytest.mark.parametrize("model_type", sorted(HOOKED))
def test_hybrids_whose_recurrent_layers_are_hooked_pass_the_config_check(model_type):
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not among the attention families: a warning, not a refusal
        assert patches.check_supported(AutoConfig.for_model(model_type, **dict(TINY, **HOOKED[model_type])))


def test_convolutions_and_mixers_are_found_in_the_modules_and_other_refusals():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("recurrent_gemma", **TINY)
    model = AutoModelForCausalLM.from_config(config)
    model.config.block_types = ["attention"]  # the modules alone still give it away
    model.config.model_type = "unknown_recurrent"  # of a type no hybrid family is known for
    with pytest.raises(ValueError, match=r"convolutions mix neighbouring tokens: model.layers.0.temporal_block.conv_1d "
                                         r"\(Conv1d\), .*non-attention sequence mixers: RecurrentGemma"):
        patches.check_supported(model)
    with pytest.raises(ValueError, match="BloomForCausalLM does not declare that its attention goes through"):
        patches.check_supported(AutoConfig.for_model("bloom", n_layer=2, hidden_size=64, n_head=4))
    with pytest.raises(ValueError, match="'llava_next' cannot run .* multimodal .* not among the multimodal families"):
        patches.check_supported(AutoConfig.for_model("llava_next"))
    assert patches.check_supported(AutoConfig.for_model("gemma3")) == "gemma3"  # checked by its language model
    # a router's load-balancing loss is computed over the whole sequence (test_router_loss), not refused
    patches.check_supported(tiny_config("qwen3_moe", output_router_logits=True))


def test_untested_family_passes_with_a_warning():
    from transformers import AutoConfig

    with pytest.warns(UserWarning, match="'gpt2' passes hf_ring's structural checks but is not among the tested"):
        assert patches.check_supported(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2)) == "gpt2"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert patches.check_supported(tiny_config("llama")) == "llama"


def _unsupported_model_sharded():
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers import raises_on_rank

    hf_ring.setup_sequence_parallel(None, 2)
    try:
        cfg = AutoConfig.for_model("recurrent_gemma", **TINY)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        model.config.model_type = "unknown_recurrent"  # RG-LRU layers of a type no hybrid family is known for
        model.set_attn_implementation("ring_dilated")
        data = hf_ring.shard_batch({"input_ids": torch.zeros(1, 10, dtype=torch.long)})
        return raises_on_rank(model, **data)
    finally:
        hf_ring.clear_sequence_parallel()


XLSTM = dict(vocab_size=97, hidden_size=64, embedding_dim=64, num_heads=4, num_blocks=2, num_hidden_layers=2,
             pad_token_id=0)


def _attentionless_model_sharded():
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers import raises_on_rank

    hf_ring.setup_sequence_parallel(None, 2)
    try:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("xlstm", **XLSTM)).eval()
        return raises_on_rank(model, **hf_ring.shard_batch({"input_ids": torch.zeros(1, 10, dtype=torch.long)}))
    finally:
        hf_ring.clear_sequence_parallel()


def _bad_sp_size():
    from helpers import raises_on_rank

    return raises_on_rank(hf_ring.setup_sequence_parallel, None, 3)


def _layout_mismatch(path, how):
    from helpers import raises_on_rank

    hf_ring.setup_sequence_parallel(None, 2, layout="zigzag")
    try:
        model = load(path, "ring_dilated")
        if how == "configure":  # refused at the call that makes the conflict
            return raises_on_rank(hf_ring.configure, model, layout="contiguous")
        model.config.ring_dilated = {"layout": "contiguous", "ulysses_size": 2}  # as a saved config.json may say
        return raises_on_rank(model, **hf_ring.shard_batch(batch(0, 1, 12)))
    finally:
        hf_ring.clear_sequence_parallel()


def test_sharded_run_of_unsupported_model_is_refused(pools):
    for res in pools(2).run(_unsupported_model_sharded):
        assert res[0] == "ValueError" and "'unknown_recurrent'" in res[1], res
        # the layers' type is named 'recurrent' or 'linear_attention', by release
        assert re.search(r"layers \[0, 1\] are '(recurrent|linear_attention)'", res[1]) and "conv_1d" in res[1], res


def test_a_model_without_attention_is_refused_for_what_it_is_not_for_its_attention_setting(pools):
    """xLSTM has no attention to set to ring_dilated: the refusal names its structure, not the setting."""
    for kind, message in pools(2).run(_attentionless_model_sharded):
        assert kind == "ValueError" and "model type 'xlstm' cannot run with its sequence split" in message, message
        assert "non-attention sequence mixers" in message and "set_attn_implementation" not in message, message


def test_sp_size_must_divide_world(pools):
    for res in pools(2).run(_bad_sp_size):
        assert res[0] == "ValueError" and "does not divide the 2 processes" in res[1]


@pytest.mark.parametrize("how", ["configure", "saved"])
def test_layout_of_config_and_sequence_parallel_must_agree(pools, how):
    for res in pools(2).run(_layout_mismatch, saved_model_dir("llama"), how):
        assert res[0] == "ValueError", res
        assert ("config.ring_dilated has layout='contiguous' but the sequence-parallel setup has layout='zigzag'"
                in res[1]), res


def _tiled_and_rotary_classes():
    from hf_ring.patches import tiling

    found = set()
    for family in patches.FAMILIES.values():
        found.update(family.rotary_classes())
    for model_type in tiling.TILED:  # the hybrids' tiled classes too
        cls, mlp_cls, norms = tiling._classes(model_type)
        found.update(c for c in (cls, mlp_cls, *norms) if c is not None)
    return found


def test_clear_sequence_parallel_restores_every_patched_class_by_identity():
    """Every attribute hf_ring replaced is listed by patches.applied() and put back exactly (the function objects
    the classes themselves held, or none where they inherited it); only the import-time guard stays."""
    from transformers import PreTrainedModel

    from hf_ring.entry.model_call import WHY as GUARD

    classes = _tiled_and_rotary_classes()
    before = {cls: cls.__dict__.get("forward") for cls in classes}
    call = PreTrainedModel.__call__
    assert [str(p) for p in patches.applied()] == [f"transformers.modeling_utils.PreTrainedModel.__call__: {GUARD}"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a family whose loss stands down on this release warns once
        patches.apply_all()
    replaced = {p.owner for p in patches.applied() if p.name == "forward"}
    assert replaced and replaced <= classes
    assert all(cls.__dict__.get("forward") is not before[cls] for cls in replaced)
    hf_ring.clear_sequence_parallel()
    assert {cls: cls.__dict__.get("forward") for cls in classes} == before
    assert [p.name for p in patches.applied()] == ["__call__"] and PreTrainedModel.__call__ is call


def test_an_inherited_attribute_is_deleted_again_not_copied_down():
    """A class that inherited the attribute hf_ring replaced gets its own replacement; clearing deletes it, so the
    class inherits again (and follows its base if the base changes), instead of keeping a copy of the base's."""
    from hf_ring.patches import registry

    class Base:
        def forward(self):
            return "base"

    class Child(Base):
        pass

    assert "forward" not in Child.__dict__
    registry.replace(Child, "forward", lambda original: (lambda self: "patched " + original(self)), "a test patch")
    assert Child().forward() == "patched base" and "forward" in Child.__dict__
    assert registry.original(Child, "forward") is Base.forward
    hf_ring.clear_sequence_parallel()
    assert "forward" not in Child.__dict__ and Child.forward is Base.forward
    Base.forward = lambda self: "changed"
    assert Child().forward() == "changed"


def test_a_prepared_trainer_is_listed_and_restored(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = load(saved_model_dir("llama"), "sdpa")
    trainer = Trainer(model=model, args=TrainingArguments(str(tmp_path), use_cpu=True, report_to=[]))
    hf_ring.prepare_trainer(trainer)
    assert isinstance(trainer, hf_ring.SequenceParallelTrainerMixin) and type(trainer).__bases__[1] is Trainer
    assert any(p.owner is trainer and p.name == "__class__" for p in patches.applied())
    hf_ring.clear_sequence_parallel()
    assert type(trainer) is Trainer and not any(p.owner is trainer for p in patches.applied())


def test_prepare_trainer_refuses_a_layout_other_than_the_models(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = hf_ring.configure(load(saved_model_dir("llama"), "sdpa"), layout="contiguous")
    trainer = Trainer(model=model, args=TrainingArguments(str(tmp_path), use_cpu=True, report_to=[]))
    with pytest.raises(ValueError, match="config.ring_dilated has layout='contiguous' but the sequence-parallel "
                                         "setup has layout='zigzag'"):
        hf_ring.prepare_trainer(trainer, layout="zigzag")
    assert type(trainer) is Trainer


def test_a_scope_sets_up_for_its_block_and_restores_after_it(pools):
    from setup_cases import scope_case

    for seen in pools(2).run(scope_case, saved_model_dir("llama")):
        assert seen["inside"] and seen["patched"] and seen["after"] and seen["after_error"], seen
        assert "already active" in seen["nested"]


def test_single_process_setup_without_distributed():
    sp = hf_ring.setup_sequence_parallel(None)
    assert sp.sp_size == 1 and hf_ring.current() is None
    with pytest.raises(ValueError, match="needs several processes"):
        hf_ring.setup_sequence_parallel(None, 2)
    assert not dist.is_initialized()


def test_a_scoped_change_is_listed_while_it_lasts_and_undone_on_leaving():
    """registry.scoped: an instance's method shadowed for a block (a distillation trainer's backbone call), a
    module's function rebound (a hybrid's kernel): listed by applied() inside, put back exactly after, an exception
    included."""
    import types

    from hf_ring.patches import registry

    class Trainer:
        def backbone(self):
            return "own"

    trainer, module = Trainer(), types.ModuleType("kernels")
    module.scan = original = lambda: "kernel"
    with pytest.raises(RuntimeError, match="inside"):
        with registry.scoped(trainer, "backbone", lambda: "sharded", "a test scope"), \
                registry.scoped(module, "scan", lambda: "hooked", "a test scope"):
            assert trainer.backbone() == "sharded" and module.scan() == "hooked"
            listed = [str(p) for p in patches.applied()[-2:]]
            assert listed == [f"a {Trainer.__module__}.{Trainer.__qualname__} instance's backbone: a test scope",
                              "kernels.scan: a test scope"], listed
            raise RuntimeError("inside")
    assert "backbone" not in vars(trainer) and trainer.backbone() == "own" and module.scan is original
    assert [p.name for p in patches.applied()] == ["__call__"]


def test_the_function_behind_a_kernel_name_is_found_through_transformers_resolution():
    """A modeling module's kernel name is transformers' wrapper around what it resolved at import (here, with no
    kernel package installed, the torch path it wraps); any other function is its own implementation. The hooks run
    a scan whole only where this names a linear-time package (tests/test_gpu_kernels.py: flash-linear-attention)."""
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        kernel = getattr(modeling_qwen3_5, name)
        assert kernel_implementation(kernel) is kernel_function(kernel).__wrapped__, name  # a kernels layer: its function
        assert not linear_kernel(kernel), name
    assert kernel_implementation(batch) is batch


def test_a_kernel_package_release_the_hooks_cannot_run_on_is_named_with_the_fix(monkeypatch):
    """flash-linear-attention's KDA below 0.5.2 gave a wrong gradient for a given start state, which the hooks rely
    on: a KDA kernel resolved to such a release is refused, naming the release and the fix; 0.5.2 and later pass,
    as does any other package function."""
    def chunk_kda(*args):
        return args

    chunk_kda.__module__ = "fla.ops.kda.chunk"
    for version, refused in (("0.5.1", True), ("0.5.2", False), ("0.6.0", False)):
        monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__=version))
        problem = package_problem(chunk_kda)
        assert (problem is not None) == refused, (version, problem)
        if refused:
            assert "flash-linear-attention 0.5.1" in problem and "install flash-linear-attention>=0.5.2" in problem
    assert package_problem(batch) is None
