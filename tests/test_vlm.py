"""Vision-language models: towers on their own attention, the language model split after the images merge."""
from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from vlm import FAMILIES
from vlm_cases import TOL, generate, step, worst


@pytest.mark.parametrize("name", list(FAMILIES))
def test_two_ranks_equal_one_process_eager(pools, name):
    path = FAMILIES[name].build()
    want = step(name, path)
    got = pools(2).run(step, name, path)
    key, err, _ = worst(got[0], want)
    assert err <= TOL, (key, err)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_generate_with_images_gives_model_generate_tokens(pools, name):
    path = FAMILIES[name].build()
    want = generate(name, path)
    got = pools(2).run(generate, name, path)
    assert all(torch.equal(g, want) for g in got), (want[:, -4:], [g[:, -4:] for g in got])
