"""hf_ring: exact ring attention and LongNet dilated attention over sequence-sharded ranks."""
from .layout import local_positions, shard_sizes
from .pattern import DilatedPattern
from .ring import ring_attention

__all__ = ["DilatedPattern", "local_positions", "ring_attention", "shard_sizes"]
__version__ = "0.1.0"
