"""The wrapper forgets its rank's gloo rendezvous keys once built (python/leanddp/_rendezvous.py;
the torchrun restart that needs it: test_restart_store.py): the keys are found where torch nests
them, deleted by construction, and a torch without gloo (no ``ProcessGroupGloo``) finds none
instead of failing."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_harness import run_ranks

import leanddp
from leanddp import _rendezvous


def _keys(rank: int, world_size: int) -> None:
    group = dist.new_group(backend="gloo")
    found = _rendezvous.gloo_rendezvous_keys(group)
    assert [key for _, key in found] == [str(rank)], found
    leanddp.DistributedDataParallel(torch.nn.Linear(4, 2), process_group=group)
    assert _rendezvous.gloo_rendezvous_keys(group) == []
    assert not found[0][0].check([str(rank)])  # gone from the store itself

    other = dist.new_group(backend="gloo")
    gloo = dist.ProcessGroupGloo
    try:
        del dist.ProcessGroupGloo  # as in a torch built without gloo
        assert _rendezvous.gloo_rendezvous_keys(other) == []
        assert _rendezvous.forget_rendezvous_keys(other) == 0
    finally:
        dist.ProcessGroupGloo = gloo
    assert len(_rendezvous.gloo_rendezvous_keys(other)) == 1  # (still there: nothing deleted)


def test_rendezvous_keys_found_and_forgotten() -> None:
    run_ranks(2, _keys)
