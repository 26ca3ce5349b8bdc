"""optimizer_in_backward: checkpoints interchangeable with the plain torch optimizer in both
directions, and gradient memory released bucket by bucket inside backward."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from ddp_models import Net
from dist_harness import run_ranks
from in_backward_models import OPTIMIZERS, Deep, completed_allreduce_hook, round_trip
from torch import nn

import leanddp

BATCH = 6


def _loss(ddp: nn.Module) -> None:
    ddp(torch.randn(BATCH, 12)).square().mean().backward()


def _torch_ddp(model: nn.Module) -> torch.nn.parallel.DistributedDataParallel:
    return torch.nn.parallel.DistributedDataParallel(model, process_group=dist.new_group())


def _ours(model: nn.Module, factory, offload: bool = False) -> leanddp.DistributedDataParallel:
    return leanddp.DistributedDataParallel(
        model,
        process_group=dist.new_group(),
        optimizer_in_backward=factory,
        bucket_cap_mb=0.0005,
        offload_to_cpu=offload,
    )


def _same_format(ours: dict, theirs: dict) -> None:
    """Same param_groups and the same state entries, key for key, with close values."""
    assert ours["param_groups"] == theirs["param_groups"]
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for k, entry in theirs["state"].items():
        assert list(ours["state"][k]) == list(entry), f"state[{k}] keys"
        for name, value in entry.items():
            torch.testing.assert_close(ours["state"][k][name], value, rtol=1e-5, atol=1e-6)
            assert ours["state"][k][name].device == value.device


def _checkpoints(rank: int, world_size: int, name: str, offload: bool) -> None:
    factory = OPTIMIZERS[name]
    net = functools.partial(Net, rank=rank, f64=not offload)  # offload: no float64 parameters
    model = net()
    # A plain torch run and an in-backward run side by side for three steps.
    ref = _torch_ddp(copy.deepcopy(model))
    ref_opt = factory(ref.module.parameters())
    ours = _ours(copy.deepcopy(model), factory, offload)
    for _ in range(3):
        torch.manual_seed(rank * 100 + _)
        _loss(ref)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.manual_seed(rank * 100 + _)
        _loss(ours)
    saved_ours = round_trip(
        {"model": ours.module.state_dict(), "optim": ours.optimizer.state_dict()}
    )
    saved_ref = round_trip({"model": ref.module.state_dict(), "optim": ref_opt.state_dict()})
    _same_format(saved_ours["optim"], saved_ref["optim"])

    # ours -> plain torch, and plain torch -> ours (loaded before its first step).
    plain = _torch_ddp(net())
    plain.module.load_state_dict(saved_ours["model"])
    plain_opt = factory(plain.module.parameters())
    plain_opt.load_state_dict(saved_ours["optim"])
    resumed = _ours(net(), factory, offload)
    resumed.module.load_state_dict(saved_ref["model"])
    resumed.optimizer.load_state_dict(saved_ref["optim"])
    for step in range(3, 6):
        runs = [(ref, ref_opt), (ours, None), (plain, plain_opt), (resumed, None)]
        for ddp, opt in runs:
            torch.manual_seed(rank * 100 + step)
            _loss(ddp)
            if opt is not None:
                opt.step()
                opt.zero_grad()
        ours.synchronize()  # offload: the host steps are done (a no-op otherwise)
        resumed.synchronize()
        for (pn, a), b, c, d in zip(
            ref.module.named_parameters(),
            ours.module.parameters(),
            plain.module.parameters(),
            resumed.module.parameters(),
            strict=True,
        ):
            for what, x in (("uninterrupted", b), ("ours->torch", c), ("torch->ours", d)):
                where = f"{what} step {step} {pn}"
                torch.testing.assert_close(
                    x, a, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}"
                )
    _same_format(resumed.optimizer.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize(
    "name,offload",
    [
        ("adamw", False),
        ("sgd-nesterov", False),
        ("adagrad", False),
        ("adamw", True),
        ("sgd-nesterov", True),
    ],
    ids=["adamw", "sgd-nesterov", "adagrad", "adamw-offload", "sgd-nesterov-offload"],
)
def test_checkpoint_round_trip_both_ways(name: str, offload: bool) -> None:
    """ddp.optimizer's checkpoints load into plain torch and back (offload: state on the host)."""
    run_ranks(2, _checkpoints, name, offload)


def _release(rank: int, world_size: int, completed: bool) -> None:
    model = Deep()
    layer_bytes = 32 * 32 * 4
    ddp = leanddp.DistributedDataParallel(
        model,
        bucket_cap_mb=layer_bytes / 2**20,
        optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-2),
    )
    if completed:
        ddp.register_comm_hook(dist.new_group(), completed_allreduce_hook)
    samples = []
    first = model.layers[0].weight  # its gradient is the last to become ready

    def sample(_: torch.Tensor) -> None:
        stats = ddp.memory_stats()
        held = [p.grad is not None for p in model.parameters()]
        samples.append((stats["bucket_bytes"], sum(held)))

    first.register_post_accumulate_grad_hook(sample)
    for _ in range(4):
        _loss_deep(ddp)
        stats = ddp.memory_stats()
        assert stats["bucket_bytes"] == 0 and stats["grads_as_views"] == 0
        assert all(p.grad is None for p in model.parameters())
        sizes = sorted(ddp.reducer.bucket_bytes(), reverse=True)
        assert len(sizes) == 12
        in_flight = stats["max_buckets_in_flight"]
        # Bounded by the buckets in flight (plus the one being filled), not by the model.
        assert stats["peak_bucket_bytes"] <= sum(sizes[: in_flight + 1]), stats
        if completed:
            assert in_flight == 1
            assert stats["peak_bucket_bytes"] <= 2 * layer_bytes
    if completed:
        for bucket_bytes, grads_held in samples[1:]:  # after the rebuild
            # At the last hook every other bucket has been stepped and released.
            assert bucket_bytes <= layer_bytes and grads_held <= 1, samples


def _loss_deep(ddp: nn.Module) -> None:
    ddp(torch.randn(4, 32)).square().mean().backward()


@pytest.mark.parametrize("completed", [False, True], ids=["gloo-async", "completed-hook"])
def test_gradients_released_per_bucket_during_backward(completed: bool) -> None:
    run_ranks(2, _release, completed)
