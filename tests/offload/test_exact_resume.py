"""offload_to_cpu with bfloat16/float16 parameters resumes exactly: the float32 master weights
and optimizer state saved by ``ddp.optimizer.state_dict()`` come back bit for bit through
``ddp.optimizer.load_state_dict`` (torch's load casts state values to the parameter's dtype,
which would round them), with and without shard_optimizer_state, and through
torch.distributed.checkpoint with the sharded state; training after the resume equals training
on (gloo, 2 ranks, several steps, random data), also from a sharded checkpoint saved before the
first step."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import run_ranks
from torch import nn

import leanddp

OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "sgd": functools.partial(torch.optim.SGD, lr=0.05),  # no momentum: masters only
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
}
STEPS, SAVED_AFTER = 5, 2


def _model(dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)]
    return nn.Sequential(*layers).to(dtype)


def _wrap(model: nn.Module, name: str, sharded: bool) -> leanddp.DistributedDataParallel:
    return leanddp.DistributedDataParallel(
        model,
        process_group=dist.new_group(),
        bucket_cap_mb=0.002,  # several buckets
        optimizer_in_backward=OPTIMIZERS[name],
        offload_to_cpu=True,
        shard_optimizer_state=sharded,
    )


def _step(ddp: leanddp.DistributedDataParallel, x: torch.Tensor) -> None:
    ddp(x).float().square().mean().backward()


def _flat(ddp: leanddp.DistributedDataParallel) -> torch.Tensor:
    ddp.synchronize()
    return torch.cat([p.detach().float().flatten() for p in ddp.parameters()])


def _masters(ddp: leanddp.DistributedDataParallel) -> list[torch.Tensor]:
    state = ddp.optimizer.state_dict()["state"]  # (sharded: gathered, a collective)
    return [state[i]["master_weight"] for i in sorted(state)]


def _resume(rank: int, world_size: int, name: str, dtype: str, sharded: bool, path: str) -> None:
    dtype_ = getattr(torch, dtype)
    data = [torch.randn(8, 16, dtype=dtype_) for _ in range(STEPS)]
    straight = _wrap(_model(dtype_, 0), name, sharded)
    blob = io.BytesIO()
    for step, x in enumerate(data):
        _step(straight, x)
        if step == SAVED_AFTER - 1:
            model, optim = straight.module.state_dict(), straight.optimizer.state_dict()
            torch.save({"model": model, "optim": optim}, blob)
            if sharded:
                dcp.save({"optim": straight.sharded_optimizer_state_dict()}, checkpoint_id=path)
            masters = _masters(straight)
            assert all(m.dtype == torch.float32 for m in masters)
            # the masters hold more than the parameters' bits (else this test shows nothing)
            rounded = [m.to(dtype_).float() for m in masters]
            assert any(not torch.equal(m, r) for m, r in zip(masters, rounded, strict=True))
    loads = ["state_dict"] + (["dcp"] if sharded else [])
    for load in loads:
        resumed = _wrap(_model(dtype_, 1), name, sharded)  # other weights, no state
        saved = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
        resumed.module.load_state_dict(saved["model"])
        if load == "state_dict":
            resumed.optimizer.load_state_dict(saved["optim"])
        else:
            template = {"optim": resumed.sharded_optimizer_state_dict()}
            dcp.load(template, checkpoint_id=path)
            resumed.load_sharded_optimizer_state_dict(template["optim"])
        saved_state = saved["optim"]["state"]
        for a, i in zip(_masters(resumed), sorted(saved_state), strict=True):
            assert torch.equal(a, saved_state[i]["master_weight"]), f"{load}: rounded master"
        for x in data[SAVED_AFTER:]:
            _step(resumed, x)
        diff = (_flat(resumed) - _flat(straight)).abs().max().item()
        assert torch.equal(_flat(resumed), _flat(straight)), f"{load}: resumed differs by {diff}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_offload_resumes_exactly(name: str, dtype: str) -> None:
    run_ranks(2, _resume, name, dtype, False, "")


@pytest.mark.leanddp_paths
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_offload_sharded_resumes_exactly(name: str, tmp_path: Path) -> None:
    run_ranks(2, _resume, name, "bfloat16", True, str(tmp_path / "dcp"))


def _saved_before_the_first_step(rank: int, world_size: int, path: str) -> None:
    straight = _wrap(_model(torch.bfloat16, 0), "adamw", True)
    dcp.save({"optim": straight.sharded_optimizer_state_dict()}, checkpoint_id=path)
    resumed = _wrap(_model(torch.bfloat16, 1), "adamw", True)  # other weights
    resumed.module.load_state_dict(straight.module.state_dict())
    template = {"optim": resumed.sharded_optimizer_state_dict()}
    dcp.load(template, checkpoint_id=path)
    resumed.load_sharded_optimizer_state_dict(template["optim"])
    upcast = [p.detach().float() for p in straight.module.parameters()]
    for master, want in zip(_masters(resumed), upcast, strict=True):
        assert torch.equal(master, want), "the saved master is not the parameter"
    for step in range(3):
        x = torch.randn(8, 16, dtype=torch.bfloat16)
        _step(straight, x)
        _step(resumed, x)
        assert torch.equal(_flat(resumed), _flat(straight)), f"step {step}"


@pytest.mark.leanddp_paths
def test_offload_sharded_checkpoint_before_the_first_step(tmp_path: Path) -> None:
    """A sharded checkpoint saved before any step holds the masters the first step starts
    from (the bfloat16 parameters upcast), not the uninitialized host memory they were."""
    run_ranks(2, _saved_before_the_first_step, str(tmp_path / "dcp"))
