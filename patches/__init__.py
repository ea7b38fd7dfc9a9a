"""Per-model-family patches (shipped as ``hf_ring.patches``)."""
