"""A hybrid type transformers does not ship: Qwen3.5's text model under another model type and other class names,
its configuration and modeling code modules of their own in a temporary folder (as a model with code of its own
is), registered with the auto classes. Nothing of hf_ring's names it.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile

import torch

MODEL_TYPE = "tinyhybrid"
MODELING = "tinyhybrid_modeling"
CONFIGURATION = "tinyhybrid_configuration"


def _rewritten(path: str) -> str:
    with open(path) as f:
        text = f.read()
    text = re.sub(r"from \.\.\. import", "from transformers import", text)
    text = re.sub(r"from \.\.\.", "from transformers.", text)
    text = re.sub(r"from \.\.auto", "from transformers.models.auto", text)
    text = text.replace("from .configuration_qwen3_5", f"from {CONFIGURATION}")
    text = text.replace('"qwen3_5_text"', f'"{MODEL_TYPE}"').replace('"qwen3_5"', f'"{MODEL_TYPE}_vl"')
    return text.replace("Qwen3_5", "TinyHybrid")


def register() -> str:
    """Write, import and register the type (once per process); its model type."""
    if MODELING in sys.modules:
        return MODEL_TYPE
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tempfile.mkdtemp(prefix="hf_ring_tinyhybrid_")
    for name, source in ((CONFIGURATION, "configuration_qwen3_5"), (MODELING, "modeling_qwen3_5")):
        target = os.path.join(folder, f"{name}.py")
        with open(target, "w") as f:
            f.write(_rewritten(importlib.util.find_spec(f"transformers.models.qwen3_5.{source}").origin))
        spec = importlib.util.spec_from_file_location(name, target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    config = sys.modules[CONFIGURATION].TinyHybridTextConfig
    AutoConfig.register(MODEL_TYPE, config)
    AutoModelForCausalLM.register(config, sys.modules[MODELING].TinyHybridForCausalLM)
    return MODEL_TYPE


def step_case(**kwargs):
    """Rank function: :func:`sweep.sharded_step_case` of the type, registered in this rank first."""
    import sweep

    return sweep.sharded_step_case(register(), dtype=torch.float64, **kwargs)


def generate_case(path: str, **kwargs):
    """Rank function: :func:`hybrid_cases.generate_case` of the type saved at ``path``, registered first."""
    import hybrid_cases

    return hybrid_cases.generate_case(register(), path, **kwargs)
