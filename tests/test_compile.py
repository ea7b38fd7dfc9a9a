"""torch.compile as users turn it on: ``torch.compile(model)`` and ``TrainingArguments(torch_compile=True)`` under
``prepare_trainer``, exact against eager on 1 and 2 ranks (ring and head parallelism), with no warning printed.

hf_ring's attention, mask hook, tiled loss and rows and the global-length RoPE stay outside the compiled graph
on purpose (``torch.compiler.disable``): they hold collectives and host-side plans. The rest of the model is
compiled as without hf_ring. A compiled decoding step in one process over transformers' own cache is traced
whole (``fullgraph=True``, transformers' recommended fast generation): the guard on the model's call reads no
tensor there, and the attention and its mask are what ``sdpa``'s are for such a step.
"""
import os

import pytest
import torch

from compile_cases import compiled_trainer_case
from helpers import rel_err
from models import saved_model_dir

pytestmark = pytest.mark.compat  # what dynamo traces differs between torch releases

TOL = 1e-5


def _reference(path):
    """One process, ``sdpa``: eager (the numbers), and compiled (the warnings torch.compile prints without hf_ring)."""
    eager = compiled_trainer_case(path, compiled=False)
    return dict(eager, warnings=compiled_trainer_case(path)["warnings"])


TORCH = os.path.dirname(torch.__file__)


def _ours(warnings):
    """What was printed beyond torch's own warnings from its own files (its import-time deprecations), which
    torch.compile prints on any model; every dynamo log line counts."""
    return {message for where, message in warnings if where == "torch log" or not where.startswith(TORCH)}


def _check(got, want):
    assert _ours(got["warnings"]) <= _ours(want["warnings"]), _ours(got["warnings"]) - _ours(want["warnings"])
    assert len(got["losses"]) == len(want["losses"])
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= TOL * abs(b), (got["losses"], want["losses"])
    for step, ref in zip(got["grads"], want["grads"]):
        errs = {name: rel_err(step[name], g) for name, g in ref.items()}
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, (worst, errs[worst])


def test_a_compiled_model_in_one_process_equals_eager():
    path = saved_model_dir("llama")
    _check(compiled_trainer_case(path, sp_size=1), _reference(path))


@pytest.mark.parametrize("ulysses", [1, 2], ids=["ring", "ulysses"])
def test_a_compiled_trainer_on_two_ranks_equals_one_process_eager(pools, ulysses):
    path = saved_model_dir("llama")
    got = pools(2).run(compiled_trainer_case, path, 2, ulysses_size=ulysses)
    want = _reference(path)
    for res in got:
        _check(res, want)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_compiled_fullgraph_generation_over_a_static_cache_gives_sdpas_tokens(model_type):
    """``model.generate(..., cache_implementation="static", compile_config=CompileConfig(fullgraph=True))`` in one
    process, a Llama and a hybrid (Qwen3.5: delta-rule layers beside attention): it compiles (a graph break raises
    under fullgraph) and gives sdpa's compiled tokens and logits."""
    import sweep
    from transformers import CompileConfig

    ids = sweep.inputs("", batch=1, seed=3, n=12)["input_ids"]
    runs = {}
    for attn in ("sdpa", "ring_dilated"):
        model, why = sweep.build(model_type, attn, torch.float32, "hybrid")
        assert model is not None, why
        compile_config = CompileConfig(fullgraph=True)
        compile_config._compile_all_devices = True  # transformers compiles on GPUs only unless told
        torch._dynamo.reset()
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                    cache_implementation="static", compile_config=compile_config, pad_token_id=0,
                                    output_logits=True, return_dict_in_generate=True)
        assert hasattr(model, "_compiled_call"), attn  # the decoding steps ran compiled, not skipped
        runs[attn] = (out.sequences, torch.stack(out.logits))
    assert torch.equal(runs["ring_dilated"][0], runs["sdpa"][0])
    assert rel_err(runs["ring_dilated"][1], runs["sdpa"][1]) <= TOL
