"""optimizer_in_backward against torch's DDP followed by the same torch optimizer, on random
data in the same processes: parameters after every step within 1e-5 relative (SGD's bit for
bit), for SGD
(momentum, Nesterov, dampening, weight decay, maximize), Adam, AdamW, parameter groups, an LR
scheduler, no_sync accumulation, tiny buckets, unused parameters and static graphs, and
optimizers without a fused kernel (Adagrad, AMSGrad) through the per-bucket fallback.

The model (tests/support/ddp_models.Net) has tied weights, a frozen layer, BatchNorm buffers
and a float64 layer: that layer's bucket is always stepped by the fallback, so fused and fallback
buckets are mixed in one backward.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from ddp_models import Net
from dist_harness import run_ranks
from in_backward_models import (
    OPTIMIZERS,
    InBackwardLockStep,
    assert_params_close,
    train_lock_step,
)

STEPS = 5
BATCH = 6


def _train(
    rank: int, run: InBackwardLockStep, what: str, accum: int, static: bool, exact: bool = False
) -> None:
    train_lock_step(run, what, accum, STEPS, static, exact)


def _matrix(rank: int, world_size: int, names: list[str]) -> None:
    for name, accum, tiny in itertools.product(names, (1, 3), (False, True)):
        run = InBackwardLockStep(
            Net(rank=rank), OPTIMIZERS[name], bucket_cap_mb=0.0005 if tiny else None
        )
        # SGD, fused kernel and fallback alike, computes torch's for-loop SGD's bits: held
        # exactly, as a last-bit difference grows over the steps (gradient ascent with
        # dampening) past any tolerance. (The Adam references step with torch's fused kernel,
        # which rounds float64 and AMSGrad otherwise than the fallback's torch optimizer.)
        exact = name.startswith("sgd")
        _train(rank, run, f"{name} accum={accum} tiny={tiny}", accum, static=False, exact=exact)
        assert isinstance(run.ours.optimizer, type(run.ref_opt))


@pytest.mark.parametrize(
    "names",
    [
        ["sgd-nesterov", "sgd-dampening", "sgd-plain"],
        ["adam", "adamw"],
        ["adamw-groups", "sgd-groups"],
        ["adagrad", "adamw-amsgrad"],
    ],
    ids=["sgd", "adam", "groups", "fallback"],
)
def test_parity_with_torch_ddp_and_optimizer(names: list[str]) -> None:
    run_ranks(2, _matrix, names)


def _variants(rank: int, world_size: int) -> None:
    variants = [
        dict(gradient_as_bucket_view=False),
        dict(find_unused_parameters=True, unused=True),
        dict(static_graph=True, unused=True),
        dict(static_graph=True),
    ]
    for kwargs, name, accum in itertools.product(variants, ("sgd-nesterov", "adamw"), (1, 3)):
        unused = kwargs.pop("unused", False)
        run = InBackwardLockStep(Net(unused=unused, rank=rank), OPTIMIZERS[name], **kwargs)
        what = f"{name} {kwargs} unused={unused} accum={accum}"
        _train(rank, run, what, accum, static=kwargs.get("static_graph", False))
        if unused:
            assert rank != 0 or run.ours.module.branch.weight.grad is None
            torch.testing.assert_close(run.ours.module.never.weight, run.ref.module.never.weight)
            # torch's optimizer never saw a gradient for the unused layer: no state, and ours agrees
            assert run.ours.module.never.weight not in run.ours.optimizer.state
        kwargs["unused"] = unused


def test_views_off_unused_and_static_graph() -> None:
    run_ranks(2, _variants)


def _three_ranks(rank: int, world_size: int) -> None:
    run = InBackwardLockStep(Net(rank=rank), OPTIMIZERS["adamw-groups"], bucket_cap_mb=0.0005)
    _train(rank, run, "adamw-groups, 3 ranks", accum=3, static=False)


@pytest.mark.extra_ranks
def test_parity_three_ranks() -> None:
    run_ranks(3, _three_ranks)


def _comm_hook(rank: int, world_size: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    run = InBackwardLockStep(Net(rank=rank), OPTIMIZERS["adamw"], bucket_cap_mb=0.0005)
    for ddp in (run.ref, run.ours):
        ddp.register_comm_hook(ddp.process_group, default_hooks.allreduce_hook)
    _train(rank, run, "adamw with torch's allreduce_hook", accum=2, static=False)


def test_with_comm_hook() -> None:
    run_ranks(2, _comm_hook)


class StridedNet(torch.nn.Module):
    """A float32 parameter that is not contiguous (a strided slice: the fallback steps it) next
    to contiguous float32 parameters (the fused kernel), in the same buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.strided = torch.nn.Parameter((0.3 * torch.randn(12, 24))[:, ::2])
        self.head = torch.nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x @ self.strided))


def _mixed(rank: int, world_size: int) -> None:
    assert not StridedNet().strided.is_contiguous()
    for name, tiny in itertools.product(("adamw", "sgd-nesterov"), (False, True)):
        run = InBackwardLockStep(
            StridedNet(), OPTIMIZERS[name], bucket_cap_mb=0.0005 if tiny else None
        )
        for step in range(STEPS):
            run.step([torch.randn(BATCH, 12) for _ in range(2)])
            assert_params_close(run, f"{name} tiny={tiny} step {step}")
        state = run.ours.optimizer.state_dict()["state"]
        assert sorted(state) == sorted(run.ref_opt.state_dict()["state"])


def test_fused_and_fallback_parameters_in_one_bucket() -> None:
    run_ranks(2, _mixed)
