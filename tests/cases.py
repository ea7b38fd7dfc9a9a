"""Functions that run on every rank of a pool (module-level so they pickle)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import hf_ring
from hf_ring.documents import document_starts
from hf_ring.seams import CACHE_KEYWORD, CHECKPOINTING_ARGUMENT, checkpointing_on, enable_checkpointing


def make_qkv(seed, b, hq, hkv, n, d, dtype=torch.float32):
    """Global q, k, v, dout from a seed: every rank and the test build the same tensors."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, hq, n, d), (b, hkv, n, d), (b, hkv, n, d), (b, hq, n, d)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def key_mask_of(b, n, pad, side="left"):
    """Bool ``(b, n)`` key mask: ``pad`` padded keys of sample 0 at its ``side`` ("left", "right"); "mixed" pads
    sample 0 on the left and the last sample on the right by ``pad + 3``; "all" pads the whole of sample 0;
    "none" pads nothing (a mask of valid keys only); "staggered" left-pads sample i by ``pad·(i+1)//b``."""
    key_mask = torch.ones(b, n, dtype=torch.bool)
    if side in ("left", "mixed"):
        key_mask[0, :pad] = False
    if side == "right":
        key_mask[0, n - pad:] = False
    if side == "mixed":
        key_mask[-1, n - pad - 3:] = False
    if side == "all":
        key_mask[0] = False
    if side == "staggered":
        for i in range(b):
            key_mask[i, :pad * (i + 1) // b] = False
    return key_mask


def ring_case(seed, b, hq, hkv, n, d, *, dtype=torch.float32, layout="zigzag", message_rows=None, pad=0,
              pad_side="left", padded_tile=None, **kw):
    """This rank's positions, output and gradients of ring_attention on its shard.

    ``message_rows`` shrinks the per-message budget so shards travel in many small messages.
    ``pad`` masks ``pad`` keys (:func:`key_mask_of` with ``pad_side``); ``padded_tile`` sets the
    tile a block is cut into around a padding edge. ``max_mask`` reports the largest mask side any
    forward kernel got, ``masked_calls`` and ``calls`` how many forward kernel calls had a mask.
    """
    if padded_tile is not None:
        import hf_ring.block_args as block_args
        import hf_ring.ring as ring

        saved_tile, saved_forward = block_args.PADDED_TILE, ring.block_forward
        sides, calls = [0], [0]

        def spy(q, k, v, *, mask=None, **kernel_kw):
            calls[0] += 1
            if mask is not None:
                sides.append(max(mask.shape[-2:]))
            return saved_forward(q, k, v, mask=mask, **kernel_kw)

        block_args.PADDED_TILE, ring.block_forward = padded_tile, spy
        try:
            res = ring_case(seed, b, hq, hkv, n, d, dtype=dtype, layout=layout, message_rows=message_rows, pad=pad,
                            pad_side=pad_side, **kw)
        finally:
            block_args.PADDED_TILE, ring.block_forward = saved_tile, saved_forward
        res.update(max_mask=max(sides), masked_calls=len(sides) - 1, calls=calls[0])
        return res
    if message_rows is not None:
        kw["message_rows"] = message_rows
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    q, k, v, dout = make_qkv(seed, b, hq, hkv, n, d, dtype)
    pos = hf_ring.local_positions(n, rank, world, layout)
    if pad or pad_side == "none":
        kw["key_mask"] = key_mask_of(b, n, pad, pad_side)[:, pos]
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    out = hf_ring.ring_attention(ql, kl, vl, layout=layout, **kw)
    out.backward(dout[:, :, pos])
    return {"pos": pos, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def assemble(results, name, n):
    """Put every rank's rows of ``name`` back in global order."""
    first = results[0][name]
    full = torch.zeros(first.shape[:2] + (n,) + first.shape[3:], dtype=first.dtype)
    for r in results:
        full[:, :, r["pos"]] = r[name]
    return full


def raises_on_rank(fn, *args, **kwargs):
    """Run fn and return (exception type name, message), or None if it did not raise."""
    try:
        fn(*args, **kwargs)
    except Exception as err:  # the test inspects type and message
        return type(err).__name__, str(err)
    return None


def sp_diverging_generate_case(path, ids, **kwargs):
    """``hf_ring.generate`` where rank 1's lm_head differs, so its own logits pick other tokens.

    Returns the sequences, or the (error type, message) this rank raised.
    """
    from models import load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        if dist.get_rank() == 1:
            with torch.no_grad():
                model.lm_head.weight.neg_()  # its greedy pick is then the least likely token, never rank 0's
        result = {}
        error = raises_on_rank(lambda: result.setdefault("sequences", hf_ring.generate(model, ids, **kwargs)))
        return error if error is not None else result["sequences"]
    finally:
        hf_ring.clear_sequence_parallel()


def sp_train_case(path, sp_size, seed, b, n, pattern=None, layout="zigzag", pad="none"):
    """One training step of a tiny model with the sequence split over ``sp_size`` ranks."""
    from models import batch, load

    sp = hf_ring.setup_sequence_parallel(None, sp_size, layout=layout)
    try:
        model = load(path, "ring_dilated").train()
        hf_ring.configure(model, pattern=pattern, layout=layout)
        data = batch(seed + sp.dp_rank, b, n, pad=pad)
        out = model(**hf_ring.shard_batch(data), return_logits=True)  # logits to compare; the loss tiling is off
        out.loss.backward()
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        logits = hf_ring.gather_sequence(out.logits.detach(), n)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()} if dist.get_rank() == 0 else None
        return {"dp_rank": sp.dp_rank, "loss": float(loss), "logits": logits, "grads": grads}
    finally:
        hf_ring.clear_sequence_parallel()


def sp_logits_case(path, n, seed=0):
    """Logits of a model run with the sequence split over the whole world (no grad)."""
    from models import batch, load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        data = batch(seed, 1, n)
        with torch.no_grad():
            out = model(**hf_ring.shard_batch(data), return_logits=True)
        return hf_ring.gather_sequence(out.logits, n)
    finally:
        hf_ring.clear_sequence_parallel()


class ListStreamer:
    """A streamer that records what ``generate`` puts into it."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.ended = True


def sp_generate_case(path, ids, mask=None, *, layout="zigzag", pattern=None, seed=None, stream=False,
                     ids_by_rank=None, cache_from=None, continue_with=None, **kwargs):
    """``hf_ring.generate`` with the sequence split over the whole world.

    Returns the sequences (and the step logits when asked), this rank's cache
    rows after every forward, and what a streamer saw. ``ids_by_rank`` gives
    each rank its own prompt (to provoke errors); ``cache_from`` passes a cache
    made for ``(rank, world, layout)``; ``continue_with`` runs a second call on
    the returned cache with these many more tokens.
    """
    from models import load
    from transformers import set_seed

    rank = dist.get_rank()
    hf_ring.setup_sequence_parallel(None, layout=layout)
    try:
        model = load(path, "ring_dilated")
        hf_ring.configure(model, pattern=pattern, layout=layout)
        lengths = []
        cache = hf_ring.ShardedCache(*(cache_from or (rank, dist.get_world_size(), layout)))
        kwargs["past_key_values"] = cache
        hook = model.register_forward_hook(lambda m, a, o: lengths.append(cache.local_length()))
        if ids_by_rank is not None:
            ids = ids_by_rank[rank]
        if seed is not None:
            set_seed(seed)
        streamer = ListStreamer() if stream else None
        out = hf_ring.generate(model, ids, attention_mask=mask, streamer=streamer, **kwargs)
        if continue_with is not None:
            seq = out.sequences
            more = None if mask is None else torch.cat([mask, torch.ones_like(seq[:, mask.shape[1]:])], 1)
            out = hf_ring.generate(model, seq, attention_mask=more,
                                   **dict(kwargs, past_key_values=out.past_key_values, max_new_tokens=continue_with))
        hook.remove()
        res = {"lengths": lengths, "stream": None if streamer is None else (streamer.chunks, streamer.ended)}
        if isinstance(out, torch.Tensor):
            res["sequences"] = out
        else:
            res["sequences"] = out.sequences
            res["logits"] = None if out.logits is None else torch.stack(out.logits, 1)
            res["cache_bytes"] = out.past_key_values.nbytes()
        return res
    finally:
        hf_ring.clear_sequence_parallel()


def unseeded_sampling_case(path, ids):
    """Sampling with a different random state on each rank (an error)."""
    torch.manual_seed(100 + dist.get_rank())
    return sp_generate_case(path, ids, do_sample=True, max_new_tokens=3, pad_token_id=0)


def sdpa_sharded_case(path, ids, **kwargs):
    """hf_ring.generate of an sdpa model under sequence parallelism (an error)."""
    from models import load

    hf_ring.setup_sequence_parallel(None)
    try:
        return hf_ring.generate(load(path, "sdpa"), ids, **kwargs)
    finally:
        hf_ring.clear_sequence_parallel()


def sp_cache_forward_case(path):
    """A forward with transformers' own cache while the sequence is split (an error)."""
    from models import load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        ids = torch.arange(8).view(1, 8)
        with torch.no_grad():
            out = model(**dict(hf_ring.shard_batch({"input_ids": ids}), use_cache=True))
            cache = getattr(out, CACHE_KEYWORD)
            return model(input_ids=ids[:, :1], **{CACHE_KEYWORD: cache}, use_cache=True)
    finally:
        hf_ring.clear_sequence_parallel()


def counted_collectives_case(path, n, layers, checkpointing=False):
    """Collectives and host agreements of one sharded training step (forward and backward) under sp = world."""
    from models import batch, load

    hf_ring.setup_sequence_parallel(None)
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce", "broadcast", "all_gather_into_tensor")}

    def spy(name):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return wrapped

    try:
        model = load(path, "ring_dilated").train()
        assert model.config.num_hidden_layers == layers
        if checkpointing:
            enable_checkpointing(model)
        sharded = hf_ring.shard_batch(batch(3, 1, n))
        for name in originals:
            setattr(dist, name, spy(name))
        try:
            out = model(**sharded)
            forward_calls = list(calls)
            out.loss.backward()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        return {"forward": forward_calls, "step": list(calls), "agreed": sharded["ring_context"].collectives}
    finally:
        hf_ring.clear_sequence_parallel()


def unsharded_forward_case(path, n, shard_ranks=()):
    """A forward under sequence parallelism where the ranks in ``shard_ranks`` shard their batch and the others do not."""
    from models import batch, load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        data = batch(5 + dist.get_rank(), 1, n)  # what a stock Trainer does: each rank its own batch

        def forward():
            sharded = hf_ring.shard_batch(data) if dist.get_rank() in shard_ranks else data
            with torch.no_grad():
                return model(**sharded)

        return raises_on_rank(forward)
    finally:
        hf_ring.clear_sequence_parallel()


def different_batches_case(path, n):
    """Every rank shards a batch of its own (an error: an sp group must share one batch)."""
    from models import batch, load

    hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated")
        with torch.no_grad():
            return raises_on_rank(model, **hf_ring.shard_batch(batch(7 + dist.get_rank(), 1, n)))
    finally:
        hf_ring.clear_sequence_parallel()


def mixed_dtype_case(n):
    """ring_attention with fp16 on rank 0 and bf16 elsewhere: same byte size, different numbers (an error)."""
    dtype = torch.float16 if dist.get_rank() == 0 else torch.bfloat16
    q, k, v, _ = make_qkv(0, 1, 2, 2, n, 8, dtype)
    pos = hf_ring.local_positions(n, dist.get_rank(), dist.get_world_size())
    return raises_on_rank(hf_ring.ring_attention, q[:, :, pos], k[:, :, pos], v[:, :, pos])


def one_rank_bad_argument_case(path, ids, bad):
    """``hf_ring.generate`` where only the last rank passes the keyword arguments ``bad``."""
    extra = bad if dist.get_rank() == dist.get_world_size() - 1 else {}
    return raises_on_rank(sp_generate_case, path, ids, **dict(dict(max_new_tokens=3, pad_token_id=0), **extra))


def packed_case(seed, b, hq, hkv, n, d, *, position_ids=None, sinks=None, layout="zigzag", pad=0, spy=False,
                message_rows=None, known_starts=False, **kw):
    """This rank's rows and gradients of ring_attention with packed documents, soft-capping and/or sinks.

    ``position_ids`` ``(B, n)`` are the global position ids (this rank passes
    its rows'); ``sinks`` ``(Hq,)`` the global sink logits, whose gradient
    comes back as this rank's share ``dsinks``; ``known_starts`` passes the
    documents as their global starts (no gather), as the
    transformers backend does. ``pad`` masks the first
    ``pad`` keys of sample 0. ``spy`` counts the kernel calls, the (query,
    key) pairs they computed, and the bytes this rank sent. ``message_rows``
    shrinks the per-message budget so shards travel in many small messages.
    """
    import hf_ring.ring as ring

    if message_rows is not None:
        kw["message_rows"] = message_rows

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    q, k, v, dout = make_qkv(seed, b, hq, hkv, n, d)
    pos = hf_ring.local_positions(n, rank, world, layout)
    if pad:
        key_mask = torch.ones(b, n, dtype=torch.bool)
        key_mask[0, :pad] = False
        kw["key_mask"] = key_mask[:, pos]
    if position_ids is not None and known_starts:
        kw["documents"] = document_starts(position_ids)
    elif position_ids is not None:
        kw["position_ids"] = position_ids[:, pos]
    sk = None if sinks is None else sinks.clone().requires_grad_(True)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
    counts = {"calls": 0, "pairs": 0, "sent_bytes": 0}
    saved_forward, saved_batch = ring.block_forward, dist.batch_isend_irecv

    def count_forward(qb, kb, vb, **kernel_kw):
        counts["calls"] += 1
        counts["pairs"] += qb.shape[0] * qb.shape[1] * qb.shape[2] * kb.shape[2]
        return saved_forward(qb, kb, vb, **kernel_kw)

    def count_batch(ops):
        counts["sent_bytes"] += sum(op.tensor.numel() * op.tensor.element_size()
                                    for op in ops if op.op.__name__ == "isend")
        return saved_batch(ops)

    if spy:
        ring.block_forward, dist.batch_isend_irecv = count_forward, count_batch
    try:
        out = hf_ring.ring_attention(ql, kl, vl, layout=layout, sinks=sk, **kw)
        out.backward(dout[:, :, pos])
    finally:
        ring.block_forward, dist.batch_isend_irecv = saved_forward, saved_batch
    return {"pos": pos, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
            "dsinks": None if sk is None else sk.grad, **counts}


def options_case(options_by_rank):
    """ring_attention with this rank's own keyword options (to provoke disagreement errors)."""
    rank = dist.get_rank()
    kw = dict(options_by_rank[rank])
    q, k, v, _ = make_qkv(0, 1, 2, 2, 8, 4)
    pos = hf_ring.local_positions(8, rank, dist.get_world_size())
    if kw.get("position_ids") is not None:
        kw["position_ids"] = kw["position_ids"][:, pos]
    return raises_on_rank(hf_ring.ring_attention, q[:, :, pos], k[:, :, pos], v[:, :, pos], **kw)


def packed_train_case(path, features, pattern=None):
    """One training step on a DataCollatorWithFlattening batch with the sequence split over the whole world."""
    from models import load
    from transformers import DataCollatorWithFlattening

    sp = hf_ring.setup_sequence_parallel(None)
    try:
        model = load(path, "ring_dilated").train()
        hf_ring.configure(model, pattern=pattern)
        batch = DataCollatorWithFlattening()(features)
        n = batch["input_ids"].shape[1]
        out = model(**hf_ring.shard_batch(batch), return_logits=True)
        out.loss.backward()
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        return {"loss": float(loss), "logits": hf_ring.gather_sequence(out.logits.detach(), n),
                "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}
    finally:
        hf_ring.clear_sequence_parallel()


class RowDataset(torch.utils.data.Dataset):
    """Rows of a dict of (rows, n) tensors, as a Trainer dataset."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data["input_ids"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.data.items()}


class GradRecorder:
    """A Trainer callback keeping each optimizer step's gradients of the trainable parameters (full tensors)."""

    def __init__(self):
        from transformers import TrainerCallback

        self.steps = []
        self.callback = type("Recorder", (TrainerCallback,), {"on_pre_optimizer_step": self._record})()

    def _record(self, args, state, control, model=None, **kwargs):
        from torch.distributed.tensor import DTensor

        grads = {}
        for name, p in model.named_parameters():
            if p.requires_grad and p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name.replace("module.", "")] = g.detach().clone()
        self.steps.append(grads)


def trainer_env():
    """Point accelerate at the running gloo world (the pool starts it from a file, not from the environment)."""
    import os

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", ACCELERATE_USE_CPU="true")


def trainer_data(seed, rows, n, pad="right"):
    """Rows of random tokens (by default the first right-padded, labels -100 on padding)."""
    from models import batch

    return batch(seed, rows, n, pad=pad)


def trainer_case(path, sp_size=None, *, per_device=1, accum=2, steps=2, n=23, lora=False, checkpointing=False,
                 fsdp=False, eval_rows=3, eval_pad="right", predict_rows=3, resume_at=None, layout="zigzag", out_dir=None,
                 ulysses_size=None):
    """Train a tiny model with transformers.Trainer (sequence parallel when sp_size is given), then evaluate and predict.

    Returns logged losses, every optimizer step's gradients, eval_loss, predicted logits and final parameters.
    """
    import tempfile

    from accelerate.state import AcceleratorState
    from models import load
    from transformers import Trainer, TrainingArguments

    trainer_env()
    AcceleratorState._reset_state()
    world = dist.get_world_size() if dist.is_initialized() else 1
    kw = {}
    if fsdp:  # transformers shards the model with FSDP2 at load time (accelerate's FSDP plugin needs GPUs)
        from transformers.distributed import DistributedConfig

        kw["distributed_config"] = DistributedConfig(fsdp_size=world)
    model = load(path, "sdpa" if sp_size is None else "ring_dilated", **kw).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # the adapters' random initial values, the same in every process
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False, lora_dropout=0.0))
    rows = per_device * accum * steps * (world // (sp_size or 1))
    out_dir = out_dir or tempfile.mkdtemp(prefix="hf_ring_trainer_")  # ranks that resume share one directory
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=per_device, per_device_eval_batch_size=2,
        gradient_accumulation_steps=accum, max_steps=steps, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, use_cpu=True,
        train_sampling_strategy="sequential", disable_tqdm=True, **{CHECKPOINTING_ARGUMENT: checkpointing},
        save_strategy="steps" if resume_at else "no", save_steps=resume_at or 500,
    )
    recorder = GradRecorder()
    trainer = Trainer(model=model, args=args, train_dataset=RowDataset(trainer_data(1, rows, n)),
                      eval_dataset=RowDataset(trainer_data(2, eval_rows, n, eval_pad)), callbacks=[recorder.callback])
    if sp_size is not None:
        hf_ring.prepare_trainer(trainer, sp_size, layout=layout, ulysses_size=ulysses_size)
    try:
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result = {"losses": losses, "grads": recorder.steps, "eval_loss": trainer.evaluate()["eval_loss"]}
        if predict_rows:
            pred = trainer.predict(RowDataset(trainer_data(3, predict_rows, n)))
            result["logits"], result["label_ids"] = torch.as_tensor(pred.predictions), torch.as_tensor(pred.label_ids)
            unlabelled = {k: v for k, v in trainer_data(3, predict_rows, n).items() if k != "labels"}
            result["logits_unlabelled"] = torch.as_tensor(trainer.predict(RowDataset(unlabelled)).predictions)
        from torch.distributed.tensor import DTensor

        params = dict(trainer.model.named_parameters())
        result["params"] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                            for k, v in params.items()}
        result["wrapped"] = type(trainer.model_wrapped).__name__
        result["dtensor"] = any(isinstance(v, DTensor) for v in params.values())
        result["checkpointing"] = checkpointing_on(trainer.model)
        sp = hf_ring.groups.current()
        result["ulysses_size"] = None if sp is None else sp.ulysses_size
        if resume_at:
            result["resumed"] = _resume_case(trainer, f"{out_dir}/checkpoint-{resume_at}", sp_size, layout)
        return result if not dist.is_initialized() or dist.get_rank() == 0 else {"losses": losses}
    finally:
        hf_ring.clear_sequence_parallel()


def _resume_case(trainer, checkpoint, sp_size, layout):
    """Train again from a saved checkpoint: the final parameters must equal the uninterrupted run's."""
    from transformers import Trainer

    from models import load

    model = load(checkpoint, "sdpa" if sp_size is None else "ring_dilated").train()
    again = Trainer(model=model, args=trainer.args, train_dataset=trainer.train_dataset)
    if sp_size is not None:
        hf_ring.prepare_trainer(again, sp_size, layout=layout)
    again.train(resume_from_checkpoint=checkpoint)
    return {k: v.detach().clone() for k, v in again.model.named_parameters()}


def sft_case(path, sp_size=None, *, padding_free=False, steps=2, per_device=2, accum=2):
    """Train with TRL's SFTTrainer (examples/sft.py's tokenizer and data)."""
    import os
    import sys
    import tempfile

    from accelerate.state import AcceleratorState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import sft

    trainer_env()
    AcceleratorState._reset_state()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = per_device * accum * steps * (world // (sp_size or 1))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="hf_ring_sft_"), per_device_train_batch_size=per_device,
        per_device_eval_batch_size=2, gradient_accumulation_steps=accum, max_steps=steps, learning_rate=0.5,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0,
        use_cpu=True, train_sampling_strategy="sequential", disable_tqdm=True, save_strategy="no",
        padding_free=padding_free, max_length=None if padding_free else 128, bf16=False,
        **{CHECKPOINTING_ARGUMENT: True},  # TRL's default, by the name this release takes without a warning
    )
    recorder = GradRecorder()
    trainer = SFTTrainer(model=model, args=args, processing_class=sft.char_tokenizer(),
                         train_dataset=Dataset.from_list(sft.reverse_pairs(rows, 0)),
                         eval_dataset=Dataset.from_list(sft.reverse_pairs(3, 1)), callbacks=[recorder.callback])
    if sp_size is not None:
        hf_ring.prepare_trainer(trainer, sp_size)
    try:
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        metrics = trainer.evaluate()
        result = {"losses": losses, "grads": recorder.steps, "eval_loss": metrics["eval_loss"],
                  "num_tokens": metrics.get("eval_num_tokens"), "accuracy": metrics.get("eval_mean_token_accuracy")}
        return result if not dist.is_initialized() or dist.get_rank() == 0 else {"losses": losses}
    finally:
        hf_ring.clear_sequence_parallel()


def sft_example_case(argv):
    """examples/sft.py's main on every rank (as under torchrun)."""
    import os
    import sys

    from accelerate.state import AcceleratorState

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import sft

    trainer_env()
    AcceleratorState._reset_state()
    return sft.main(argv)


def sp_tiled_train_case(path, seed, b, n, loss_chunk_rows, row_chunk_rows, *, pattern=None, pad="right",
                        return_logits=False, spy_vocab=None):
    """One sharded training step with sequence tiling left at its default (on under sequence parallelism).

    Returns the loss summed over the sp group, rank 0's synced gradients, whether
    logits came back (gathered when they did) and, with ``spy_vocab``, the shapes
    of every tensor whose last dimension is ``spy_vocab``, with this rank's row count.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from models import batch, load

    class VocabShapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == spy_vocab:
                    self.shapes.append(tuple(t.shape))
            return out

    from hf_ring.patches import tiling

    sp = hf_ring.setup_sequence_parallel(None)
    model = load(path, "ring_dilated").train()
    try:
        hf_ring.configure(model, pattern=pattern)
        hf_ring.configure_tiling(model, loss_chunk_rows=loss_chunk_rows, row_chunk_rows=row_chunk_rows)
        data = hf_ring.shard_batch(batch(seed, b, n, pad=pad))
        if return_logits:
            data["return_logits"] = True
        spy = VocabShapes() if spy_vocab is not None else None
        if spy is not None:
            with spy:
                out = model(**data)
                out.loss.backward()
        else:
            out = model(**data)
            out.loss.backward()
        hf_ring.sync_gradients(model)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=sp.sp_group)
        logits = None if out.logits is None else hf_ring.gather_sequence(out.logits.detach(), n)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()} if dist.get_rank() == 0 else None
        return {"loss": float(loss), "grads": grads, "logits": logits, "rows": data["input_ids"].shape[1],
                "vocab_shapes": None if spy is None else spy.shapes}
    finally:
        tiling.revert(model)
        hf_ring.clear_sequence_parallel()


REF_NAMES = ("out", "dq", "dk", "dv")


def packed_reference(args, position_ids=None, *, causal=True, window=None, branches=None, pad=0, softcap=None,
                     sinks=None):
    """float64 reference outputs and gradients of ``make_qkv(*args)`` with documents, soft-capping and/or sinks.

    ``position_ids`` ``(B, n)`` mark the documents (None: one per row); ``pad`` masks the first keys of sample 0.
    """
    import reference as R

    seed, b, hq, hkv, n, d = args
    q, k, v, dout = make_qkv(*args)
    if position_ids is None:
        position_ids = torch.arange(n).expand(b, n)
    bias = R.packed_bias(position_ids, hq, causal=causal, window=window, branches=branches)
    if pad:
        bias[0, :, :, :pad] = float("-inf")
    if sinks is None:
        fn = lambda q, k, v: R.attention(q, k, v, bias=bias, softcap=softcap)  # noqa: E731
        return dict(zip(REF_NAMES, R.with_grads(fn, q, k, v, dout)))
    fn = lambda q, k, v, sinks: R.attention(q, k, v, bias=bias, softcap=softcap, sinks=sinks)  # noqa: E731
    return dict(zip(REF_NAMES + ("dsinks",), R.with_grads_sinks(fn, q, k, v, sinks, dout)))


def one_rank_bad_batch_case(n):
    """shard_batch where only the last rank's labels have the wrong shape."""
    hf_ring.setup_sequence_parallel(None)
    try:
        ids = torch.arange(n)[None]
        bad = dist.get_rank() == dist.get_world_size() - 1
        labels = ids[:, :-1] if bad else ids
        return raises_on_rank(hf_ring.shard_batch, {"input_ids": ids, "labels": labels})
    finally:
        hf_ring.clear_sequence_parallel()


def head_parallel_case(seed, b, hq, hkv, n, d, *, ulysses, layout="zigzag", dtype=torch.float32, pad=0,
                       position_ids=None, sinks=None, causal=True, window=None, pattern=None, softcap=None):
    """This rank's positions, output and gradients of head-parallel attention (``ulysses`` ranks per group).

    The sequence is sharded as ``shard_batch`` shards it under
    ``setup_sequence_parallel(ulysses_size=ulysses)``; ``position_ids`` (global,
    ``(B, n)``) packs documents; ``sinks`` ``(Hq,)`` adds attention sinks (their
    gradient is summed over the ranks, as ``sync_gradients`` does).
    """
    from hf_ring.checks import check_options
    from hf_ring.layout import head_split
    from hf_ring.ulysses import group_rows, head_parallel

    sp = hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses, layout=layout)
    try:
        rank, world = sp.sp_rank, sp.sp_size
        q, k, v, dout = make_qkv(seed, b, hq, hkv, n, d, dtype)
        pos = hf_ring.local_positions(n, rank, world, layout, ulysses)
        sizes = hf_ring.shard_sizes(n, world, layout, ulysses)
        first = rank // ulysses * ulysses
        key_mask = None
        if pad:
            full = torch.ones(b, n, dtype=torch.bool)
            full[0, :pad] = False
            key_mask = group_rows(sp.head_comm, full[:, pos], sizes[first:first + ulysses])
        ql, kl, vl = (t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v))
        s = None if sinks is None else sinks.clone().requires_grad_(True)
        spec = check_options(causal, window, pattern, None, d, layout).at(
            seq_len=n, key_mask=key_mask, documents=None if position_ids is None else document_starts(position_ids),
            softcap=softcap, sinks=s)
        out = head_parallel(ql, kl, vl, sp.head_comm, sp.ring_comm, head_split(hq, hkv, ulysses),
                            sizes[first:first + ulysses], spec)
        out.backward(dout[:, :, pos])
        res = {"pos": pos, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        if s is not None:
            dist.all_reduce(s.grad)
            res["dsinks"] = s.grad
        return res
    finally:
        hf_ring.clear_sequence_parallel()


def head_parallel_generate_case(path, ids, mask=None, *, ulysses, pattern=None, **kwargs):
    """``hf_ring.generate`` with the prompt's prefill run by head parallelism (``ulysses`` ranks per group)."""
    from models import load

    hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses)
    try:
        model = load(path, "ring_dilated")
        hf_ring.configure(model, pattern=pattern, ulysses_size=ulysses)
        out = hf_ring.generate(model, ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True,
                               **kwargs)
        return {"sequences": out.sequences, "logits": torch.stack(out.logits, 1),
                "rows": out.past_key_values.local_length()}
    finally:
        hf_ring.clear_sequence_parallel()


def head_parallel_refusal_case(path, ulysses, config_ulysses=None):
    """One sharded forward under ``setup_sequence_parallel(ulysses_size=ulysses)``: (error type, message) or None."""
    from models import batch, load

    def step():
        hf_ring.setup_sequence_parallel(None, ulysses_size=ulysses)
        model = load(path, "ring_dilated")
        if config_ulysses is not None:
            model.config.ring_dilated = {"ulysses_size": config_ulysses}
        model(**hf_ring.shard_batch(batch(0, 1, 16)))

    try:
        return raises_on_rank(step)
    finally:
        hf_ring.clear_sequence_parallel()


def counted_head_parallel_case(*args, **kwargs):
    """:func:`head_parallel_case` with the bytes this rank sends to other ranks counted (all-to-all pieces
    that leave it, point-to-point sends)."""
    sent = []
    p2p, a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def counting_p2p(ops):
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return p2p(ops)

    def counting_a2a(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
        sent.append(row * (tensor.shape[0] - input_split_sizes[dist.get_rank(group)]))
        return a2a(output, tensor, output_split_sizes, input_split_sizes, group=group, **kw)

    dist.batch_isend_irecv, dist.all_to_all_single = counting_p2p, counting_a2a
    try:
        head_parallel_case(*args, **kwargs)
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = p2p, a2a
    return sum(sent)
