import json
import multiprocessing.util
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import helpers  # noqa: E402
from dist_pool import RankPool  # noqa: E402

ERRORS = pytest.StashKey[dict]()
"""Per passed test (node id), the largest error per norm it asserted within its tolerance (``helpers.close``)."""
SCRATCH = pytest.StashKey[str]()
"""The session's temporary folder: every tiny checkpoint and trainer output the tests and their ranks write."""


def pytest_addoption(parser):
    parser.addoption("--record-errors", metavar="FILE", default=None,
                     help="write each passed test's largest relative error against its reference (per norm) to FILE "
                          "as JSON (what python -m bench exactness reads)")


def pytest_configure(config):
    config.stash[ERRORS] = {}
    # The ranks, launches and trainers a test starts write with tempfile in processes of their own, which inherit
    # TMPDIR: pointing it at one folder per session lets the session remove all they leave behind.
    # multiprocessing removes its folder for this process at exit, after the scratch folder is gone: made first, it
    # lies outside it.
    multiprocessing.util.get_temp_dir()
    config.stash[SCRATCH] = tempfile.mkdtemp(prefix="hf_ring_tests_")
    os.environ["TMPDIR"] = config.stash[SCRATCH]
    tempfile.tempdir = None  # tempfile caches the folder it chose first


def pytest_unconfigure(config):
    scratch = config.stash.get(SCRATCH, None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    recording = item.config.getoption("--record-errors") is not None
    if recording:
        helpers.RECORDING.append({})
    outcome = yield
    if recording:
        kept = helpers.RECORDING.pop()
        if outcome.excinfo is None and kept:
            item.config.stash[ERRORS][item.nodeid] = kept


def pytest_sessionfinish(session):
    path = session.config.getoption("--record-errors")
    if path:
        with open(path, "w") as f:
            json.dump(session.config.stash[ERRORS], f, indent=2)

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
