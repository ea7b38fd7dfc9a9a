"""The supported release range, its refusal at import, and a loss patch that stands down instead of breaking.

The tiled loss's reproduction check is tested here on forwards that differ
from the installed release's in the ways transformers has changed them
between releases (an inlined slice, a renamed cache keyword) and in ways that
change the loss (a logit scale): the first must tile, the second must not.
"""
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM

import hf_ring
from hf_ring import versions
from hf_ring.patches import registry, reproduction, tiling
from hf_ring.integration.seams import CACHE_KEYWORD, TENSOR_PARALLEL_SINCE, since, tensor_parallel_problem
from helpers import rel_err
from models import batch, load, saved_model_dir, tiny_config

pytestmark = pytest.mark.compat  # the subset run on every supported transformers release

ROOT = Path(__file__).resolve().parents[1]


# ---- the range ------------------------------------------------------------------------------------------------

def _declared():
    """pyproject.toml's dependency strings (read without tomllib, which Python 3.10 lacks)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    return re.findall(r'^\s*"([^"]+)"', block, re.M)


def test_pyproject_declares_floors_and_no_caps():
    declared = _declared()
    for package, low in versions.FLOORS.items():
        wanted = [f"{package}>={low}"] + [f"!={v}" for (p, v) in versions.KNOWN_BROKEN if p == package]
        assert ",".join(wanted) in declared, (package, declared)
    assert not any("<" in d for d in declared), declared  # pip must never downgrade a newer release to install us


def test_the_installed_releases_are_not_refused():
    for package in versions.FLOORS:
        assert versions.problem(package, versions.installed(package)) is None


def _next_minor(package: str) -> str:
    major, minor = versions.parse(versions.NEWEST_TESTED[package])[:2]
    return f"{major}.{minor + 1}.0"


@pytest.mark.parametrize("version, refused, warned", [
    ("5.16.1", True, False), ("4.57.6", True, False), ("5.17.0", False, False), ("5.24.0", False, False),
    (versions.NEWEST_TESTED["transformers"], False, False), (_next_minor("transformers"), False, True),
    (_next_minor("transformers") + ".dev0", False, True), ("6.0.0", False, True)])
def test_transformers_releases(version, refused, warned):
    assert (versions.problem("transformers", version) is not None) is refused
    assert (versions.untested("transformers", version) is not None) is warned


def test_local_build_tags_are_read_as_their_release():
    assert versions.problem("torch", "2.11.0+cu130") is None
    newest = versions.NEWEST_TESTED["torch"]
    assert versions.untested("torch", f"{newest}+cpu") is None
    assert versions.untested("torch", _next_minor("torch")) is not None
    assert versions.problem("torch", "2.10.1+cu128") is not None
    with pytest.raises(ValueError, match="release number"):
        versions.parse("main")


def test_a_release_known_to_break_is_refused_naming_what_breaks(monkeypatch):
    monkeypatch.setitem(versions.KNOWN_BROKEN, ("accelerate", "1.13.0"), "its DataLoaderDispatcher drops a batch")
    line = versions.problem("accelerate", "1.13.0")
    assert line.startswith("accelerate 1.13.0 is known to break hf_ring: its DataLoaderDispatcher drops a batch")
    assert versions.problem("accelerate", "1.13.1") is None


def _fake_release(tmp_path: Path, package: str, version: str) -> Path:
    """A directory whose metadata claims ``package==version`` (found first on the path), importing nothing else."""
    info = tmp_path / f"{package}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    return tmp_path


def _import_with(path: Path, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != versions.QUIET}
    environ.update(PYTHONPATH=os.pathsep.join([str(path), str(ROOT)]), **env)
    return subprocess.run([sys.executable, "-W", "default", "-c", "import hf_ring"], capture_output=True, text=True,
                          env=environ, timeout=120)


def test_a_release_below_the_floor_is_refused_at_import_in_one_line(tmp_path):
    run = _import_with(_fake_release(tmp_path, "transformers", "5.0.0"))
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last == ("ImportError: hf_ring needs transformers>=5.17 (the oldest release it is tested on), but 5.0.0 "
                    "is installed; fix: pip install 'transformers>=5.17'"), run.stderr
    assert "ModuleNotFoundError" not in run.stderr


def test_a_newer_release_imports_with_one_warning_on_the_first_rank_only(tmp_path):
    """Counted for the faked package alone: the other packages are whatever pip installed today, and one of them
    may be newer than the newest tested too (each is said once, on its own line)."""
    fake = _fake_release(tmp_path, "transformers", "5.99.0")
    run = _import_with(fake)
    assert run.returncode == 0, run.stderr
    told = [line for line in run.stderr.splitlines() if "UntestedReleaseWarning: transformers " in line]
    assert len(told) == 1, run.stderr
    newest = versions.NEWEST_TESTED["transformers"]
    assert (f"transformers 5.99.0 is newer than the newest release hf_ring is tested on ({newest})" in told[0]
            and "HF_RING_QUIET_UNTESTED=1" in told[0]), told
    for rank, said in (("0", True), ("1", False), ("3", False)):  # torchrun's and accelerate's RANK: once a launch
        run = _import_with(fake, RANK=rank)
        assert run.returncode == 0 and ("UntestedReleaseWarning" in run.stderr) is said, (rank, run.stderr)
    quiet = _import_with(fake, HF_RING_QUIET_UNTESTED="1")
    assert quiet.returncode == 0 and "UntestedReleaseWarning" not in quiet.stderr, quiet.stderr


def test_an_uninstalled_checkout_says_how_to_install_it():
    # -S: no site-packages, so no editable install maps hf_ring.patches; hf_ring itself comes from the checkout
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import hf_ring"
    run = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last == (f"ImportError: hf_ring is imported from a checkout that is not installed for this Python "
                    f"({sys.executable}): hf_ring.patches is mapped at install; fix: {sys.executable} -m pip install "
                    "-e . in the checkout"), run.stderr
    assert "circular import" not in run.stderr


# ---- the loss patch measures instead of reading the source ------------------------------------------------------

def _llama_with(forward):
    return type("CheckedLlamaForCausalLM", (LlamaForCausalLM,), {"forward": forward})


def _inlined_slice(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                   use_cache=None, logits_to_keep=0, **kwargs):
    """The standard forward as some releases wrote it: the slice inlined, the cache under this release's name."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden_states = outputs.last_hidden_state
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = self.lm_head(hidden_states[:, slice_indices, :])
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_KEYWORD: getattr(outputs, CACHE_KEYWORD)})


def _scaled(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
    """A forward whose loss is of scaled logits (as Cohere's is): the tiled loss must not stand in for it."""
    out = LlamaForCausalLM.forward(self, input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
    return type(out)(loss=self.loss_function(logits=out.logits * 1.001, labels=labels,
                                             vocab_size=self.config.vocab_size), logits=out.logits)


def _gradient_off(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
    """A forward whose loss has the right value but a gradient 0.1% too large: only the gradients can tell."""
    out = LlamaForCausalLM.forward(self, input_ids=input_ids, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    loss = out.loss.detach() + (out.loss - out.loss.detach()) * 1.001
    return type(out)(loss=loss, logits=out.logits)


def test_a_forward_whose_gradients_alone_differ_is_not_tiled():
    assert "differs from the tiled loss" in tiling.reproduction_problem(_llama_with(_gradient_off))


def test_a_refactored_standard_forward_is_tiled_and_exact():
    cls = _llama_with(_inlined_slice)
    assert tiling.reproduction_problem(cls) is None
    path = saved_model_dir("llama")
    model, ref = cls.from_pretrained(path, attn_implementation="sdpa"), load(path, "sdpa")
    hf_ring.configure_tiling(model, loss=True, mlp=False, norm=False)
    try:
        data = batch(3, 2, 21)
        out, want = model(**data), ref(**data)
        assert out.logits is None  # the tiled loss ran
        out.loss.backward()
        want.loss.backward()
        assert rel_err(out.loss, want.loss) <= 1e-6
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert rel_err(p.grad, q.grad) <= 1e-5, name
    finally:
        tiling.revert(cls)


def test_a_forward_whose_loss_differs_stands_down_or_is_refused():
    cls = _llama_with(_scaled)
    why = tiling.reproduction_problem(cls)
    assert why is not None and "differs from the tiled loss" in why
    with pytest.raises(TypeError, match=rf"CheckedLlamaForCausalLM \(model type 'llama', transformers "
                                        rf"{transformers.__version__}\).*loss=False"):
        tiling.apply(cls, loss=True)
    assert not tiling.is_applied(cls)
    with pytest.warns(UserWarning, match="trains with the untiled loss") as seen:
        tiling.apply(cls, loss=None)
    assert len(seen) == 1 and not tiling.is_applied(cls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiling.apply(cls, loss=None)  # said once per process
    tiling.revert(cls)


def test_a_loss_that_stands_down_does_so_at_its_first_model_and_leaves_the_other_families_and_the_rows_tiled(
        monkeypatch):
    """Setup patches every family without building a model of any (the check runs at a model's first tiled
    forward, with its config): a family whose loss the tiled loss does not reproduce warns there, once, and that
    model trains with its own loss; the other families and the rows stay tiled."""
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mistral.modeling_mistral import MistralForCausalLM

    own = LlamaForCausalLM.forward

    def scaled(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):  # as _scaled, calling the class's own
        out = own(self, input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
        return type(out)(loss=self.loss_function(logits=out.logits * 1.001, labels=labels,
                                                 vocab_size=self.config.vocab_size), logits=out.logits)

    tiling.revert_all()
    monkeypatch.setattr(LlamaForCausalLM, "forward", scaled)
    monkeypatch.setattr(tiling, "_WARNED", set())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing said, nothing built, at setup
            tiling.apply_all()
        assert tiling.is_applied(MistralForCausalLM) and registry.is_replaced(LlamaMLP, "forward")
        model = LlamaForCausalLM(tiny_config("llama"))
        data = batch(1, 1, 9)
        monkeypatch.setattr(tiling, "_on", lambda setting, config: True)  # as under sequence parallelism
        with pytest.warns(UserWarning, match="LlamaForCausalLM .* trains with the untiled loss"):
            got = model(**data).loss
        assert got == scaled(model, **data).loss
    finally:
        tiling.revert_all()


def test_a_model_whose_own_config_changes_its_loss_runs_its_own_loss(monkeypatch):
    """A class that passes with its default config is checked again with the model's config on its first tiled
    call: a config switching on a loss term the tiled loss lacks keeps the model's own loss."""
    monkeypatch.setattr(reproduction, "LOSS_SWITCHES", {"logit_scale_for_test": 1.001})
    monkeypatch.setattr(tiling, "_WARNED", set())

    def scaled_by_config(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
        out = LlamaForCausalLM.forward(self, input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
        scale = getattr(self.config, "logit_scale_for_test", 1.0)
        return type(out)(loss=self.loss_function(logits=out.logits * scale, labels=labels,
                                                 vocab_size=self.config.vocab_size), logits=out.logits)

    cls = _llama_with(scaled_by_config)
    tiling.apply(cls, loss=True)  # the class passes with its default config, which lacks the key
    try:
        model = cls(tiny_config("llama", logit_scale_for_test=1.0))
        with pytest.raises(TypeError, match="cannot be honoured for CheckedLlamaForCausalLM .*differs"):
            hf_ring.configure_tiling(model, loss=True)
        model.config.ring_tiling = {"loss": True}  # set by hand: found on the first tiled call instead
        with pytest.raises(TypeError, match="cannot be honoured for CheckedLlamaForCausalLM .*differs"):
            model(**batch(1, 1, 9))
        model = cls(tiny_config("llama", logit_scale_for_test=1.0))
        monkeypatch.setattr(tiling, "_on", lambda setting, config: True)  # as under sequence parallelism
        with pytest.warns(UserWarning, match="trains with the untiled loss"):
            out = model(**batch(1, 1, 9))
        assert out.logits is not None  # its own loss ran
    finally:
        tiling.revert(cls)


def test_the_check_leaves_the_callers_random_stream_alone():
    cls = _llama_with(_inlined_slice)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    tiling.reproduction_problem(cls, tiny_config("llama", rms_norm_eps=1e-5 + 1e-9))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_releases_without_tensor_parallelism_of_a_loaded_model_refuse_it():
    class Old(LlamaForCausalLM):
        _resolve_parallel_plans = None  # as before transformers 5.23

    why = tensor_parallel_problem(Old.__new__(Old))
    assert why is not None and f"it needs transformers>={TENSOR_PARALLEL_SINCE}" in why
    assert (tensor_parallel_problem(LlamaForCausalLM.__new__(LlamaForCausalLM)) is None) == since(
        TENSOR_PARALLEL_SINCE)
