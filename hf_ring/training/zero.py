"""DeepSpeed (ZeRO stages 1-3) under sequence parallelism: what :func:`hf_ring.prepare_trainer` checks and sets.

DeepSpeed gets no sequence parallelism of its own. Its engine then treats every
rank as a data-parallel replica and averages the gradients over the whole world
(dp x sp), the same way on every ZeRO stage and reduction path, as DDP does. The
ranks' losses carry the factor that turns this average into a sum over the sp
group and an average over dp: the Trainer multiplies its loss by the number of
processes (the global token count being counted once per sp group), an
accelerate loop multiplies by ``sp.loss_scale``.

What DeepSpeed is told is how many replicas there really are, for its batch
arithmetic only: ``sequence_parallel_size`` in its config makes it expect
``train_batch_size`` = micro batch x accumulation steps x dp, so its sample
counts see each sequence once. Without an ``mpu`` or ``data_parallel_size``
that key changes none of its process groups.

Nothing here imports deepspeed: only its config (a dict), engine attributes and the op cache on disk are read.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Iterable, Mapping, MutableMapping, Optional

import torch

from ..patches.tiled_rows import zero3_partitioned

def managed_by_deepspeed(params: Iterable[Any]) -> bool:
    """Whether a DeepSpeed engine reduces these parameters' gradients (ZeRO-3's partitions, ZeRO-1/2's
    ``_hp_mapping``)."""
    params = list(params)
    return zero3_partitioned(params) or any(hasattr(p, "_hp_mapping") for p in params)


SP_KEY = "sequence_parallel_size"
"""The DeepSpeed config key that divides the world for DeepSpeed's batch arithmetic."""


def check_config(config: MutableMapping[str, Any], sp_size: int) -> None:
    """Refuse DeepSpeed settings that would split the model too or reduce gradients within other groups.

    Local to the config, so every rank raises the same error.
    """
    autotp = (config.get("tensor_parallel") or {}).get("autotp_size", 0)
    if isinstance(autotp, int) and autotp > 1:
        raise ValueError(
            f"prepare_trainer splits sequences over the ranks; the DeepSpeed config's tensor_parallel.autotp_size="
            f"{autotp} would split the model's layers over them as well, which hf_ring does not support: remove "
            "tensor_parallel.autotp_size from the DeepSpeed config"
        )
    if "data_parallel_size" in config:
        # With it (and sequence_parallel_size) DeepSpeed builds its own mesh and reduces gradients within the
        # data-parallel ranks alone: nothing would sum them over the sequence-parallel group.
        raise ValueError(
            f"the DeepSpeed config sets data_parallel_size={config['data_parallel_size']!r}, which makes DeepSpeed "
            "reduce gradients within its own data-parallel groups, never over hf_ring's sequence-parallel group: "
            "remove data_parallel_size (and sequence_parallel_size) from the DeepSpeed config; prepare_trainer "
            "sets sequence_parallel_size itself"
        )
    own = config.get(SP_KEY)
    if own is not None and own != sp_size:
        raise ValueError(
            f"the DeepSpeed config sets {SP_KEY}={own!r} but prepare_trainer was given sp_size={sp_size}: remove "
            f"{SP_KEY} from the DeepSpeed config (prepare_trainer sets it) or pass the same sp_size"
        )
    micro, accum = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (micro, accum)):
        raise ValueError(
            f"the DeepSpeed config has train_micro_batch_size_per_gpu={micro!r} and gradient_accumulation_steps="
            f"{accum!r} after the Trainer filled it in; prepare_trainer needs both as numbers to size "
            "train_batch_size over the data-parallel replicas: set them to \"auto\" (the TrainingArguments' values) "
            "or to integers"
        )


def count_sequences_once(config: MutableMapping[str, Any], sp_size: int, dp_size: int) -> None:
    """Make DeepSpeed's ``train_batch_size`` the dp replicas' batch: each sequence counted once, not once per rank.

    Call it after :func:`check_config` accepted ``config``.
    """
    micro, accum = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    config[SP_KEY] = sp_size
    config["train_batch_size"] = micro * accum * dp_size


def check_engine(engine: Any, sp_size: int, dp_size: int, tp_size: int = 1) -> None:
    """Refuse a DeepSpeed engine that does not average gradients over the whole world.

    The loss scaling is made for that average; an engine given sequence parallelism of its own (an ``mpu``, a
    ``data_parallel_size`` mesh) sums over sp itself on some reduction paths and not on others.
    """
    if tp_size != 1:  # DeepSpeed would average the tensor-parallel ranks' different shards as replicas
        raise ValueError(f"hf_ring's tensor parallelism (tp_size={tp_size}) does not compose with DeepSpeed: set up "
                         "sequence parallelism without tp_size, or train without DeepSpeed")
    world = sp_size * dp_size
    reduced = getattr(engine, "seq_dp_world_size", world)
    own_sp = getattr(engine, "sequence_parallel_size", 1)
    if reduced != world or own_sp != 1:
        raise ValueError(
            f"the DeepSpeed engine reduces gradients over {reduced} of the {world} ranks with a sequence-parallel "
            f"size of its own of {own_sp}; hf_ring needs it to average over all ranks with none of its own (its "
            "loss scaling turns that average into a sum over the sp group): build the engine without an mpu and "
            "without data_parallel_size/sequence_parallel_size meshes (accelerate's parallelism_config sp_size, "
            "DeepSpeed's own Ulysses)"
        )


SHM_OP = "deepspeed_shm_comm"
"""The op DeepSpeed's CPU accelerator compiles at its first start, for its shared-memory collectives."""

SHM_OP_COMPILE = "about 2.5 minutes on 2 cores"
"""How long that compile took on this project's CPU machine (measured, once per machine and Python)."""


def shm_op_cache(environ: Mapping[str, str] = os.environ) -> str:
    """Where torch keeps the compiled op (torch's build root for extensions of this Python and build)."""
    root = environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    build = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    return os.path.join(root, f"py{sys.version_info.major}{sys.version_info.minor}_{build}", SHM_OP)


def shm_op_notice(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The line to print before DeepSpeed compiles its CPU op, or None where it will not (or is cached).

    DeepSpeed compiles it inside ``deepspeed.init_distributed``, which accelerate
    calls while building its state, before any hf_ring call: the line is printed
    at ``import hf_ring``, once per machine (local rank 0), only on the CPU
    DeepSpeed route (``DS_ACCELERATOR=cpu`` and ``ACCELERATE_USE_DEEPSPEED``).
    """
    if environ.get("DS_ACCELERATOR") != "cpu" or environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in (
            "1", "true", "yes"):
        return None
    if environ.get("LOCAL_RANK", "0") != "0" or importlib.util.find_spec("deepspeed") is None:
        return None
    cache = shm_op_cache(environ)
    if os.path.exists(os.path.join(cache, SHM_OP + ".so")):
        return None
    return (f"hf_ring: DeepSpeed's first start on this machine compiles its CPU communication op ({SHM_OP}); "
            f"that takes {SHM_OP_COMPILE}, once, and is cached in {cache}")
