"""Where torch's API pins behaviour, leanddp behaves as torch's DDP, checked side by side in the
same processes: error types and words, communication-hook checks, built-in hooks, the
GradBucket a hook receives, ``_set_static_graph`` and the logging data.

(No ``from __future__ import annotations`` here: torch checks hooks' annotations as objects.)"""

import copy

import pytest
import torch
import torch.distributed as dist
from ddp_models import Case, LockStep, Net, assert_same
from dist_harness import run_ranks
from torch import nn

import leanddp

TorchDDP = torch.nn.parallel.DistributedDataParallel


def _both(make, error: type[BaseException], match: str) -> None:
    """``make(cls)`` raises ``error`` matching ``match`` for torch's DDP and for leanddp's."""
    for cls in (TorchDDP, leanddp.DistributedDataParallel):
        with pytest.raises(error, match=match):
            make(cls)


def _fresh(cls: type, rank: int, **kwargs) -> nn.Module:
    return cls(Net(rank=rank), gradient_as_bucket_view=True, **kwargs)


def _train(ddp: nn.Module, steps: int = 1) -> None:
    for _ in range(steps):
        ddp(torch.randn(4, 12)).sum().backward()


def _hook_bad_bucket(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def _hook_bad_return(state: object, bucket: dist.GradBucket) -> int:
    raise AssertionError("never called")


def _errors(rank: int, world_size: int) -> None:
    _both(lambda cls: cls(nn.Linear(2, 2).requires_grad_(False)), RuntimeError,
          "DistributedDataParallel is not needed when a module doesn't have any parameter that "
          "requires a gradient.")  # fmt: skip
    _both(lambda cls: cls(nn.Module()), RuntimeError, "is not needed")
    _both(lambda cls: cls(nn.LazyLinear(3)), RuntimeError, "uninitialized parameters")
    _both(lambda cls: cls(Net(rank=rank), device_ids=[0, 1]), ValueError,
          "device_ids can only be None or contain a single element")  # fmt: skip
    mesh = dist.device_mesh.init_device_mesh("cpu", (world_size,))
    _both(lambda cls: cls(Net(rank=rank), process_group=dist.group.WORLD, device_mesh=mesh),
          RuntimeError, "Cannot specify both process_group and device_mesh arguments.")  # fmt: skip
    ours = leanddp.DistributedDataParallel(Net(rank=rank), device_mesh=mesh)
    assert ours.device_mesh is mesh
    # register_comm_hook checks the hook as torch's does, and logs the error as torch's does
    for cls in (TorchDDP, leanddp.DistributedDataParallel):
        ddp = _fresh(cls, rank)
        with pytest.raises(TypeError, match="Communication hook must be callable."):
            ddp.register_comm_hook({}, {})
        data = ddp._get_ddp_logging_data()
        assert data["has_error"] == 1 and "must be callable" in data["error"], (cls, data)
        with pytest.raises(ValueError, match="bucket annotation should be dist.GradBucket"):
            ddp.register_comm_hook(None, _hook_bad_bucket)
        with pytest.raises(ValueError, match=r"return annotation should be torch.futures"):
            ddp.register_comm_hook(None, _hook_bad_return)
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        with pytest.raises(RuntimeError, match="can only be called once"):
            ddp.register_comm_hook(dist.group.WORLD, _allreduce_checked)
        with pytest.raises(ValueError, match="equal or greater than 1"):
            ddp._set_ddp_runtime_logging_sample_rate(0)
        # _set_static_graph: before the first iteration only, the error logged
        _train(ddp)
        with pytest.raises(RuntimeError, match="should be called before training loop starts"):
            ddp._set_static_graph()
        data = ddp._get_ddp_logging_data()
        assert "should be called before training loop starts" in data["error"], (cls, data)
        if cls is leanddp.DistributedDataParallel:
            assert not ddp.static_graph  # (torch's sets it before its reducer refuses)
    for cls in (TorchDDP, leanddp.DistributedDataParallel):
        ddp = _fresh(cls, rank)
        ddp._set_static_graph()
        assert ddp.static_graph and ddp._get_ddp_logging_data()["static_graph"] == 1
        with pytest.warns(UserWarning, match="no need to set it again"):
            ddp._set_static_graph()


def _builtin(rank: int, world_size: int, kind: str) -> None:
    hook_type = getattr(dist.BuiltinCommHookType, kind)
    run = LockStep(Net(rank=rank, f64=False), Case(optimizer="adamw"))
    for ddp in (run.ref, run.ours):
        ddp._register_builtin_comm_hook(hook_type)
    assert run.ours._get_ddp_logging_data()["comm_hook"] == str(hook_type)
    for step in range(4):
        run.backward([torch.randn(6, 12) * (rank + 1)])
        for name, a, b in run.pairs():
            assert_same(a.grad, b.grad, f"{kind} step {step} grad of {name}", exact=True)
        run.step()


#: What _allreduce_checked saw, per call: (index, is_last, buffer numel).
_SEEN: list[tuple[int, bool, int]] = []


def _allreduce_checked(
    group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's allreduce hook, after checking the GradBucket against the parameters."""
    assert isinstance(bucket, dist.GradBucket), type(bucket)
    buffer = bucket.buffer()
    grads, params = bucket.gradients(), bucket.parameters()
    assert len(grads) == len(params) > 0
    offset = 0
    for g, p in zip(grads, params, strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
        assert g.data_ptr() == buffer[offset:].data_ptr()  # a view into the buffer
        offset += p.numel()
    assert offset == buffer.numel()
    _SEEN.append((bucket.index(), bucket.is_last(), buffer.numel()))
    bucket.set_buffer(buffer.div(group.size()))  # torch's: replaces what buffer() returns
    tensor = bucket.buffer()
    return (
        dist.all_reduce(tensor, group=group, async_op=True)
        .get_future()
        .then(lambda fut: fut.value()[0])
    )


def _grad_bucket(rank: int, world_size: int) -> None:
    run = LockStep(Net(rank=rank), Case(optimizer="sgd", tiny_buckets=True))
    ids = {id(p) for p in run.ours.module.parameters()}
    for ddp in (run.ref, run.ours):
        ddp.register_comm_hook(ddp.process_group, _allreduce_checked)
    for step in range(3):
        _SEEN.clear()
        run.backward([torch.randn(6, 12)])
        theirs, ours = _SEEN[: len(_SEEN) // 2], _SEEN[len(_SEEN) // 2 :]
        assert [i for i, _, _ in ours] == list(range(len(ours))) and len(ours) > 1, ours
        assert [last for _, last, _ in ours] == [False] * (len(ours) - 1) + [True]
        assert sum(n for *_, n in ours) == sum(n for *_, n in theirs)
        for name, a, b in run.pairs():
            assert_same(a.grad, b.grad, f"step {step} grad of {name}", exact=True)
        run.step()
    assert ids == {id(p) for p in run.ours.module.parameters()}


#: Keys torch's DDP has that leanddp does not fill (torch's reducer internals).
_TORCH_ONLY = {"can_set_static_graph"}


def _logging(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 10, bias=False), nn.ReLU(), nn.Linear(10, 3, bias=False))
    pairs = [
        cls(copy_of(model), process_group=dist.new_group(), gradient_as_bucket_view=True)
        for cls in (TorchDDP, leanddp.DistributedDataParallel)
    ]
    for ddp in pairs:
        ddp._set_ddp_runtime_logging_sample_rate(3)
    for idx in range(16):
        x = torch.randn(4, 12)
        seen = []
        for ddp in pairs:
            ddp(x).sum().backward()
            seen.append(ddp._get_ddp_logging_data())
        theirs, ours = seen
        assert ours["iteration"] == theirs["iteration"], (idx, ours["iteration"])
        if idx > 0 and (idx <= 10 or idx % 3 == 0):
            assert ours["iteration"] == idx
            for key in ("forward_compute_time", "backward_compute_time", "backward_comm_time"):
                assert ours[key] >= 1, (key, ours)
            overlap = ours["backward_compute_comm_overlap_time"]
            assert overlap <= ours["backward_compute_time"]
            assert overlap <= ours["backward_comm_time"]
            starts = [ours[f"{k}_time_{e}"] for k, e in (
                ("forward_compute", "start"), ("backward_compute", "start"),
                ("backward_comm", "start"), ("backward_comm", "end"))]  # fmt: skip
            assert starts == sorted(starts), starts
            assert ours["backward_compute_time_end"] >= ours["backward_compute_time_start"]
    missing = set(theirs) - set(ours) - _TORCH_ONLY
    assert not missing, missing
    same = (
        "backend_name", "bucket_cap_bytes", "broadcast_buffers", "device_ids", "dtypes",
        "find_unused_parameters", "gradient_as_bucket_view", "iteration", "master_addr",
        "master_port", "module_name", "num_parameter_tensors", "output_device", "rank",
        "total_parameter_size_bytes", "world_size", "gloo_num_threads", "gloo_socket_ifname",
        "gloo_device_transport", "torch_distributed_debug", "cuda_visible_devices",
        "has_rebuilt_buckets", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices",
        "prev_iteration_grad_ready_order_indices", "static_graph", "join_uneven_inputs",
        "num_buckets_reduced", "unused_parameter_size",
    )  # fmt: skip
    for key in same:
        assert ours.get(key) == theirs.get(key), (key, ours.get(key), theirs.get(key))
    for key in ("forward_compute_time", "backward_compute_time", "backward_comm_time"):
        assert ours[f"avg_{key}"] >= 1, key


def copy_of(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


@pytest.mark.parametrize("body", [_errors, _grad_bucket, _logging])
def test_torch_api(body) -> None:
    run_ranks(2, body)


@pytest.mark.parametrize("kind", ["ALLREDUCE", "FP16_COMPRESS"])
def test_builtin_comm_hooks(kind: str) -> None:
    run_ranks(2, _builtin, kind)
