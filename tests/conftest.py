import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from dist_pool import RankPool  # noqa: E402

_POOLS = {}


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` returns a gloo pool of n ranks, started on first use and shared by the session."""

    def get(world_size: int) -> RankPool:
        pool = _POOLS.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = _POOLS[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.close()
