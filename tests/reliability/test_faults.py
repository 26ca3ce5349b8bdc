"""Faults never hang and never train on silently: a dead or raising rank, ranks that use
different parameters, a second backward, parameters changed after wrapping."""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch
import torch.distributed as dist
from fault_harness import PG_TIMEOUT, group, run_faulty
from torch import nn

import leanddp

pytestmark = pytest.mark.slow

TIMEOUT_S = PG_TIMEOUT.total_seconds()

CONFIGS = {
    "views": {},
    "in_backward": {"optimizer_in_backward": functools.partial(torch.optim.AdamW, lr=1e-2)},
    "offload": {
        "optimizer_in_backward": functools.partial(torch.optim.AdamW, lr=1e-2),
        "offload_to_cpu": True,
    },
    "sharded": {
        "optimizer_in_backward": functools.partial(torch.optim.AdamW, lr=1e-2),
        "shard_optimizer_state": True,
    },
    "sharded_offload": {
        "optimizer_in_backward": functools.partial(torch.optim.AdamW, lr=1e-2),
        "shard_optimizer_state": True,
        "offload_to_cpu": True,
    },
}


class Tower(nn.Module):
    """Four layers; ``skip`` leaves out layer 1 (a rank that uses different parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if not (self.skip and i == 1):
                x = torch.tanh(layer(x))
        return x


def wrap(config: str, **kwargs) -> leanddp.DistributedDataParallel:
    torch.manual_seed(0)
    return leanddp.DistributedDataParallel(
        Tower(), bucket_cap_mb=0.002, process_group=group(), **CONFIGS[config], **kwargs
    )


@pytest.mark.parametrize("how", ["dies", "raises"])
@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "sharded_offload"])
def test_survivor_raises_within_the_timeout(config: str, how: str) -> None:
    start = time.monotonic()
    outcomes = run_faulty(2, _timed_survivor, config, how)
    took = time.monotonic() - start
    rank0 = outcomes[0]
    assert rank0.error is None, rank0.message
    result = rank0.value
    assert result["raised"], "rank 0 trained on after its peer left"
    assert result["step"] == 2
    assert "rank 0" in result["message"] and "Another rank has probably died" in result["message"]
    if how == "dies":
        assert outcomes[1].died
        assert result["elapsed"] < TIMEOUT_S + 5, result
    else:
        assert outcomes[1].error == "ValueError"
        # gloo waits for the peer until the timeout, never much longer
        assert TIMEOUT_S - 1 < result["elapsed"] < TIMEOUT_S + 10, result
    assert took < 60


def _timed_survivor(rank: int, world_size: int, config: str, how: str) -> dict:
    ddp = wrap(config)
    for step in range(4):
        x = torch.randn(8, 16)
        if rank == 1 and step == 2:
            if how == "dies":
                os._exit(17)
            time.sleep(TIMEOUT_S + 2)  # raised elsewhere: alive, but gone from the loop
            raise ValueError("a bad batch")
        start = time.monotonic()
        try:
            ddp(x).square().mean().backward()
            if config != "views":
                ddp.synchronize()
        except RuntimeError as e:
            elapsed = time.monotonic() - start
            return {"raised": True, "step": step, "elapsed": elapsed, "message": str(e)}
    return {"raised": False}


def _different_parameters(rank: int, world_size: int, config: str) -> dict:
    """Rank 1 leaves out a layer without find_unused_parameters."""
    ddp = wrap(config)
    ddp.module.skip = rank == 1
    start = time.monotonic()
    try:
        ddp(torch.randn(8, 16)).square().mean().backward()
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        if rank == 1:
            time.sleep(TIMEOUT_S + 2)  # stay alive: rank 0 must not wait for us forever
        return {"elapsed": elapsed, "message": str(e)}
    return {}


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "sharded_offload"])
def test_ranks_using_different_parameters_raise(config: str) -> None:
    rank0, rank1 = (o.value for o in run_faulty(2, _different_parameters, config))
    assert "layers.1.weight" in rank1["message"] and "find_unused_parameters" in rank1["message"]
    assert rank1["elapsed"] < TIMEOUT_S, "the rank that lacks a gradient knows at once"
    assert "rank 0" in rank0["message"] and "failed" in rank0["message"]
    assert rank0["elapsed"] < TIMEOUT_S + 10


def _all_params(ddp: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in ddp.module.parameters()])


def _second_backward(rank: int, world_size: int, config: str) -> None:
    ddp = wrap(config)
    loss = ddp(torch.randn(8, 16)).square().mean()
    loss.backward(retain_graph=True)
    if config != "views":
        ddp.synchronize()
    before = _all_params(ddp)
    grads = [None if p.grad is None else p.grad.clone() for p in ddp.module.parameters()]
    # (with optimizer_in_backward autograd itself may see first that the weights it saved for
    # this backward were stepped in place, and say so)
    second = r"second backward through the outputs of one forward|modified by an inplace operation"
    with pytest.raises(RuntimeError, match=second):
        loss.backward()
    assert torch.equal(_all_params(ddp), before)
    for p, g in zip(ddp.module.parameters(), grads, strict=True):
        assert (p.grad is None) == (g is None)
        # the engine may have accumulated into grads before a hook raised, as in torch
    # training goes on, and the ranks still agree
    for _ in range(2):
        ddp(torch.randn(8, 16)).square().mean().backward()
        if config == "views":
            with torch.no_grad():
                for p in ddp.module.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    if config != "views":
        ddp.synchronize()
    mine = _all_params(ddp)
    theirs = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(theirs, mine, group=group())
    assert all(torch.equal(t, theirs[0]) for t in theirs)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_second_backward_raises(config: str) -> None:
    for outcome in run_faulty(2, _second_backward, config):
        assert outcome.error is None, outcome.message


def _changed_after_wrapping(rank: int, world_size: int, change: str) -> None:
    ddp = wrap("views")
    ddp(torch.randn(8, 16)).sum().backward()
    tower = ddp.module
    if change == "added":
        tower.extra = nn.Linear(16, 16)
        pattern = r"now trains extra.weight, extra.bias \(added or unfrozen\)"
    elif change == "frozen":
        tower.layers[2].weight.requires_grad_(False)
        pattern = r"no longer trains layers.2.weight \(removed, replaced or frozen\)"
    else:
        tower.layers[0].weight = nn.Parameter(tower.layers[0].weight.detach().clone())
        pattern = r"now trains layers.0.weight.*no longer trains layers.0.weight"
    before = _all_params(ddp)
    with pytest.raises(RuntimeError, match=pattern):
        ddp(torch.randn(8, 16))
    assert torch.equal(_all_params(ddp), before)
    # nothing was started: the next collective matches across ranks
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=group())
    assert value.item() == 3.0


@pytest.mark.parametrize("change", ["added", "frozen", "replaced"])
def test_parameters_changed_after_wrapping_raise(change: str) -> None:
    for outcome in run_faulty(2, _changed_after_wrapping, change):
        assert outcome.error is None, outcome.message
