"""leanddp on a GPU, against torch's DDP (+ the same torch optimizer) in the same processes: NCCL
at world size 1, and two gloo ranks sharing GPU 0. Also what only a GPU shows: in-backward steps
ordered on a side stream keep gradient memory bounded by the window while the host runs ahead,
and the training loop's hot path never synchronizes the host with the device.

Run by benchmarks/gpu/run.sh (tests and compute-sanitizer); skipped where no GPU is visible.
"""

from __future__ import annotations

import copy
import functools
import itertools
import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_models import Case, LockStep, Net, accumulate, assert_same
from dist_harness import run_ranks
from in_backward_models import OPTIMIZERS, Deep, InBackwardLockStep, assert_params_close
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import leanddp
from leanddp._extension import _C

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")

STEPS = 4
BATCH = 6


def _batches(n: int) -> list[torch.Tensor]:
    return [torch.randn(BATCH, 12, device="cuda") for _ in range(n)]


def _views(rank: int, world_size: int) -> None:
    """Gradient views and no_sync accumulation: gradients after every step (within 1e-5: GPU
    kernels may reduce with atomics, so bitwise equality is claimed on the CPU only)."""
    for accum, tiny in itertools.product((1, 3), (False, True)):
        case = Case(accum=accum, tiny_buckets=tiny, optimizer="adamw")
        run = LockStep(Net(rank=rank, f64=False).cuda(), case)
        for step in range(STEPS):
            run.backward(_batches(accum))
            for name, a, b in run.pairs():
                assert_same(a.grad, b.grad, f"{case} step {step} {name}.grad", exact=False)
            run.step()


def _in_backward(rank: int, world_size: int) -> None:
    """optimizer_in_backward: fused AdamW/SGD, the Python fallback, accumulation, tiny buckets."""
    for name, accum, tiny in itertools.product(
        ("adamw", "sgd-nesterov", "adagrad"), (1, 3), (False, True)
    ):
        cap = 0.0005 if tiny else None
        run = InBackwardLockStep(
            Net(rank=rank, f64=False).cuda(), OPTIMIZERS[name], bucket_cap_mb=cap
        )
        for step in range(STEPS):
            run.step(_batches(accum), legacy_calls=step % 2 == 1)
            assert_params_close(run, f"cuda {name} accum={accum} tiny={tiny} step {step}")
        assert run.ours.memory_stats()["max_buckets_in_flight"] <= _C.BUCKETS_IN_FLIGHT


def _sharded(rank: int, world_size: int) -> None:
    """shard_optimizer_state on the device and with offload_to_cpu: parameters within 1e-5 of
    torch's after every step, and the gathered state torch's optimizer's."""
    cases = itertools.product(("adamw", "sgd-nesterov"), (1, 3), (False, True), (False, True))
    for name, accum, tiny, offload in cases:
        run = InBackwardLockStep(
            Net(rank=rank, f64=False).cuda(),
            OPTIMIZERS[name],
            offload=offload,
            bucket_cap_mb=0.0005 if tiny else None,
            ours_kwargs=dict(shard_optimizer_state=True),
        )
        what = f"cuda sharded {name} accum={accum} tiny={tiny} offload={offload}"
        for step in range(STEPS):
            run.step(_batches(accum), legacy_calls=step % 2 == 1)
            assert_params_close(run, f"{what} step {step}")
        saved = run.ours.optimizer.state_dict()["state"]
        for index, entry in run.ref_opt.state_dict()["state"].items():
            for key, value in entry.items():
                ours = saved[index][key].to(value.device)
                torch.testing.assert_close(ours, value, rtol=1e-5, atol=1e-6, msg=what)


def _with_hooks(rank: int, world_size: int) -> None:
    """A communication hook with optimizer_in_backward (its future is waited for on the side
    stream), against torch's DDP with the same hook + the same optimizer."""
    hooks = (default_hooks.allreduce_hook, default_hooks.bf16_compress_hook)
    for hook, accum in itertools.product(hooks, (1, 2)):
        run = InBackwardLockStep(
            Net(rank=rank, f64=False).cuda(), OPTIMIZERS["adamw"], bucket_cap_mb=0.0005
        )
        run.ref.register_comm_hook(None, hook)
        run.ours.register_comm_hook(None, hook)
        for step in range(STEPS):
            run.step(_batches(accum))
            assert_params_close(run, f"{hook.__name__} accum={accum} step {step}")


def _nan_checked_pair(rank: int, factory, check: bool | str):
    """torch's DDP + ``factory``'s optimizer, and leanddp stepping with ``factory`` inside
    backward under ``check_for_nan_in_grad=check``, from the same weights, tiny buckets."""
    model = Net(rank=rank, f64=False).cuda()
    ref = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), process_group=dist.new_group(), bucket_cap_mb=0.0005
    )
    ours = leanddp.DistributedDataParallel(
        copy.deepcopy(model),
        process_group=dist.new_group(),
        bucket_cap_mb=0.0005,
        optimizer_in_backward=factory,
        check_for_nan_in_grad=check,
    )
    return ref, factory(ref.module.parameters()), ours


def _strict(rank: int, world_size: int) -> None:
    """check_for_nan_in_grad="strict": every bucket is collected on the caller's stream at the
    end of backward, checked, then stepped on the side stream, which must follow that stream."""
    ref, ref_opt, ours = _nan_checked_pair(rank, OPTIMIZERS["adamw"], "strict")
    for step in range(STEPS):
        batches = _batches(2)
        accumulate(ref, batches)
        ref_opt.step()
        ref_opt.zero_grad()
        accumulate(ours, batches)
        for (name, a), b in zip(
            ref.module.named_parameters(), ours.module.parameters(), strict=True
        ):
            torch.testing.assert_close(
                b, a, rtol=1e-5, atol=1e-6, msg=lambda m, n=f"{step} {name}": f"{n}: {m}"
            )


def _nan_on_the_device(rank: int, world_size: int) -> None:
    """check_for_nan_in_grad with in-backward steps on the device: a NaN in every bucket skips
    every step (the kernels read the check's flag; the host reads it once, at the end), Adam's
    step counts are taken back (on the device for fused AdamW, on the host for the plain one),
    and training goes on equal to torch's DDP + AdamW that never saw that batch."""
    for fused in (False, True):
        factory = functools.partial(torch.optim.AdamW, lr=1e-2, fused=fused)
        ref, ref_opt, ours = _nan_checked_pair(rank, factory, True)
        for step in range(STEPS):
            x = _batches(1)[0]
            if step == 1:
                before = [p.detach().clone() for p in ours.module.parameters()]
                with pytest.raises(RuntimeError, match="check_for_nan_in_grad"):
                    (ours(x).square().mean() * float("nan")).backward()
                for p, b in zip(ours.module.parameters(), before, strict=True):
                    assert torch.equal(p, b), f"fused={fused}: a NaN step changed a weight"
                continue
            ref(x).square().mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ours(x).square().mean().backward()
            pairs = zip(ref.module.named_parameters(), ours.module.parameters(), strict=True)
            for (name, a), b in pairs:
                torch.testing.assert_close(
                    b,
                    a,
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, n=f"{fused} {step} {name}": f"{n}: {m}",
                )
                count, expected = ours.optimizer.state[b]["step"], ref_opt.state[a]["step"]
                assert float(count) == float(expected), f"fused={fused} {name}: step {count}"


@pytest.mark.parametrize(
    "body",
    [_views, _in_backward, _with_hooks, _strict, _nan_on_the_device, _sharded],
    ids=lambda f: f.__name__,
)
def test_nccl_world_size_1(body) -> None:
    run_ranks(1, body, backend="nccl")


@pytest.mark.parametrize("body", [_views, _in_backward, _sharded], ids=lambda f: f.__name__)
def test_two_gloo_ranks_sharing_the_gpu(body) -> None:
    run_ranks(2, body)


_WIDTH = 1024
_LAYER = _WIDTH * _WIDTH * 4  # one bucket per layer of Deep(_WIDTH)


def _memory(rank: int, world_size: int) -> None:
    """The host runs ahead of the GPU (a slow kernel queued first): gradient memory during
    backward stays within the window, not every bucket (as when steps waited for the host to see
    reductions complete)."""
    model = Deep(_WIDTH).cuda()
    ddp = leanddp.DistributedDataParallel(
        model,
        device_ids=[0],
        bucket_cap_mb=_LAYER / 2**20,
        optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3, fused=True),
    )
    x = torch.randn(64, _WIDTH, device="cuda")
    for _ in range(3):  # rebuild the buckets, create the optimizer state
        ddp(x).square().mean().backward()
    torch.cuda.synchronize()
    for _ in range(3):
        # "active" bytes count a freed block until the streams it was recorded on are past it
        # (allocated bytes drop at the free, before the side stream's step has run)
        start = torch.cuda.memory_stats()["active_bytes.all.current"]
        torch.cuda.reset_peak_memory_stats()
        torch.cuda._sleep(200_000_000)  # the GPU is busy for a while: the host runs far ahead
        ddp(x).square().mean().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.memory_stats()["active_bytes.all.peak"] - start
        activations = 12 * 64 * _WIDTH * 4 * 3
        # the window's released buckets, the bucket being filled and its gradients, activations
        bound = (_C.BUCKETS_IN_FLIGHT + 2) * _LAYER + activations + 2**20
        assert peak <= bound, (peak / _LAYER, bound / _LAYER, ddp.memory_stats())
        assert all(p.grad is None for p in model.parameters())


def test_gradient_memory_bounded_while_the_host_runs_ahead() -> None:
    run_ranks(1, _memory, backend="nccl")


def _sync_free(rank: int, world_size: int, config: str) -> None:
    """Training steps under torch.cuda.set_sync_debug_mode("error"): any host synchronization
    on leanddp's hot path (forward glue, hooks, launches, in-backward steps, offload copies)
    raises. With check_for_nan_in_grad ("nan_check"), exactly one per synchronized backward:
    the read of the check's device flags at its end. "fp16_scaler": fp16 parameters stepped by
    the fused kernels under a GradScaler, with a tensor lr. "sharded": shard_optimizer_state
    (reduce-scatter, step, all-gather, all ordered on the side stream)."""
    fused = config in ("in_backward", "fp16_scaler", "sharded")  # nan_check: counts on the host
    lr = torch.tensor(1e-3, device="cuda") if config == "fp16_scaler" else 1e-3
    factory = functools.partial(torch.optim.AdamW, lr=lr, fused=fused)
    kwargs = dict(device_ids=[0], bucket_cap_mb=0.0005)
    if config != "views":
        kwargs["optimizer_in_backward"] = factory
    if config == "offload":
        kwargs["offload_to_cpu"] = True
    if config == "sharded":
        kwargs["shard_optimizer_state"] = True
    if config == "nan_check":
        kwargs["check_for_nan_in_grad"] = True
    model = Net(rank=rank, f64=False).cuda()
    scaler = None
    if config == "fp16_scaler":
        model = model.half()
        scaler = kwargs["grad_scaler"] = torch.amp.GradScaler("cuda")
    ddp = leanddp.DistributedDataParallel(model, **kwargs)
    batches = [b.to(next(model.parameters()).dtype) for b in _batches(2)]

    def backward(x: torch.Tensor) -> None:
        loss = ddp(x).float().square().mean()
        (scaler.scale(loss) if scaler else loss).backward()

    def step() -> None:
        if scaler:
            scaler.step(ddp.optimizer)
            scaler.update()

    for _ in range(3):  # the bucket rebuild (a broadcast read on the host) happens here
        backward(batches[0])
        step()
    torch.cuda.synchronize()
    expected = 3 if config == "nan_check" else 0
    torch.cuda.set_sync_debug_mode("error" if expected == 0 else "warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with ddp.no_sync():
                    backward(batches[0])
                backward(batches[1])
                step()
                if config == "views":
                    for p in ddp.module.parameters():
                        p.grad = None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == expected, [str(w.message) for w in syncs]
    if config == "fp16_scaler":
        assert ddp._in_backward.fallback.calls == 0


@pytest.mark.parametrize(
    "config", ["views", "in_backward", "offload", "nan_check", "fp16_scaler", "sharded"]
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


def _tutorial_pattern(rank: int, world_size: int) -> None:
    """torch's DDP tutorial: ``model.to(rank)``, ``device_ids=[rank]``, no
    ``torch.cuda.set_device``; every rank keeps cuda:0 current. Trains equal to torch's DDP."""
    assert torch.cuda.current_device() == 0
    device = torch.device("cuda", rank)
    model = Net(rank=rank, f64=False).to(device)
    ref_model = copy.deepcopy(model)
    ours = leanddp.DistributedDataParallel(model, device_ids=[rank])
    ref = torch.nn.parallel.DistributedDataParallel(ref_model, device_ids=[rank])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    for step in range(STEPS):
        x = torch.randn(BATCH, 12, device=device)
        for ddp, opt in zip((ours, ref), opts, strict=True):
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        for (name, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            assert a.device == device
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_construction_without_set_device() -> None:
    run_ranks(2, _tutorial_pattern, backend="nccl", set_device=False)


def test_events_are_pooled() -> None:
    """Steps and copies reuse a bounded set of CUDA events, not one per bucket per iteration."""
    run_ranks(1, _events, backend="nccl")


def _events(rank: int, world_size: int) -> None:
    ddp = leanddp.DistributedDataParallel(
        Net(rank=rank, f64=False).cuda(),
        device_ids=[0],
        bucket_cap_mb=0.0005,
        optimizer_in_backward=functools.partial(torch.optim.AdamW, lr=1e-3),
    )
    for _ in range(3):
        ddp(_batches(1)[0]).square().mean().backward()
    created = ddp.reducer.events_created()
    for _ in range(5):
        ddp(_batches(1)[0]).square().mean().backward()
    assert ddp.reducer.events_created() == created, "new events were created per iteration"
    assert dist.get_world_size() == 1
