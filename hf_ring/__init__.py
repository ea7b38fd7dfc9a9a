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
from .backend import register as _register
from .cache import ShardedCache
from .comm import CommTimeoutError, RankLeftError
from .config import configure
from .data import gather_sequence, shard_batch
from .decode import RanksDivergedError
from .generation import generate
from .guard import install as _install_guard
from .groups import SequenceParallel, current
from .layout import local_positions, shard_sizes
from .loss import tiled_causal_lm_loss
from .mlp import tiled_rows
from .offload import offload_checkpoints
from .parallel import clear_sequence_parallel, setup_sequence_parallel, shutdown, sync_gradients
from .patches.tiling import configure as configure_tiling
from .pattern import DilatedPattern
from .ring import ring_attention
from .tp import tensor_parallel
from .trainer import SequenceParallelTrainerMixin, prepare_trainer
from .zero import shm_op_notice as _shm_op_notice

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
    "generate",
    "local_positions",
    "offload_checkpoints",
    "patches",
    "prepare_trainer",
    "ring_attention",
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
