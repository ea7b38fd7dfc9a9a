"""A pytest plugin (``-p bench.ring_forced``) that makes ``ring_dilated`` the attention of every model a test builds
without naming one, where transformers would pick ``sdpa``: transformers' own model tests then check README's
promise that, without a sequence-parallel setup, ``ring_dilated`` is usable wherever ``sdpa`` is. A test that names
an implementation keeps it; a model that cannot take ``sdpa`` keeps the one transformers falls back to."""
from __future__ import annotations

import functools

FORCED = "ring_dilated"


def _forcing(resolve):
    @functools.wraps(resolve)
    def get_correct_attn_implementation(self, requested_attention=None, is_init_check=False):
        chosen = resolve(self, requested_attention, is_init_check)
        return FORCED if requested_attention is None and chosen == "sdpa" else chosen

    return get_correct_attn_implementation


def pytest_configure(config) -> None:  # noqa: ARG001 -- pytest's hook signature
    import hf_ring  # noqa: F401 -- registers ring_dilated
    from transformers import PreTrainedModel

    PreTrainedModel.get_correct_attn_implementation = _forcing(PreTrainedModel.get_correct_attn_implementation)
