"""What code written for torch's DDP relies on: the constructor, bad input, state_dict,
pickling, the reducer's methods, logging data, communication hooks and no_sync placement."""

from __future__ import annotations

import inspect
import io

import pytest
import torch
import torch.distributed as dist
from ddp_models import Case, LockStep, Net, assert_same
from dist_harness import run_ranks
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join

import leanddp


def test_subclass_accepts_torchs_arguments() -> None:
    assert issubclass(leanddp.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)
    ours = inspect.signature(leanddp.DistributedDataParallel.__init__).parameters
    theirs = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    positional = [n for n, p in theirs.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [n for n in ours if n in positional] == positional  # same positional order
    assert ours["gradient_as_bucket_view"].default is True


class _TwoDevices(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
        self.b = torch.nn.Linear(2, 2, device="meta")


_NAN = dict(check_for_nan_in_grad=True)
_BAD = [
    (dict(bucket_cap_mb=0), ValueError, "bucket_cap_mb must be positive"),
    (dict(bucket_cap_mb=-1.0), ValueError, "bucket_cap_mb must be positive"),
    (dict(bucket_cap_mb_list=[25, 0]), ValueError, r"bucket_cap_mb_list\[1\]"),
    (dict(device_ids=[0]), ValueError, "device_ids"),
    (dict(mixed_precision=object()), NotImplementedError, "mixed_precision"),
    (dict(param_to_hook_all_reduce=object()), NotImplementedError, "param_to_hook_all_reduce"),
    (dict(optimizer_in_backward="adamw"), TypeError, "optimizer_in_backward must be a callable"),
    (dict(offload_to_cpu=True), ValueError, "offload_to_cpu=True needs optimizer_in_backward"),
    (dict(offload_to_cpu=1), TypeError, "offload_to_cpu must be a bool"),
    (dict(offload_threads=2), ValueError, "offload_threads is meaningful only with"),
    (dict(max_grad_norm=1.0), ValueError, "max_grad_norm needs optimizer_in_backward"),
    (dict(check_for_nan_in_grad="yes"), ValueError, "check_for_nan_in_grad must be True, False"),
    (dict(shard_optimizer_state=1), TypeError, "shard_optimizer_state must be a bool"),
    (dict(shard_optimizer_state=True), ValueError, "shard_optimizer_state=True needs optimizer_in"),
    (
        dict(shard_optimizer_state=True, optimizer_in_backward=torch.optim.AdamW, **_NAN),
        ValueError,
        "check_for_nan_in_grad is not supported with shard_optimizer_state",
    ),
    (
        dict(
            shard_optimizer_state=True,
            optimizer_in_backward=torch.optim.AdamW,
            grad_scaler=torch.amp.GradScaler("cpu"),
        ),
        ValueError,
        "grad_scaler is not supported with shard_optimizer_state",
    ),
    (
        dict(shard_optimizer_state=True, optimizer_in_backward=torch.optim.Adagrad),
        ValueError,
        "shard_optimizer_state steps with leanddp's fused kernels.*Adagrad",
    ),
    (
        dict(shard_optimizer_state=True, optimizer_in_backward=torch.optim.AdamW),
        ValueError,
        "shard_optimizer_state steps float32, bfloat16 and float16 parameters; parameter 'f64",
    ),
    (dict(module=_TwoDevices()), ValueError, "must be on the same type of devices"),
    (dict(module=torch.nn.Linear(2, 2).requires_grad_(False)), RuntimeError, "is not needed"),
]


def _bad_input(rank: int, world_size: int) -> None:
    for kwargs, error, message in _BAD:
        module = kwargs.pop("module", None) or Net(rank=rank)
        before = [p.detach().clone() for p in module.parameters() if p.device.type != "meta"]
        with pytest.raises(error, match=message):
            leanddp.DistributedDataParallel(module, **kwargs)
        after = [p for p in module.parameters() if p.device.type != "meta"]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), (
            f"{kwargs} changed state"
        )
    # no collective was started: the next one matches across ranks
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    assert value.item() == world_size * (world_size + 1) / 2


def _mismatch(rank: int, world_size: int) -> None:
    module = Net(rank=rank)
    if rank == 1:
        module.head = torch.nn.Linear(12, 4)
    with pytest.raises(ValueError, match=r"'head.weight' \[3, 12\].*\[4, 12\] .*rank 1"):
        leanddp.DistributedDataParallel(module)


def _no_object_collectives(rank: int, world_size: int) -> None:
    """Construction uses tensor collectives on the module's device: torch's object collectives
    stage on the current CUDA device, which the DDP tutorial's pattern (``model.to(rank)``,
    ``device_ids=[rank]``, no ``torch.cuda.set_device``) leaves at cuda:0 on every rank."""

    def refuse(*args, **kwargs):
        raise AssertionError("an object collective ran during construction")

    with pytest.MonkeyPatch.context() as patch:
        for name in ("all_gather_object", "broadcast_object_list", "gather_object"):
            patch.setattr(dist, name, refuse)
            patch.setattr(dist.distributed_c10d, name, refuse)
        leanddp.DistributedDataParallel(Net(rank=rank))
        _mismatch(rank, world_size)


def _unused_without_flag(rank: int, world_size: int) -> None:
    module = Net(unused=True, rank=1)  # no rank uses `branch` or `never`
    ddp = leanddp.DistributedDataParallel(module)
    with pytest.raises(RuntimeError, match="no gradient.*branch.weight.*find_unused_parameters"):
        ddp(torch.randn(4, 12)).sum().backward()


def _state_dict_and_pickle(rank: int, world_size: int) -> None:
    model = Net(rank=rank)
    ref = torch.nn.parallel.DistributedDataParallel(model, process_group=dist.new_group())
    ours = leanddp.DistributedDataParallel(Net(rank=rank))
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    assert ours.module.head is ours.module.get_submodule("head")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, ours)]

    def step(ddps):
        x = torch.randn(5, 12)
        for ddp, opt in zip(ddps, opts, strict=True):
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()

    step((ref, ours))
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, leanddp.DistributedDataParallel)
    opts[1] = torch.optim.SGD(loaded.parameters(), lr=0.1, momentum=0.9)
    opts[1].load_state_dict({"state": {}, "param_groups": opts[1].state_dict()["param_groups"]})
    opts[0] = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)  # same fresh state
    for _ in range(3):
        step((ref, loaded))
    for (name, a), b in zip(ref.module.named_parameters(), loaded.module.parameters(), strict=True):
        assert_same(a, b, f"after unpickling: {name}", exact=True)


def _reducer_and_logging(rank: int, world_size: int) -> None:
    ref = torch.nn.parallel.DistributedDataParallel(Net(rank=rank), gradient_as_bucket_view=True)
    ours = leanddp.DistributedDataParallel(Net(rank=rank))
    for ddp in (ref, ours):
        for _ in range(2):
            ddp(torch.randn(4, 12)).sum().backward()
    theirs, mine = ref._get_ddp_logging_data(), ours._get_ddp_logging_data()
    assert set(mine) <= set(theirs), set(mine) - set(theirs)
    for key in mine:
        # durations and timestamps are measured (checked in test_ddp_torch_api); the first
        # buckets of a mixed-dtype module come in another order than torch's
        if "_time" not in key and key != "bucket_sizes":
            assert mine[key] == theirs[key], (key, mine[key], theirs[key])
    # third-party code drives the reducer directly
    module = Net(rank=rank)
    ddp = leanddp.DistributedDataParallel(module, find_unused_parameters=True)
    out = ddp.module(torch.randn(4, 12))
    ddp.reducer.prepare_for_backward(out)
    out.sum().backward()
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)
    ddp2 = leanddp.DistributedDataParallel(Net(rank=rank))
    ddp2._set_static_graph()
    assert ddp2.static_graph
    ddp2(torch.randn(4, 12)).sum().backward()
    with pytest.raises(RuntimeError, match="before the first backward"):
        ddp2.reducer._set_static_graph()
    with pytest.raises(NotImplementedError, match="join"):
        ddp2.join()
    # torch's Join context (Accelerate builds a disabled one around every run): disabled, and
    # enabled with even inputs, it trains as torch's DDP; only a rank out of inputs first raises
    run = LockStep(Net(rank=rank), Case(optimizer="adamw"))
    for enable in (False, True):
        with Join([run.ours], enable=enable), Join([run.ref], enable=enable):
            for _ in range(2):
                run.backward([torch.randn(6, 12)])
                run.step()
        for name, a, b in run.pairs():
            assert_same(a, b, f"Join(enable={enable}) {name}", exact=True)
    with pytest.raises(NotImplementedError, match="ran out of inputs before the others"):
        run.ours.join_hook().main_hook()


def _hooks(rank: int, world_size: int, name: str) -> None:
    if name == "powersgd":
        # one bucket: with two, torch's PowerSGD deadlocks gloo's worker threads (torch's DDP too)
        model = torch.nn.Sequential(
            torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
        )
    else:
        model = Net(rank=rank)
    run = LockStep(model, Case(optimizer="adamw"))
    for ddp in (run.ref, run.ours):
        group = ddp.process_group
        if name == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                group, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=7
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            ddp.register_comm_hook(group, getattr(default_hooks, name))
    for step in range(5):
        run.backward([torch.randn(6, 12)])
        for pname, a, b in run.pairs():
            assert_same(a.grad, b.grad, f"{name} step {step} grad of {pname}", exact=True)
        run.step()


@pytest.mark.parametrize(
    "body",
    [
        _bad_input,
        _no_object_collectives,
        _unused_without_flag,
        _state_dict_and_pickle,
        _reducer_and_logging,
    ],
)
def test_api(body) -> None:
    run_ranks(2, body)


# torch's bf16_compress_hook refuses gloo (it needs NCCL), so it is exercised only on a GPU.
@pytest.mark.parametrize("hook", ["allreduce_hook", "fp16_compress_hook", "powersgd"])
def test_torch_comm_hooks(hook: str) -> None:
    run_ranks(2, _hooks, hook)


def _no_sync_placement(rank: int, world_size: int) -> None:
    """torch's rule: a forward run inside no_sync() makes its backward local, wherever the
    backward runs; a forward outside makes it reduce, even if the backward is inside."""
    run = LockStep(Net(rank=rank), Case(optimizer="sgd"))
    for step in range(4):
        x, y = torch.randn(5, 12), torch.randn(5, 12)
        for ddp, opt in zip((run.ref, run.ours), run.opts, strict=True):
            opt.zero_grad()
            with ddp.no_sync():
                loss = ddp(x).sum()
            loss.backward()  # local
            loss = ddp(y).sum()
            with ddp.no_sync():
                loss.backward()  # reduces
        for name, a, b in run.pairs():
            assert_same(a.grad, b.grad, f"step {step} grad of {name}", exact=True)
        run.step()


def test_no_sync_forward_inside_or_outside() -> None:
    run_ranks(2, _no_sync_placement)
