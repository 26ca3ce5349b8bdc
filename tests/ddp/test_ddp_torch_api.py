"""Where torch's API pins behaviour, leanddp behaves as torch's DDP, checked side by side in the
same processes: error types and words, communication-hook checks, built-in hooks, the
GradBucket a hook receives (and the buckets' order with mixed dtypes), ``_set_static_graph`` and
the logging data (``unused_parameter_size``, ``can_set_static_graph``, errors raised inside
backward).

(No ``from __future__ import annotations`` here: torch checks hooks' annotations as objects.)"""

import copy
import gc
import random

import pytest
import torch
import torch.distributed as dist
from ddp_models import Case, LockStep, Net, assert_same
from dist_harness import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.checkpoint import checkpoint

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
    missing = set(theirs) - set(ours)
    assert not missing, missing
    same = (
        "backend_name", "bucket_cap_bytes", "broadcast_buffers", "device_ids", "dtypes",
        "find_unused_parameters", "gradient_as_bucket_view", "iteration", "master_addr",
        "master_port", "module_name", "num_parameter_tensors", "output_device", "rank",
        "total_parameter_size_bytes", "world_size", "gloo_num_threads", "gloo_socket_ifname",
        "gloo_device_transport", "torch_distributed_debug", "cuda_visible_devices",
        "has_rebuilt_buckets", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices",
        "prev_iteration_grad_ready_order_indices", "static_graph", "join_uneven_inputs",
        "num_buckets_reduced", "unused_parameter_size", "can_set_static_graph",
    )  # fmt: skip
    for key in same:
        assert ours.get(key) == theirs.get(key), (key, ours.get(key), theirs.get(key))
    for key in ("forward_compute_time", "backward_compute_time", "backward_comm_time"):
        assert ours[f"avg_{key}"] >= 1, key


def copy_of(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def _hook_returns_tensor(state: object, bucket: dist.GradBucket):  # (torch checks annotations)
    return bucket.buffer()


def _hook_not_future(rank: int, world_size: int) -> None:
    """A hook that returns a tensor: torch's RuntimeError and words, raised from backward (the
    forward runs), and not recorded in the logging data (torch records its reducer's checks,
    not what a hook does)."""
    for cls in (TorchDDP, leanddp.DistributedDataParallel):
        ddp = cls(nn.Linear(4, 4), process_group=dist.new_group())
        ddp.register_comm_hook(None, _hook_returns_tensor)
        loss = ddp(torch.randn(2, 4)).sum()
        with pytest.raises(
            RuntimeError,
            match="DDP communication hook's callback must return a torch.futures.Future object, "
            "but got torch.Tensor",
        ):
            loss.backward()
        assert "has_error" not in ddp._get_ddp_logging_data(), cls


class _Branches(nn.Module):
    """A trunk and two branches (40 and 48 bytes of parameters); ``use`` names the branches the
    next forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.left = nn.Linear(4, 2)
        self.right = nn.Linear(4, 3, bias=False)
        self.use: tuple[str, ...] = ("left", "right")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        for name in self.use:
            h = h + getattr(self, name)(x).sum()
        return h


#: Per step: the branches used, and whether the step is a no_sync() micro-batch.
_SCHEDULE = [
    ((), False), ((), False), (("left",), True), (("left",), False), (("right",), False),
    ((), False), (("left", "right"), False), (("right",), False), ((), False), ((), False),
    (("left",), False), (("left",), False), (("right",), False), ((), False), ((), False),
]  # fmt: skip

#: The logging data's keys that the schedule moves.
_TRACKED = ("iteration", "unused_parameter_size", "can_set_static_graph", "has_error")


def _side_by_side(schedule: list, sample_rate: int = 1, **kwargs) -> list[tuple[dict, dict]]:
    """Runs ``schedule`` through torch's DDP and leanddp's over copies of one ``_Branches``
    (their own process groups); returns both logging data after each step."""
    model = _Branches()
    pairs = []
    for cls in (TorchDDP, leanddp.DistributedDataParallel):
        pairs.append(cls(copy.deepcopy(model), process_group=dist.new_group(), **kwargs))
        pairs[-1]._set_ddp_runtime_logging_sample_rate(sample_rate)
    seen = []
    for use, micro in schedule:
        x = torch.randn(2, 4)
        for ddp in pairs:
            ddp.module.use = use
            if micro:
                with ddp.no_sync():
                    ddp(x).sum().backward()
            else:
                ddp(x).sum().backward()
        seen.append(
            tuple({k: ddp._get_ddp_logging_data().get(k) for k in _TRACKED} for ddp in pairs)
        )
    return seen


def _assert_same_logs(seen: list[tuple[dict, dict]], what: str) -> None:
    for step, (theirs, ours) in enumerate(seen):
        assert ours == theirs, f"{what}, step {step}: torch's {theirs}, leanddp's {ours}"


def _unused_and_static(rank: int, world_size: int) -> None:
    """unused_parameter_size: the parameters found unused by the last synchronized forward,
    summed afresh at each sampled iteration (no_sync forwards do not search), with a static graph
    from the end of its first iteration; can_set_static_graph: logged (0) by the first wrapper
    of the process whose set of unused parameters changes after its first iteration, with the
    iteration it changed in, and never again in that process."""
    first = _side_by_side(_SCHEDULE, sample_rate=3, find_unused_parameters=True)
    _assert_same_logs(first, "find_unused_parameters, unused set changing")
    ours = [o for _, o in first]
    assert {o["unused_parameter_size"] for o in ours} >= {0, 40, 48, 88}, ours
    assert ours[-1]["can_set_static_graph"] == 0, ours[-1]
    second = _side_by_side(_SCHEDULE[:6], find_unused_parameters=True)
    _assert_same_logs(second, "a second wrapper in the process")
    assert all(o["can_set_static_graph"] is None for _, o in second)
    _assert_same_logs(_side_by_side([((), False)] * 4, static_graph=True), "static graph")
    every = [(("left", "right"), False)] * 3
    _assert_same_logs(_side_by_side(every), "every parameter used, no search")


def _destroyed_first(rank: int, world_size: int) -> None:
    """A wrapper destroyed first uses up the process's can_set_static_graph (torch's Logger
    logs it as it is destroyed): a later wrapper's changing graph is not logged."""
    _side_by_side(_SCHEDULE[:2], find_unused_parameters=True)  # (its wrappers die on return)
    gc.collect()
    later = _side_by_side(_SCHEDULE[:6], find_unused_parameters=True)
    _assert_same_logs(later, "after a wrapper was destroyed")
    assert all(o["can_set_static_graph"] is None for _, o in later)


class _Reentrant(_Branches):
    """``_Branches`` whose ``use`` may also be "twice": the trunk run twice under reentrant
    checkpointing, so its gradient accumulator fires twice in one backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use == ("twice",):
            trunk = self.trunk
            return checkpoint(trunk, x, use_reentrant=True) + checkpoint(
                trunk, x + 1, use_reentrant=True
            )
        return super().forward(x)


def _backward_error(ddp: nn.Module, uses: list[tuple[str, ...]]) -> tuple[int, RuntimeError]:
    """Runs ``uses`` until one raises; returns the step and the error."""
    for step, use in enumerate(uses):
        ddp.module.use = use
        try:
            ddp(torch.randn(2, 4, requires_grad=True)).sum().backward()
        except RuntimeError as e:
            return step, e
    raise AssertionError(f"{type(ddp).__name__}: nothing raised")


def _errors_in_backward(rank: int, world_size: int) -> None:
    """The reducer's checks that fail inside backward are recorded as torch records them
    (has_error, the message alone as error, the iteration it was raised in): a gradient twice
    in one backward, a static graph whose parameters change, a parameter without a gradient
    (torch raises at the next forward, leanddp at the end of that backward: each records what
    it raises). An error raised later replaces it, whether the data was read in between or not."""
    all_used = ("left", "right")
    cases = [
        (dict(find_unused_parameters=True), [all_used, ("twice",)]),
        (dict(static_graph=True), [("left",), ("left",), all_used]),
        ({}, [all_used, ("left",), all_used]),
    ]
    for kwargs, uses in cases:
        for cls in (TorchDDP, leanddp.DistributedDataParallel):
            ddp = cls(_Reentrant(), process_group=dist.new_group(), **kwargs)
            step, error = _backward_error(ddp, uses)
            data = ddp._get_ddp_logging_data()
            assert data.get("has_error") == 1 and data["error"] in str(error), (cls, data)
            assert data["iteration"] == step + 1, (cls, step, data)
            with pytest.raises(ValueError, match="equal or greater than 1"):
                ddp._set_ddp_runtime_logging_sample_rate(0)
            assert "equal or greater than 1" in ddp._get_ddp_logging_data()["error"]
    for cls in (TorchDDP, leanddp.DistributedDataParallel):
        ddp = cls(_Reentrant(), process_group=dist.new_group(), **cases[0][0])
        _backward_error(ddp, cases[0][1])
        with pytest.raises(ValueError, match="equal or greater than 1"):
            ddp._set_ddp_runtime_logging_sample_rate(0)
        assert "equal or greater than 1" in ddp._get_ddp_logging_data()["error"], cls


class _Mixed(nn.Module):
    """Linear layers alternating float32 and float64."""

    def __init__(self) -> None:
        super().__init__()
        dtypes = [torch.float32, torch.float64, torch.float32, torch.float64, torch.float32]
        self.layers = nn.ModuleList(nn.Linear(8, 8).to(dtype) for dtype in dtypes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x.to(layer.weight.dtype))
        return x.float()


def _recorder(seen: list):
    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.append((bucket.index(), [(tuple(p.shape), p.dtype) for p in bucket.parameters()]))
        return default_hooks.allreduce_hook(state, bucket)

    return hook


def _mixed_dtype_buckets(rank: int, world_size: int) -> None:
    """float32 and float64 parameters: the same buckets as torch's, launched in the same order,
    before and after the rebuild (whose buckets left open come in torch's order, the dtype its
    gradients reached last first), and the same rebuilt layout in the logging data."""
    model = _Mixed()
    runs = []
    for cls in (TorchDDP, leanddp.DistributedDataParallel):
        ddp = cls(copy.deepcopy(model), process_group=dist.new_group())
        seen: list = []
        ddp.register_comm_hook(ddp.process_group, _recorder(seen))
        for _ in range(3):
            ddp(torch.randn(2, 8)).sum().backward()
        ddp(torch.randn(2, 8))  # logs the rebuilt layout
        data = ddp._get_ddp_logging_data()
        runs.append((seen, data["rebuilt_bucket_sizes"], data["rebuilt_per_bucket_param_indices"]))
    assert runs[0] == runs[1], runs


def test_bucket_assignment_is_torchs() -> None:
    """leanddp's bucket assignment from an observed order is torch's (its rebuild's
    ``compute_bucket_assignment_by_size`` with ``tensor_indices``), for random dtypes, sizes
    and caps."""
    rng = random.Random(0)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64]
    for _ in range(300):
        kinds = rng.sample(dtypes, rng.randint(1, len(dtypes)))
        params = [torch.empty(rng.randint(1, 40), dtype=rng.choice(kinds)) for _ in range(12)]
        order = list(range(len(params)))
        rng.shuffle(order)
        caps = [rng.choice([16, 64, 256, 4096]) for _ in range(rng.randint(1, 3))]
        theirs, _ = dist._compute_bucket_assignment_by_size(
            [params[i] for i in order], caps, [False] * len(params), order
        )
        assert leanddp._C.assign_buckets(params, order, caps) == theirs, (order, caps)


@pytest.mark.parametrize(
    "body",
    [
        _errors,
        _grad_bucket,
        _logging,
        _hook_not_future,
        _unused_and_static,
        _destroyed_first,
        _errors_in_backward,
        _mixed_dtype_buckets,
    ],
)
def test_torch_api(body) -> None:
    run_ranks(2, body)


@pytest.mark.parametrize("kind", ["ALLREDUCE", "FP16_COMPRESS"])
def test_builtin_comm_hooks(kind: str) -> None:
    run_ranks(2, _builtin, kind)
