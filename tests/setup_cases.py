"""Rank functions of the setup tests: the sequence-parallel scope (module-level so they pickle)."""
from __future__ import annotations

import torch.distributed as dist

import hf_ring


def scope_case(path):
    """A sharded step inside ``with hf_ring.sequence_parallel(...)``; what is set up inside and left after, and
    whether an error inside the block and a block inside another were handled."""
    from models import batch, load

    seen = {}
    with hf_ring.sequence_parallel(None) as sp:
        seen["inside"] = hf_ring.current() is sp and sp.sp_size == dist.get_world_size()
        seen["patched"] = len(hf_ring.patches.applied()) > 1
        model = load(path, "ring_dilated").train()
        seen["loss"] = float(model(**hf_ring.shard_batch(batch(1, 1, 17))).loss)
        try:
            with hf_ring.sequence_parallel(None):
                pass
        except ValueError as err:
            seen["nested"] = str(err)
    seen["after"] = hf_ring.current() is None and [p.name for p in hf_ring.patches.applied()] == ["__call__"]
    try:
        with hf_ring.sequence_parallel(None):
            raise KeyError("inside the block")
    except KeyError:
        seen["after_error"] = hf_ring.current() is None and len(hf_ring.patches.applied()) == 1
    return seen


def destroy_case() -> dict:
    """What ``dist.destroy_process_group`` is while a setup stands (hf_ring's, which meets every rank first, listed
    among the changes it made) and once the setup is cleared (torch's own again)."""
    own = dist.destroy_process_group
    hf_ring.setup_sequence_parallel(None)
    try:
        during = dist.destroy_process_group
        listed = [str(p) for p in hf_ring.patches.applied() if p.name == "destroy_process_group"]
    finally:
        hf_ring.clear_sequence_parallel()
    return {"replaced": during is not own and during.__wrapped__ is own, "listed": listed,
            "restored": dist.destroy_process_group is own}
