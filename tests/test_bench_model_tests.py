"""``bench model_tests`` on a checkout of its own making: a test file as transformers ships them, whose tests build a
tiny Llama with and without naming an implementation."""
import json
import textwrap

from bench import model_tests

TEST_FILE = '''
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)


def _model(**kwargs):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG, **kwargs)).eval()


def test_default_is_sdpa():
    assert _model().config._attn_implementation == "sdpa"


def test_logits_equal_eager():
    ids = torch.randint(0, 97, (2, 11))
    want = _model(attn_implementation="eager")(ids).logits
    torch.testing.assert_close(_model()(ids).logits, want)


def test_what_the_forced_attention_computes_wrong():
    if _model().config._attn_implementation == "ring_dilated":  # stands for a wrong result
        raise RuntimeError("logits differ")


def test_fails_stock_too():
    assert False, "broken in the checkout"


@pytest.mark.skip(reason="needs a GPU")
def test_skipped():
    pass
'''


def test_a_checkouts_tests_run_stock_and_forced_and_their_failures_are_sorted(tmp_path):
    checkout = tmp_path / "transformers"
    (checkout / "tests" / "models" / "llama").mkdir(parents=True)
    (checkout / "tests" / "models" / "llama" / "test_modeling_llama.py").write_text(textwrap.dedent(TEST_FILE))
    model_tests.main(["--transformers", str(checkout), "--models", "llama", "mistral", "--out", str(tmp_path)])
    rows = {r["model_type"]: r for r in json.loads((tmp_path / "model_tests.json").read_text())["rows"]}
    llama = rows["llama"]
    assert (llama["stock_passed"], llama["stock_failed"], llama["forced_passed"], llama["forced_failed"]) == (
        3, 1, 1, 3), llama
    assert llama["name_checks"] == ["tests.models.llama.test_modeling_llama::test_default_is_sdpa"]
    assert list(llama["hf_ring_failures"]) == [
        "tests.models.llama.test_modeling_llama::test_what_the_forced_attention_computes_wrong"]
    assert llama["failing_stock_too"] == ["tests.models.llama.test_modeling_llama::test_fails_stock_too"]
    assert not rows["mistral"]["ran"] and "does not exist" in rows["mistral"]["why"]
    assert llama["command"].startswith("python -m bench model_tests --transformers")
