"""hf_ring: exact ring attention and LongNet dilated attention over sequence-sharded ranks.

``import hf_ring`` registers ``attn_implementation="ring_dilated"`` with transformers.
"""
import sys as _sys
from importlib.util import find_spec as _find_spec

from .versions import check_installed as _check_installed

if _find_spec(__name__ + ".patches") is None:
    # pyproject maps the top-level patches/ folder to hf_ring.patches, so a checkout imports only once installed;
    # without this, Python reports a circular import.
    raise ImportError("hf_ring is imported from a checkout that is not installed for this Python "
                      f"({_sys.executable}): hf_ring.patches is mapped at install; fix: "
                      f"{_sys.executable} -m pip install -e . in the checkout")
_check_installed()  # before anything imports transformers: an untested release is refused in one line

from . import patches  # noqa: E402
from .engine.comm import CommTimeoutError, RankLeftError
from .engine.decode import RanksDivergedError
from .engine.layout import local_positions, shard_sizes
from .engine.pattern import DilatedPattern
from .engine.ring import ring_attention
from .generation.cache import ShardedCache
from .generation.generate import generate
from .entry.backend import register as _register
from .integration.config import configure
from .integration.groups import SequenceParallel, current
from .entry.model_call import install as _install_guard
from .entry.parallel import clear_sequence_parallel, sequence_parallel, setup_sequence_parallel, shutdown
from .integration.tp import tensor_parallel
from .patches.tiled_loss import tiled_causal_lm_loss
from .patches.tiled_rows import tiled_rows
from .patches.tiling import configure as configure_tiling
from .training.data import gather_sequence, layout_of, shard_batch
from .training.offload import offload_checkpoints
from .training.sync import sync_gradients
from .training.trainer import SequenceParallelTrainerMixin, prepare_trainer
from .training.zero import shm_op_notice as _shm_op_notice

__all__ = [
    "CommTimeoutError",
    "DilatedPattern",
    "RankLeftError",
    "RanksDivergedError",
    "SequenceParallel",
    "SequenceParallelTrainerMixin",
    "ShardedCache",
    "clear_sequence_parallel",
    "configure",
    "configure_tiling",
    "current",
    "gather_sequence",
    "layout_of",
    "generate",
    "local_positions",
    "offload_checkpoints",
    "patches",
    "prepare_trainer",
    "ring_attention",
    "sequence_parallel",
    "setup_sequence_parallel",
    "shard_batch",
    "shard_sizes",
    "shutdown",
    "sync_gradients",
    "tensor_parallel",
    "tiled_causal_lm_loss",
    "tiled_rows",
]
__version__ = "0.1.0"

_register()
_install_guard()
_NOTICE = _shm_op_notice()
if _NOTICE is not None:  # before accelerate builds its state, which is where DeepSpeed compiles
    print(_NOTICE, file=_sys.stderr, flush=True)
