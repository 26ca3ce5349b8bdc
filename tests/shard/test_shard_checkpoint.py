"""shard_optimizer_state checkpoints through torch.distributed.checkpoint that stay sharded:
saved on 2 ranks without gathering, loaded on 3 ranks with another bucket size, the state is
what was saved (compared through the gathered torch-format state), and training goes on in
lock step with torch's DDP and optimizer given that same state."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ddp_models import Net
from dist_harness import run_ranks
from in_backward_models import OPTIMIZERS, InBackwardLockStep, assert_params_close

import leanddp

pytestmark = pytest.mark.leanddp_paths

SHARD = dict(shard_optimizer_state=True)


def _wrap(model: torch.nn.Module, name: str, **kwargs) -> leanddp.DistributedDataParallel:
    return leanddp.DistributedDataParallel(
        model, process_group=dist.new_group(), optimizer_in_backward=OPTIMIZERS[name], **kwargs
    )


def _save(rank: int, world_size: int, path: Path, name: str, kwargs: dict) -> None:
    torch.manual_seed(3)  # the same model on both ranks, and in the loading run
    ddp = _wrap(Net(f64=False), name, bucket_cap_mb=0.0005, **SHARD, **kwargs)
    for _ in range(3):
        ddp(torch.randn(6, 12)).square().mean().backward()
    dcp.save({"optimizer": ddp.sharded_optimizer_state_dict()}, checkpoint_id=path / "dcp")
    gathered = ddp.optimizer.state_dict()  # the reference (a collective: every rank)
    if rank == 0:
        torch.save({"optimizer": gathered, "model": ddp.module.state_dict()}, path / "ref.pt")


def _load(rank: int, world_size: int, path: Path, name: str, kwargs: dict) -> None:
    saved = torch.load(path / "ref.pt", weights_only=False)
    torch.manual_seed(3)
    model = Net(f64=False)
    model.load_state_dict(saved["model"])
    ddp = _wrap(copy.deepcopy(model), name, **SHARD, **kwargs)  # default buckets this time
    template = {"optimizer": ddp.sharded_optimizer_state_dict()}
    dcp.load(template, checkpoint_id=path / "dcp")
    ddp.load_sharded_optimizer_state_dict(template["optimizer"])
    gathered = ddp.optimizer.state_dict()
    assert gathered["param_groups"] == saved["optimizer"]["param_groups"]
    assert gathered["state"].keys() == saved["optimizer"]["state"].keys()
    for index, entry in saved["optimizer"]["state"].items():
        assert gathered["state"][index].keys() == entry.keys(), index
        for key, value in entry.items():
            assert torch.equal(gathered["state"][index][key], value), f"{index} {key}"
    # and it trains on as torch's DDP + optimizer loaded with that state
    run = InBackwardLockStep(model, OPTIMIZERS[name], with_scheduler=False, ours_kwargs=SHARD)
    run.ours = ddp
    run.ref_opt.load_state_dict(saved["optimizer"])
    for step in range(3):
        run.step([torch.randn(6, 12)])
        assert_params_close(run, f"{name} after loading, step {step}")


CASES = [("adamw-groups", {}), ("sgd-nesterov", {"offload_to_cpu": True})]


def _save_all(rank: int, world_size: int, path: Path) -> None:
    for k, (name, kwargs) in enumerate(CASES):
        _save(rank, world_size, path / str(k), name, kwargs)


def _load_all(rank: int, world_size: int, path: Path) -> None:
    for k, (name, kwargs) in enumerate(CASES):
        _load(rank, world_size, path / str(k), name, kwargs)


def test_saved_on_two_ranks_loaded_on_three(tmp_path: Path) -> None:
    """On the device (AdamW, two groups) and with offload_to_cpu (SGD with momentum)."""
    for k in range(len(CASES)):
        (tmp_path / str(k)).mkdir()
    run_ranks(2, _save_all, tmp_path)
    run_ranks(3, _load_all, tmp_path)


def _refused(rank: int, world_size: int) -> None:
    for kwargs in ({}, {"optimizer_in_backward": OPTIMIZERS["adamw"]}):
        ddp = leanddp.DistributedDataParallel(Net(f64=False), **kwargs)
        with pytest.raises(ValueError, match="needs shard_optimizer_state=True"):
            ddp.sharded_optimizer_state_dict()
        with pytest.raises(ValueError, match="needs shard_optimizer_state=True"):
            ddp.load_sharded_optimizer_state_dict({"state": {}, "param_groups": ()})


def test_a_wrapper_that_is_not_sharded_refuses_sharded_checkpoints() -> None:
    run_ranks(1, _refused)
