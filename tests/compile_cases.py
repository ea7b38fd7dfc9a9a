"""torch.compile as users turn it on, on every rank of a pool or in one process (module-level so they pickle)."""
from __future__ import annotations

import logging
import tempfile
import warnings
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

import hf_ring
from trainer_cases import GradRecorder, RowDataset, trainer_data, trainer_env


class _Told(logging.Handler):
    """Every warning torch's own loggers print (dynamo's graph breaks and untraceable calls go there). The CUDA
    build's once-per-process note on where CUDA lives, printed on a machine without a GPU whatever is compiled,
    keeps its file, so it reads as torch's own warning."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        where = record.pathname if record.name == "torch.utils.cpp_extension" else "torch log"
        self.lines.append((where, record.getMessage()[:300]))


def compiled_trainer_case(path: str, sp_size: Optional[int] = None, ulysses_size: Optional[int] = None,
                          compiled: bool = True, steps: int = 2) -> Dict[str, Any]:
    """A Trainer with ``TrainingArguments(torch_compile=compiled)``, under ``prepare_trainer`` when ``sp_size`` is
    given: its logged losses, every optimizer step's gradients, and every warning printed while it trained."""
    from accelerate.state import AcceleratorState
    from models import load
    from transformers import Trainer, TrainingArguments

    trainer_env()
    AcceleratorState._reset_state()
    torch._dynamo.reset()
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = load(path, "sdpa" if sp_size is None else "ring_dilated").train()
    rows = 2 * steps * (world // (sp_size or 1))
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf_ring_compile_"), per_device_train_batch_size=1,
        gradient_accumulation_steps=2, max_steps=steps, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
        max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, use_cpu=True, train_sampling_strategy="sequential",
        disable_tqdm=True, save_strategy="no", torch_compile=compiled)
    recorder = GradRecorder()
    trainer = Trainer(model=model, args=args, train_dataset=RowDataset(trainer_data(1, rows, 23)),
                      callbacks=[recorder.callback])
    told = _Told()
    logging.getLogger("torch").addHandler(told)
    try:
        if sp_size is not None:
            hf_ring.prepare_trainer(trainer, sp_size, ulysses_size=ulysses_size)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return {"losses": losses, "grads": recorder.steps,
                "warnings": [(w.filename, str(w.message)[:300]) for w in caught] + told.lines}
    finally:
        logging.getLogger("torch").removeHandler(told)
        hf_ring.clear_sequence_parallel()
