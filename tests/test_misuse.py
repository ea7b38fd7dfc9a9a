"""Misuse refused at the call with a message that says what to do: prepare_trainer called twice or once training
has started, attention dropout under the setting's own name, one process asked to split a sequence."""
import types

import pytest
import torch

import hf_ring
from helpers import raises_on_rank
from trainer_cases import RowDataset, trainer_data, trainer_env
from hf_ring.entry.backend import _dropout_setting, _refuse_unsupported
from models import saved_model_dir

ONCE = "once, after building the trainer and before trainer.train()"


def _trainer(path, attn="ring_dilated", callbacks=(), steps=2):
    """A Trainer on a tiny model with 2 rows per replica and step (the world's ranks joined by accelerate)."""
    import tempfile

    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from models import load

    trainer_env()
    AcceleratorState._reset_state()
    world = dist.get_world_size() if dist.is_initialized() else 1
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hf_ring_misuse_"), per_device_train_batch_size=1,
                             max_steps=steps, learning_rate=0.1, optim="sgd", report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, train_sampling_strategy="sequential")
    return Trainer(model=load(path, attn).train(), args=args, callbacks=list(callbacks),
                   train_dataset=RowDataset(trainer_data(1, steps * world, 16)))


def _second_call(path):
    trainer = _trainer(path)
    hf_ring.prepare_trainer(trainer, 2)
    try:
        sp, cls = hf_ring.integration.groups.current(), type(trainer)
        got = [raises_on_rank(hf_ring.prepare_trainer, trainer, sp_size=1),
               raises_on_rank(hf_ring.prepare_trainer, trainer, 2)]  # the same arguments again: refused too
        now = hf_ring.integration.groups.current()
        return {"errors": got, "same_setup": now is sp, "sp_size": now.sp_size, "dp_size": now.dp_size,
                "same_class": type(trainer) is cls, "cp_size": trainer.get_cp_size()}
    finally:
        hf_ring.clear_sequence_parallel()


def test_second_prepare_trainer_call_is_refused_and_keeps_the_first_setup(pools):
    """sp_size=2 then sp_size=1 used to switch silently to data parallelism."""
    for res in pools(2).run(_second_call, saved_model_dir("llama")):
        assert res["same_setup"] and res["same_class"], res
        assert (res["sp_size"], res["dp_size"], res["cp_size"]) == (2, 1, 2), res
        for kind, message in res["errors"]:
            assert kind == "ValueError", message
            assert message.startswith("prepare_trainer was already called on this trainer "
                                      "(sp_size=2, layout='zigzag', ulysses_size=1)"), message
            assert "once per trainer" in message and "build a new trainer" in message, message
        assert "second call (sp_size=1," in res["errors"][0][1]


def _call_from_callback(path, event):
    from transformers import TrainerCallback

    class Prepare(TrainerCallback):
        trainer = None

    def prepare(self, args, state, control, **kwargs):
        hf_ring.prepare_trainer(self.trainer, 2)

    callback = type("PrepareLate", (Prepare,), {event: prepare})()
    trainer = _trainer(path, attn="sdpa", callbacks=[callback])
    callback.trainer = trainer
    try:
        got = raises_on_rank(trainer.train)
        attn = trainer.model.config._attn_implementation
        return got, hf_ring.integration.groups.current() is None, attn, trainer.state.global_step
    finally:
        hf_ring.clear_sequence_parallel()


@pytest.mark.parametrize("event", ["on_train_begin", "on_step_begin"])
def test_prepare_trainer_from_a_training_callback_is_refused(pools, event):
    """It used to fail later, as 'ranks ... passed different batches to hf_ring.shard_batch'."""
    for got, no_setup, attn, step in pools(2).run(_call_from_callback, saved_model_dir("llama"), event):
        assert got is not None and got[0] == "ValueError", got
        assert got[1].startswith("prepare_trainer was called after trainer.train() started"), got[1]
        assert ONCE in got[1] and "shard_batch" not in got[1], got[1]
        assert no_setup and attn == "sdpa" and step == 0  # refused before it changed anything


def test_prepare_trainer_in_one_process_twice_or_after_training_is_refused():
    trainer = _trainer(saved_model_dir("llama"), attn="sdpa", steps=1)
    trainer.train()
    with pytest.raises(ValueError, match=r"^prepare_trainer was called after trainer\.train\(\) started") as err:
        hf_ring.prepare_trainer(trainer)
    assert ONCE in str(err.value)
    assert trainer.model.config._attn_implementation == "sdpa"

    trainer = _trainer(saved_model_dir("llama"), attn="sdpa", steps=1)
    with pytest.raises(ValueError, match="needs several processes"):
        hf_ring.prepare_trainer(trainer, sp_size=2)  # a refused call leaves the trainer unprepared
    hf_ring.prepare_trainer(trainer)
    with pytest.raises(ValueError, match=r"^prepare_trainer was already called on this trainer \(sp_size=1, "):
        hf_ring.prepare_trainer(trainer)


def test_one_process_asked_to_split_says_how_to_launch_several():
    with pytest.raises(ValueError) as err:
        hf_ring.setup_sequence_parallel(None, 2)
    message = str(err.value)
    assert message.startswith("sp_size=2, ulysses_size=1 needs several processes"), message
    for advice in ("torchrun --nproc_per_node N script.py", "accelerate launch --num_processes N script.py",
                   "--multi_gpu", "ACCELERATE_USE_CPU=true", "else accelerate starts one process"):
        assert advice in message, (advice, message)


@pytest.mark.parametrize("config,name", [
    (dict(attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1), "attn_pdrop"),  # GPT-2, GPT-J, CodeGen
    (dict(attention_dropout=0.0, attention_probs_dropout_prob=0.1), "attention_probs_dropout_prob"),
    (dict(attention_dropout=0.2), "attention_dropout"),
    (dict(attn_dropout=0.1, attention_dropout=None), "attn_dropout"),
    (dict(attn_config=types.SimpleNamespace(attn_pdrop=0.1)), "attn_config.attn_pdrop"),  # MPT, DBRX
    (dict(attn_config={"attn_pdrop": 0.1}), "attn_config.attn_pdrop"),
    (dict(attn_pdrop=0.0, hidden_dropout=0.1), "attention_dropout"),  # none set: the common name
])
def test_dropout_refusal_names_the_config_setting(config, name):
    config = types.SimpleNamespace(**config)
    assert _dropout_setting(config) == name
    with pytest.raises(ValueError, match="ring_dilated does not implement attention dropout") as err:
        _refuse_unsupported(0.1, True, {}, config)
    assert f"set config.{name} = 0.0 before the model is built" in str(err.value)
    _refuse_unsupported(0.1, False, {}, config)  # not in training: nothing to refuse


def _gpt2():
    from transformers import AutoModelForCausalLM, GPT2Config

    import hf_ring  # noqa: F401  (registers ring_dilated)

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_embd=64, n_layer=1, n_head=4, n_positions=64, attn_pdrop=0.1,
                        bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="ring_dilated")


@pytest.mark.parametrize("family,name", [("gpt2", "attn_pdrop"), ("llama", "attention_dropout")])
def test_model_in_training_with_attention_dropout_is_told_its_own_setting(family, name):
    from models import load

    model = _gpt2() if family == "gpt2" else load(saved_model_dir("llama"), "ring_dilated", attention_dropout=0.1)
    ids = torch.randint(0, 97, (1, 8))
    with pytest.raises(ValueError, match="does not implement attention dropout") as err:
        model.train()(input_ids=ids)
    message = str(err.value)
    assert f"from_pretrained(..., {name}=0.0)" in message and f"config.{name} = 0.0" in message, message
    if name != "attention_dropout":
        assert "attention_dropout" not in message, message
    model.eval()(input_ids=ids)  # without training there is no dropout to refuse
