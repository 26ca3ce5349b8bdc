"""What only a GPU shows, where the host runs ahead of the device: in-backward steps ordered on a
side stream keep gradient memory bounded by the window, with a comm hook and across iterations
never synchronized; a comm hook's collectives overlap backward two at a time; the modes that step
at the end of backward pile up neither in-flight buckets nor CUDA events, and events are pooled;
the training loop's hot path never synchronizes the host with the device; offload_to_cpu pins
only its staging buffers and refuses a learning rate on the GPU, which its host steps could not
read without synchronizing. Parity with torch's DDP on a GPU: test_cuda_ddp_parity.py.

Run by benchmarks/gpu/run.sh (tests and compute-sanitizer); skipped where no GPU is visible.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_models import BATCH, Net, net_inputs
from dist_harness import run_ranks
from in_backward_models import Deep
from seam import events_created
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import leanddp
from leanddp._extension import _C

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")

_WIDTH = 1024
_BATCH = 64
_LAYER = _WIDTH * _WIDTH * 4  # one bucket per layer of Deep(_WIDTH)
#: What one backward may hold: the window's released buckets, the bucket being filled and the
#: gradient being copied into it, activations (three per layer, generously), 1 MiB.
_BOUND = (_C.BUCKETS_IN_FLIGHT + 2) * _LAYER + 12 * _BATCH * _WIDTH * 4 * 3 + 2**20
_SLEEP = 200_000_000  # GPU cycles (~0.1 s): the host runs far ahead of the device
_HOOKS = [None, default_hooks.allreduce_hook]


def _hook_id(hook) -> str:
    return "builtin" if hook is None else hook.__name__


def _sleep_in_backward(grad: torch.Tensor) -> torch.Tensor:
    torch.cuda._sleep(_SLEEP // 2)
    return grad


class _SlowDeep(Deep):
    """Deep that keeps the GPU busy at the start of each forward, and in backward before the
    gradients of its first two layers: their buckets (the last two) are reduced and stepped
    after that wait, so they are still queued on the device when backward returns."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(_SLEEP // 2)
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1 and x.requires_grad:
                x.register_hook(_sleep_in_backward)
        return x


def _deep_ddp(hook, slow: bool = False):
    """(Deep(_WIDTH) or _SlowDeep wrapped with a bucket per layer, fused AdamW inside backward and
    ``hook`` as its comm hook; an input). Past the bucket rebuild and the state's creation."""
    model = (_SlowDeep if slow else Deep)(_WIDTH).cuda()
    ddp = leanddp.DistributedDataParallel(
        model,
        device_ids=[0],
        bucket_cap_mb=_LAYER / 2**20,
        optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3, fused=True),
    )
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    x = torch.randn(_BATCH, _WIDTH, device="cuda")
    for _ in range(3):
        ddp(x).square().mean().backward()
    return ddp, x


def _idle() -> tuple[int, int]:
    """Waits for the device and for the caching allocator to take back what the streams are
    done with; resets the peaks. Returns the (active, allocated) bytes now."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # (also processes the events of blocks freed on other streams)
    torch.cuda.reset_peak_memory_stats()
    stats = torch.cuda.memory_stats()
    return stats["active_bytes.all.current"], stats["allocated_bytes.all.current"]


def _peaks(ddp, start: tuple[int, int], what: str) -> int:
    """Checks the peaks since ``_idle()`` returned ``start`` against the window: "active" bytes
    count a freed block until the streams it was recorded on are past it (the device's
    footprint; allocated bytes drop at the free, before the side stream's step has run), and
    the Reducer's own count of the last backward. Returns the active peak."""
    torch.cuda.synchronize()
    active = torch.cuda.memory_stats()["active_bytes.all.peak"] - start[0]
    allocated = torch.cuda.max_memory_allocated() - start[1]
    stats = ddp.memory_stats()
    info = (what, active / _LAYER, allocated / _LAYER, _BOUND / _LAYER, stats)
    assert active <= _BOUND and allocated <= _BOUND, info
    assert stats["peak_bucket_bytes"] <= (_C.BUCKETS_IN_FLIGHT + 1) * _LAYER, info
    assert stats["max_buckets_in_flight"] <= _C.BUCKETS_IN_FLIGHT, info
    assert all(p.grad is None for p in ddp.module.parameters()), what
    return active


def _memory(rank: int, world_size: int, hook) -> None:
    """The host runs ahead of the GPU (a slow kernel queued first): gradient memory during
    backward stays within the window, not every bucket (as when steps waited for the host to see
    reductions complete), with a comm hook too (its future waited for on the side stream; a
    hook whose buckets were stepped only at the end of backward would hold them all)."""
    ddp, x = _deep_ddp(hook)
    for i in range(3):
        start = _idle()
        torch.cuda._sleep(_SLEEP)  # the GPU is busy for a while: the host runs far ahead
        ddp(x).square().mean().backward()
        _peaks(ddp, start, f"{_hook_id(hook)} iteration {i}")


@pytest.mark.parametrize("hook", _HOOKS, ids=_hook_id)
def test_gradient_memory_bounded_while_the_host_runs_ahead(hook) -> None:
    run_ranks(1, _memory, hook, backend="nccl")


def _memory_across_iterations(rank: int, world_size: int, hook) -> None:
    """Iterations with no synchronization between them, the GPU slowed in every forward and
    backward: each backward returns with its last two buckets' steps still queued on the device,
    and the host runs into the next backward, whose buckets cannot reuse that memory yet. The
    window must count them: the peak over the whole run stays that of one backward started
    from an idle device (a window that starts empty at every backward holds two more buckets).
    max_memory_allocated alone cannot see this (a block freed on the host no longer counts
    though the side stream still uses it): "active" bytes do."""
    ddp, x = _deep_ddp(hook, slow=True)
    start = _idle()
    ddp(x).square().mean().backward()
    one = _peaks(ddp, start, "one backward")
    start = _idle()
    behind = []
    for _ in range(4):
        ddp(x).square().mean().backward()
        behind.append(not torch.cuda.current_stream().query())  # (a query, not a wait)
    many = _peaks(ddp, start, f"{_hook_id(hook)}: 4 iterations")
    assert all(behind), "the device kept up: this test would not see the previous steps"
    assert many <= one + _LAYER // 2, (many / _LAYER, one / _LAYER)


@pytest.mark.parametrize("hook", _HOOKS, ids=_hook_id)
def test_gradient_memory_bounded_across_unsynchronized_iterations(hook) -> None:
    run_ranks(1, _memory_across_iterations, hook, backend="nccl")


def _hook_overlap(rank: int, world_size: int) -> None:
    """torch's allreduce_hook on NCCL, the GPU slowed so that the host runs ahead: a bucket's
    storage comes from the recycler, but never that of the bucket launched just before it while
    that bucket's step is not known finished (its collective would then be waited for by the
    compute stream): two collectives overlap backward, not one."""
    ddp, x = _deep_ddp(default_hooks.allreduce_hook, slow=True)
    for i in range(3):
        ddp(x).square().mean().backward()
        reuses = ddp.reducer._recycler_reuses()
        what = f"iteration {i}: (bucket, reused bucket, waits) {reuses}"
        assert len(reuses) >= len(ddp.module.layers) - 3, what  # (at most 3 buffers new)
        assert all(not waits or bucket - giver >= 2 for bucket, giver, waits in reuses), what
        assert ddp.memory_stats()["max_buckets_in_flight"] <= _C.BUCKETS_IN_FLIGHT, what


def test_cuda_comm_hook_overlaps_two_collectives() -> None:
    run_ranks(1, _hook_overlap, backend="nccl")


def _end_of_backward(rank: int, world_size: int) -> None:
    """The modes that step every bucket at the end of backward (unused parameters searched for,
    the strict NaN check, sharded clipping): over 20 iterations, no new CUDA event after the
    first few and never more buckets in flight than there are buckets."""
    modes = {
        "find_unused_parameters": dict(find_unused_parameters=True),
        "strict": dict(check_for_nan_in_grad="strict"),
        "sharded clipped": dict(shard_optimizer_state=True, max_grad_norm=1.0),
    }
    for name, kwargs in modes.items():
        ddp = leanddp.DistributedDataParallel(
            Net(unused=name == "find_unused_parameters", rank=rank, f64=False).cuda(),
            device_ids=[0], bucket_cap_mb=0.0005,
            optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3), **kwargs,
        )  # fmt: skip
        created = []
        for _ in range(20):
            ddp(net_inputs(1, "cuda")[0]).square().mean().backward()
            stats = ddp.memory_stats()
            assert stats["max_buckets_in_flight"] <= stats["num_buckets"], (name, stats)
            created.append(events_created(ddp))
        assert len(set(created[3:])) == 1, (name, created)


def test_cuda_end_of_backward_steps_do_not_pile_up() -> None:
    run_ranks(1, _end_of_backward, backend="nccl")


def _sync_free(rank: int, world_size: int, config: str) -> None:
    """Training steps under torch.cuda.set_sync_debug_mode("error"): any host synchronization
    on leanddp's hot path (forward glue, hooks, launches, in-backward steps, offload copies)
    raises. Each configuration with one micro-batch per step and with two (the first under
    no_sync), with the built-in reduction and with torch's allreduce_hook (not "sharded", which
    refuses hooks). With check_for_nan_in_grad ("nan_check"), exactly one synchronization per
    synchronized backward: the read of the check's device flags at its end, with offload_to_cpu
    too ("offload_nan_check": the flags set on its device-to-host stream). "fp16_scaler":
    fp16 parameters stepped by the fused kernels under a GradScaler, with a tensor lr.
    "sharded": shard_optimizer_state (reduce-scatter, step, all-gather, all ordered on the side
    stream)."""
    hooks = [None] if config == "sharded" else _HOOKS
    for accum, hook in itertools.product((1, 2), hooks):
        _sync_free_steps(rank, config, accum, hook)


def _sync_free_steps(rank: int, config: str, accum: int, hook) -> None:
    what = f"{config} accum={accum} hook={_hook_id(hook)}"
    fused = config in ("in_backward", "fp16_scaler", "sharded")  # nan_check: counts on the host
    lr = torch.tensor(1e-3, device="cuda") if config == "fp16_scaler" else 1e-3
    factory = functools.partial(torch.optim.AdamW, lr=lr, fused=fused)
    kwargs = dict(device_ids=[0], bucket_cap_mb=0.0005)
    if config != "views":
        kwargs["optimizer_in_backward"] = factory
    if config in ("offload", "offload_nan_check"):
        kwargs["offload_to_cpu"] = True
    if config == "sharded":
        kwargs["shard_optimizer_state"] = True
    if config in ("nan_check", "offload_nan_check"):
        kwargs["check_for_nan_in_grad"] = True
    model = Net(rank=rank, f64=False).cuda()
    scaler = None
    if config == "fp16_scaler":  # (Net's forward goes back to float32 after its float64 layer)
        model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 3)).cuda().half()
        scaler = kwargs["grad_scaler"] = torch.amp.GradScaler("cuda")
    ddp = leanddp.DistributedDataParallel(model, **kwargs)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    batches = [b.to(next(model.parameters()).dtype) for b in net_inputs(accum, "cuda")]

    def backward(x: torch.Tensor) -> None:
        loss = ddp(x).float().square().mean()
        (scaler.scale(loss) if scaler else loss).backward()

    def step() -> None:
        for x in batches[:-1]:
            with ddp.no_sync():
                backward(x)
        backward(batches[-1])
        if scaler:
            scaler.step(ddp.optimizer)
            scaler.update()
        if config == "views":
            for p in ddp.module.parameters():
                p.grad = None

    for _ in range(3):  # the bucket rebuild (a broadcast read on the host) happens here
        step()
    torch.cuda.synchronize()
    expected = 3 if config.endswith("nan_check") else 0
    torch.cuda.set_sync_debug_mode("error" if expected == 0 else "warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == expected, (what, [str(w.message) for w in syncs])
    if config == "fp16_scaler":
        assert ddp._in_backward.fallback.calls == 0, what


@pytest.mark.parametrize(
    "config",
    ["views", "in_backward", "offload", "nan_check", "offload_nan_check", "fp16_scaler", "sharded"],
)
def test_no_host_synchronization_per_iteration(config: str) -> None:
    run_ranks(1, _sync_free, config, backend="nccl")


def _pinned_staging_only(rank: int, world_size: int) -> None:
    """offload_to_cpu pins only what crosses PCIe: the gradient and weight staging buffers. The
    optimizer state and bfloat16 parameters' float32 masters are ordinary host memory."""
    for dtype in (torch.float32, torch.bfloat16):
        ddp = leanddp.DistributedDataParallel(
            Net(rank=rank, f64=False).to("cuda", dtype),
            device_ids=[0],
            optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3),
            offload_to_cpu=True,
        )
        for _ in range(2):
            ddp(torch.randn(BATCH, 12, device="cuda", dtype=dtype)).float().sum().backward()
        ddp.synchronize()
        stats = ddp.memory_stats()
        if dtype == torch.float32:  # the float32 masters are the copy-back staging buffer
            staging = stats["host_master_bytes"] + stats["host_buffer_bytes"]
        else:
            staging = stats["host_buffer_bytes"]
        assert stats["host_pinned_bytes"] == staging > 0, (dtype, stats)
        for entry in ddp.optimizer.state.values():  # state, and bfloat16's master_weight
            for key, value in entry.items():
                assert value.device.type != "cpu" or not value.is_pinned(), (dtype, key)


def test_offload_pins_only_staging_buffers() -> None:
    run_ranks(1, _pinned_staging_only, backend="nccl")


def _offload_gpu_lr(rank: int, world_size: int) -> None:
    """offload_to_cpu's host steps read the learning rate in host memory: a tensor lr on the
    GPU (which they could read only by synchronizing at every forward) is refused at
    construction, naming lr."""
    lr = torch.tensor(1e-3, device="cuda")
    with pytest.raises(ValueError, match="tensor lr must be on the CPU"):
        leanddp.DistributedDataParallel(
            Net(rank=rank, f64=False).cuda(),
            optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=lr),
            offload_to_cpu=True,
        )


def test_offload_refuses_a_gpu_tensor_lr() -> None:
    run_ranks(1, _offload_gpu_lr, backend="nccl")


@pytest.mark.parametrize("offload", [False, True], ids=["in_backward", "offload_accumulating"])
def test_events_are_pooled(offload: bool) -> None:
    """Steps and copies reuse a bounded set of CUDA events, not one per bucket per iteration;
    with offload_to_cpu and accumulation, the host accumulator's copies too (counted with the
    rest)."""
    run_ranks(1, _events, offload, backend="nccl")


def _events(rank: int, world_size: int, offload: bool) -> None:
    ddp = leanddp.DistributedDataParallel(
        Net(rank=rank, f64=False).cuda(),
        device_ids=[0],
        bucket_cap_mb=0.0005,
        optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3),
        offload_to_cpu=offload,
    )

    def step() -> None:
        if offload:  # a no_sync() micro-batch first: the accumulator's copies and events
            with ddp.no_sync():
                ddp(net_inputs(1, "cuda")[0]).square().mean().backward()
        ddp(net_inputs(1, "cuda")[0]).square().mean().backward()

    for _ in range(3):
        step()
    created = events_created(ddp)
    if offload:
        ddp.synchronize()
        assert created > 0, "the offload copies recorded no event"
    for _ in range(5):
        step()
    assert events_created(ddp) == created, "new events were created per iteration"
    assert dist.get_world_size() == 1
