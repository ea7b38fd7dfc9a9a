"""Every causal-LM type of the installed transformers, shrunk from its own defaults: exact against ``eager`` in
one process and on 2 ranks, or refused with a message; a type that cannot be built tiny is skipped with why.

The net under :mod:`hf_ring.integration.masks`: a model whose mask says more than causality
and a window (chunks, blocks, a window known only to its mask) is computed
exactly or refused, never silently wrong; a new type or release shows up here.
"""
import warnings

import pytest
import torch

import sweep
from helpers import gradient_errors, rel_err

pytestmark = pytest.mark.filterwarnings("ignore")

TOL = 1e-5
TYPES = sweep.causal_lm_types()
ROWS = {}


def row(model_type):
    if model_type not in ROWS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ROWS[model_type] = sweep.one_process_row(model_type)
    return ROWS[model_type]


def skip_unrunnable(found):
    if found["status"] in ("unbuilt", "eager-fails", "not-routed"):
        pytest.skip(f"{found['status']}: {found['why'][:200]}")


@pytest.mark.compat  # the net for a new release: every type of it, in one process
@pytest.mark.parametrize("model_type", TYPES)
def test_one_process_is_exact_or_refused(model_type):
    found = row(model_type)
    skip_unrunnable(found)
    assert found["status"] in ("exact", "refused"), found
    if found["status"] == "refused":
        assert "attn_implementation='sdpa'" in found["why"] or "attn_implementation='eager'" in found["why"], found


@pytest.mark.parametrize("model_type", TYPES)
def test_two_ranks_are_exact_or_refused_alike(pools, model_type):
    found = row(model_type)
    skip_unrunnable(found)
    if found["status"] == "refused":
        pytest.skip("refused in one process")
    # float64 where the model runs in it: rounding stays far below the bound, and a wrong pair does not
    try:
        dtype, want = torch.float64, sweep.eager_step(model_type)
    except RuntimeError:  # a kernel without float64 (grouped expert matmuls)
        dtype, want = torch.float32, sweep.eager_step(model_type, dtype=torch.float32)
    got = pools(2).run(sweep.sharded_step_case, model_type, dtype=dtype)
    refusals = [r.get("refused") for r in got]
    if any(refusals):
        assert refusals[0] == refusals[1], refusals  # the same error on every rank
        return
    errs = {"loss": rel_err(got[0]["loss"], want["loss"]), **gradient_errors(got[0]["grads"], want["grads"])}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= TOL, (worst, errs[worst])
