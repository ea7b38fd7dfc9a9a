"""Benchmarks and the docs' tables, from a checkout: ``python -m bench <name>`` (each takes ``--help``)."""

BENCHES = {"ring": "bench.ring", "dilated": "bench.dilated", "generate": "bench.generate",
           "scale": "bench.scale", "model": "bench.model",
           "gpu": "bench.gpu", "quality": "bench.quality",
           "linear": "bench.linear",
           "tables": "bench.tables", "plan": "bench.plan", "compat": "bench.compat",
           "compile": "bench.compile", "sft": "bench.sft", "vision": "bench.vision", "fixed": "bench.fixed",
           "demo": "bench.demo", "exactness": "bench.exactness", "hybrid": "bench.hybrid",
           "endings": "bench.endings", "model_tests": "bench.model_tests",
           "moe": "bench.moe", "packed": "bench.packed"}
"""Each command's module."""
