"""What the ranks of the tensor-parallel tests run: one training step of a tiny model on a (dp, sp, tp) mesh."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hf_ring


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a DTensor (a collective over its mesh: every rank calls it), a plain one as it is."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _data(seed: int, b: int, n: int, documents=None):
    """Random rows (labels on every token), or one packed row of documents of the given lengths."""
    from models import batch

    if documents is None:
        data = batch(seed, b, n)
        del data["attention_mask"]
        return data
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (1, sum(documents)), generator=g)
    positions = torch.cat([torch.arange(length) for length in documents])[None]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def tp_step_case(path, sp_size, tp_size, seed, b, n, *, pattern=None, ulysses=1, documents=None, fsdp=False,
                 return_logits=False, whole=False):
    """One training step with the sequence split over sp and the heads over tp; the loss summed over sp and
    every parameter's whole gradient (gathered over tp) on rank 0.

    ``fsdp``: the model is sharded at load time by transformers (FSDP2 over the dp x sp ranks, TP over the tp
    groups) and reduces its own gradients, the loss scaled by ``sp.loss_scale``; otherwise it is loaded whole,
    sharded with hf_ring.tensor_parallel and its gradients synced with hf_ring.sync_gradients. ``whole``
    (``sp_size`` 1): the batch goes to the model as it is, without hf_ring.shard_batch.
    """
    from models import load

    sp = hf_ring.setup_sequence_parallel(None, sp_size, tp_size=tp_size, ulysses_size=ulysses)
    try:
        if fsdp:
            from transformers.distributed import DistributedConfig

            world = dist.get_world_size()
            model = load(path, "ring_dilated", distributed_config=DistributedConfig(
                tp_size=tp_size, fsdp_size=world // tp_size)).train()
        else:
            model = hf_ring.tensor_parallel(load(path, "ring_dilated").train())
        hf_ring.configure(model, pattern=pattern, ulysses_size=ulysses)
        data = _data(seed + sp.dp_rank, b, n, documents)
        out = model(**(data if whole else hf_ring.shard_batch(data)), return_logits=return_logits)
        (out.loss * (sp.loss_scale if fsdp else 1.0)).backward()
        refused = None
        try:  # FSDP2 reduced the gradients already: sync_gradients refuses them (before any exchange)
            hf_ring.sync_gradients(model)
        except ValueError as err:
            refused = str(err)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        tp_losses = [torch.zeros_like(loss) for _ in range(tp_size)]
        dist.all_gather(tp_losses, loss, group=sp.tp_group)
        grads = {name: _full(p.grad) for name, p in model.named_parameters()}
        return {"dp_rank": sp.dp_rank, "tp_rank": sp.tp_rank, "loss": float(loss),
                "tp_losses": [float(x) for x in tp_losses],
                "dtensor": sorted({type(p).__name__ for p in model.parameters()}), "sync_refused": refused,
                "tiled_loss": out.logits is None,
                "grads": grads if dist.get_rank() == 0 else None}
    finally:
        hf_ring.clear_sequence_parallel()


def tp_refusal_case(path, sp_size, tp_size, ulysses=1, shard="hf_ring"):
    """The error (type and message) this rank raises setting up, or None when everything is accepted."""
    from models import load

    try:
        sp = hf_ring.setup_sequence_parallel(None, sp_size, tp_size=tp_size, ulysses_size=ulysses)
        if shard == "transformers":  # as under torchrun: transformers reads the world from the environment
            from trainer_cases import trainer_env

            trainer_env()
            model = load(path, "ring_dilated", tp_plan="auto", device_mesh=sp.tp_mesh).train()
        else:
            model = load(path, "ring_dilated").train()
        if shard == "hf_ring":
            hf_ring.tensor_parallel(model)
        out = model(**hf_ring.shard_batch(_data(0, 1, 16)))
        out.loss.backward()
        hf_ring.sync_gradients(model, sp)
        return None
    except (ValueError, TypeError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    finally:
        hf_ring.clear_sequence_parallel()


def different_tp_batches_case():
    """shard_batch on a (sp 2, tp 2) setup where the two ranks of each tp group hold different batches."""
    sp = hf_ring.setup_sequence_parallel(None, 2, tp_size=2)
    try:
        hf_ring.shard_batch(_data(sp.tp_rank, 1, 16))
        return None
    except ValueError as err:
        return str(err)
    finally:
        hf_ring.clear_sequence_parallel()


def trainer_refusal_case(path, sp_size, tp_size, pre_shard=False):
    """prepare_trainer(tp_size=...) on a Trainer of a model loaded whole (``pre_shard``: then sharded by
    hf_ring.tensor_parallel over pairs of ranks): the error this rank raises, or None."""
    import tempfile

    from accelerate.state import AcceleratorState
    from trainer_cases import RowDataset, trainer_data, trainer_env
    from models import load
    from transformers import Trainer, TrainingArguments

    trainer_env()
    AcceleratorState._reset_state()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hf_ring_tp_trainer_"), max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    model = load(path, "ring_dilated").train()
    if pre_shard:
        hf_ring.tensor_parallel(model, hf_ring.setup_sequence_parallel(None, tp_size=2))
        hf_ring.clear_sequence_parallel()
    trainer = Trainer(model=model, args=args, train_dataset=RowDataset(trainer_data(1, 4, 9)))
    try:
        hf_ring.prepare_trainer(trainer, sp_size, tp_size=tp_size)
        return None
    except ValueError as err:
        return str(err)
    finally:
        hf_ring.clear_sequence_parallel()


def data_mesh_case(sp_size, tp_size, rows=8):
    """The rows accelerate's data loader gives this rank through the trainer's data mesh, and the mesh's dims."""
    from accelerate.data_loader import prepare_data_loader
    from hf_ring.training.trainer import data_mesh

    sp = hf_ring.setup_sequence_parallel(None, sp_size, tp_size=tp_size)
    try:
        mesh = data_mesh(sp)
        loader = torch.utils.data.DataLoader(torch.arange(rows), batch_size=1)
        prepared = prepare_data_loader(loader, device=torch.device("cpu"), num_processes=dist.get_world_size(),
                                       process_index=dist.get_rank(), put_on_device=False, torch_device_mesh=mesh)
        return {"dims": mesh.mesh_dim_names, "rows": [int(x) for batch in prepared for x in batch]}
    finally:
        hf_ring.clear_sequence_parallel()
