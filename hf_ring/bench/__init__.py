"""Benchmarks: ``python -m hf_ring.bench <name>``."""
