"""Offloaded checkpoints: the layer inputs leave the device and come back; loss and gradients are unchanged."""
import pytest
import torch
import torch.distributed as dist

import hf_ring
import hf_ring.training.offload as offload
from hf_ring.integration.seams import enable_checkpointing
from helpers import rel_err
from models import batch, load, saved_model_dir


def checkpointed_step(path, offloaded, sp_size=None, n=37):
    """Loss, every gradient and the offloaded tensors of one training step with activation checkpointing."""
    sp = hf_ring.setup_sequence_parallel(None, sp_size) if sp_size else None
    try:
        model = load(path, "ring_dilated").train()
        enable_checkpointing(model)
        packed = []
        saved_pack = offload._pack
        if offloaded:
            assert hf_ring.offload_checkpoints(model) == model.config.num_hidden_layers

            def spy(t):
                device, host = saved_pack(t)
                packed.append({"shape": tuple(t.shape), "host": host.device.type,
                               "copied": host.data_ptr() != t.data_ptr()})
                return device, host

            offload._pack = spy
        try:
            data = batch(3, 2, n)
            out = model(**(hf_ring.shard_batch(data) if sp else data))
            out.loss.backward()
        finally:
            offload._pack = saved_pack
        loss = out.loss.detach().clone()
        if sp:
            hf_ring.sync_gradients(model)
            dist.all_reduce(loss, group=sp.sp_group)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        return {"loss": float(loss), "grads": grads, "packed": packed}
    finally:
        if sp:
            hf_ring.clear_sequence_parallel()


def _same(a, b):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    errs = {name: rel_err(a["grads"][name], b["grads"][name]) for name in b["grads"]}
    assert max(errs.values()) <= 1e-6, errs


def test_offloaded_step_equals_plain_checkpointing():
    path = saved_model_dir("llama")
    plain, moved = checkpointed_step(path, False), checkpointed_step(path, True)
    _same(moved, plain)
    hidden = load(path, "sdpa").config.hidden_size
    # One input per layer left for host memory, as a copy: (batch, rows, hidden).
    assert [p["shape"] for p in moved["packed"]] == [(2, 37, hidden)] * 2
    assert all(p["host"] == "cpu" and p["copied"] for p in moved["packed"])


def test_offloaded_sequence_parallel_step_equals_one_process(pools):
    path = saved_model_dir("llama")
    one = checkpointed_step(path, False)
    results = pools(2).run(checkpointed_step, path, True, 2)
    _same(results[0], one)
    assert all(p["shape"][1] in (18, 19) for p in results[0]["packed"])  # this rank's rows only


def test_offload_needs_checkpointing_and_reverts():
    model = load(saved_model_dir("llama"), "ring_dilated").train()
    with pytest.raises(ValueError, match="gradient checkpointing on"):
        hf_ring.offload_checkpoints(model)
    enable_checkpointing(model)
    layer = model.model.layers[0]
    before = layer._gradient_checkpointing_func
    hf_ring.offload_checkpoints(model)
    assert isinstance(layer._gradient_checkpointing_func, offload.OffloadedCheckpoint)
    hf_ring.offload_checkpoints(model, enable=False)
    assert layer._gradient_checkpointing_func is before


def test_frozen_embeddings_still_give_layer_gradients():
    """LoRA-style: embeddings frozen, so the first layer's input needs no gradient; its weights still get theirs."""
    path = saved_model_dir("llama")
    model = load(path, "ring_dilated").train()
    enable_checkpointing(model)
    hf_ring.offload_checkpoints(model)
    model.get_input_embeddings().weight.requires_grad_(False)
    model(**batch(3, 2, 37)).loss.backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0)
               for name, p in model.named_parameters() if "layers.0." in name)
    assert torch.is_grad_enabled()
