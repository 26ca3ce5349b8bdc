"""The seam between the Reducer and the in-backward optimizer (csrc/in_backward_optimizer.h):
the optimizer's state is not read or gathered while the Reducer is in a synchronized iteration
(its collectives would meet the iteration's reduce-scatters on the same group), the Reducer
takes only an optimizer built over its own parameters, group and device ordering, and the
optimizer's own guards hold when it is driven directly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_models import Net
from dist_harness import run_ranks
from in_backward_models import OPTIMIZERS
from seam import host_ordered

import leanddp
from leanddp._extension import _C


def _wrap(**kwargs: object) -> leanddp.DistributedDataParallel:
    torch.manual_seed(3)
    return leanddp.DistributedDataParallel(
        Net(f64=False),
        process_group=dist.new_group(),
        optimizer_in_backward=OPTIMIZERS["adamw"],
        bucket_cap_mb=0.0005,
        **kwargs,
    )


def _armed(rank: int, world_size: int) -> None:
    ddp = _wrap(shard_optimizer_state=True)
    ddp(torch.randn(6, 12)).square().mean().backward()
    loss = ddp(torch.randn(6, 12)).square().mean()  # armed: no bucket taken yet
    for read in (ddp.optimizer.state_dict, ddp.sharded_optimizer_state_dict):
        with pytest.raises(RuntimeError, match="between iterations, not during a backward"):
            read()
    loss.backward()
    state = ddp.optimizer.state_dict()  # between iterations: gathered on every rank
    assert state["state"] and all("exp_avg" in entry for entry in state["state"].values())
    assert ddp.sharded_optimizer_state_dict()["state"]


def test_sharded_state_is_not_gathered_inside_an_iteration() -> None:
    """Between a forward that prepared a synchronized backward and that backward's end, the
    sharded state's gathers (collectives) raise on every rank, before any collective."""
    run_ranks(2, _armed)


def _mismatch(rank: int, world_size: int) -> None:
    group = dist.new_group()
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    names = ["w", "b"]
    reducer_options = _C.ReducerOptions()
    reducer_options.optimizer_in_backward = True
    options = _C.InBackwardOptions()
    options.kind = _C.OptimKind.adam
    options.group_of = [0, 0]
    options.groups = [_C.OptimHyper(lr=0.1)]

    def optimizer(over: list[torch.nn.Parameter]) -> _C.InBackwardOptimizer:
        return _C.InBackwardOptimizer(over, names, group, options, None)

    others = [torch.nn.Parameter(p.detach().clone()) for p in params]

    # another set of parameters, and another device ordering (the side stream the Reducer
    # would queue steps on does not exist)
    def reducer_over(over: list[torch.nn.Parameter]) -> _C.Reducer:
        return _C.Reducer(over, names, group, reducer_options)

    for reducer, core in (
        (reducer_over(params), optimizer(others)),
        (host_ordered(lambda: reducer_over(params)), optimizer(params)),
    ):
        with pytest.raises(RuntimeError, match="built over other parameters"):
            reducer.set_optimizer(core)
        assert not core.attached()
    reducer, core = reducer_over(params), optimizer(params)
    reducer.set_optimizer(core)
    assert core.attached()


def test_the_reducer_takes_only_its_own_optimizer() -> None:
    run_ranks(2, _mismatch)


def _scaler(rank: int, world_size: int) -> None:
    options = _C.InBackwardOptions()
    options.kind = _C.OptimKind.adam
    options.group_of = [0]
    options.groups = [_C.OptimHyper(lr=0.1)]
    options.sharded = True
    core = _C.InBackwardOptimizer([torch.nn.Parameter(torch.randn(8))], ["w"], dist.new_group(),
                                  options, None)  # fmt: skip
    scale, found_inf = torch.ones(()), torch.zeros(())
    with pytest.raises(RuntimeError, match="sharded steps take no GradScaler"):
        core.set_grad_scaler(scale, found_inf)
    core.set_grad_scaler(None, None)  # (none: accepted)


def test_sharded_steps_refuse_a_grad_scaler() -> None:
    run_ranks(2, _scaler)
