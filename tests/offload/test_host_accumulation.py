"""accumulate_on_host (offload_to_cpu's default): no_sync() micro-batches' gradients summed in
host memory, bucket by bucket, the device holding none of them between micro-batches.

Against torch's DDP + the same torch optimizer (fused AdamW on the CPU, which leanddp's host
kernel equals bit for bit) in the same processes, on random data: parameters equal bit for bit
after every step at accumulation 2, 4 and 8, with gradient views on and off, unused parameters
(find_unused_parameters), shard_optimizer_state, one-parameter buckets, and zero_grad() in the
middle of an accumulation. bfloat16 parameters: the host accumulates in bfloat16 (torch's
accumulation in the parameter's dtype): equal bit for bit to accumulating on the device.
Between micro-batches: no bucket, no gradient, and the sums on the host.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time

import pytest
import torch
import torch.distributed as dist
from ddp_models import Net
from dist_harness import run_ranks
from in_backward_models import OPTIMIZERS, InBackwardLockStep
from torch import nn

import leanddp

pytestmark = pytest.mark.leanddp_paths  # the host worker; CI's step 1 only (pyproject.toml)

BATCH = 6
STEPS = 3
#: seconds the host worker sleeps before each addition and step (the forward-wait test)
ADDITION_DELAY = 0.4


def _delay(ddp: leanddp.DistributedDataParallel, steps: float, additions: list[float]) -> None:
    """The host worker sleeps `steps` s before each host step and `additions[b]` s before each
    addition of bucket b (the test seams of the optimizer and of the Reducer's host sums)."""
    ddp._optimizer_core._delay_host_steps(steps)
    ddp.reducer._delay_additions(additions)


def _micro_batch(ddp: nn.Module, x: torch.Tensor, sync: bool) -> None:
    if sync:
        ddp(x).square().mean().backward()
        return
    with ddp.no_sync():
        ddp(x).square().mean().backward()


def _assert_device_holds_nothing(ddp: leanddp.DistributedDataParallel, what: str) -> None:
    for name, p in ddp.module.named_parameters():
        assert p.grad is None, f"{what}: {name} holds a gradient between micro-batches"
    stats = ddp.memory_stats()
    assert stats["bucket_bytes"] == 0 and stats["grad_bytes"] == 0, f"{what}: {stats}"
    assert stats["host_accumulation_bytes"] > 0, f"{what}: nothing summed on the host"


def _assert_equal(run: InBackwardLockStep, what: str) -> None:
    for name, a, b in run.pairs():
        assert torch.equal(a, b), f"{what} {name}: max diff {(a - b).abs().max().item()}"


def _train(run: InBackwardLockStep, what: str, accum: int, zero_at: int | None = None) -> None:
    for step in range(STEPS):
        for i in range(accum):
            x = torch.randn(BATCH, 12)
            for ddp in (run.ref, run.ours):
                _micro_batch(ddp, x, sync=i == accum - 1)
            if i < accum - 1:
                _assert_device_holds_nothing(run.ours, f"{what} step {step} micro-batch {i}")
            if i == zero_at:  # the micro-batches so far are dropped, as torch's zero_grad does
                run.ref_opt.zero_grad()
                (run.ours.optimizer if step % 2 else run.ours).zero_grad()
        run.ref_opt.step()
        run.ref_opt.zero_grad()
        for s in run.scheds:
            s.step()
        _assert_equal(run, f"{what} step {step}")
        assert run.ours.memory_stats()["bucket_bytes"] == 0, f"{what}: buckets not released"


def _parity(rank: int, world_size: int, shard: bool) -> None:
    cases = itertools.product((2, 4, 8), (True, False), (False, True), (False, True))
    for accum, views, unused, tiny in cases:
        what = f"accum={accum} views={views} unused={unused} tiny={tiny} shard={shard}"
        run = InBackwardLockStep(
            Net(unused=unused, rank=rank, f64=False),
            OPTIMIZERS["adamw"],
            offload=True,
            ours_kwargs=dict(shard_optimizer_state=shard),
            gradient_as_bucket_view=views,
            find_unused_parameters=unused,
            bucket_cap_mb=0.0005 if tiny else None,
        )
        assert run.ours._config.accumulate_on_host, "not the default with offload_to_cpu"
        _train(run, what, accum)


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_bitwise_parity_with_torch_ddp(shard: bool) -> None:
    run_ranks(2, _parity, shard)


def _zero_grad(rank: int, world_size: int) -> None:
    run = InBackwardLockStep(Net(rank=rank, f64=False), OPTIMIZERS["adamw"], offload=True)
    _train(run, "zero_grad after micro-batch 1", accum=4, zero_at=1)


def test_zero_grad_drops_the_host_sum() -> None:
    """zero_grad() (the wrapper's, and ddp.optimizer's) in the middle of an accumulation drops
    what the host summed so far, as torch's drops param.grad."""
    run_ranks(2, _zero_grad)


def _no_wait_for_the_sums(rank: int, world_size: int, shard: bool) -> None:
    run = InBackwardLockStep(
        Net(rank=rank, f64=False),
        OPTIMIZERS["adamw"],
        offload=True,
        ours_kwargs=dict(shard_optimizer_state=shard),
    )
    run.ours._optimizer_core._delay_host_steps(ADDITION_DELAY)  # each addition (and step) lags
    accum = 4
    for step in range(STEPS):
        for i in range(accum):
            x = torch.randn(BATCH, 12)
            _micro_batch(run.ref, x, sync=i == accum - 1)
            sync = contextlib.nullcontext() if i == accum - 1 else run.ours.no_sync()
            with sync:
                before = run.ours.offload_stats()["wait_seconds"]
                start = time.perf_counter()
                out = run.ours(x)
                took = time.perf_counter() - start
                waited = run.ours.offload_stats()["wait_seconds"] - before
                # the last micro-batch's sums are still being added (each addition sleeps first):
                # the forward reads none, and waits for none of them, counted or not
                what = f"step {step} micro-batch {i}: waited {waited} s, took {took} s"
                assert i == 0 or (waited == 0 and took < ADDITION_DELAY / 2), what
                out.square().mean().backward()
        run.ref_opt.step()
        run.ref_opt.zero_grad()
        _assert_equal(run, f"shard={shard} step {step}")
    run.ours._optimizer_core._delay_host_steps(0)


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_no_sync_forward_does_not_wait_for_the_host_sums(shard: bool) -> None:
    """The forward after a no_sync() micro-batch does not wait for the worker's additions of it
    (on a GPU that wait would also wait for the device to finish that backward); each bucket's
    next copy to the host waits for its own addition instead. Still bit for bit torch's."""
    run_ranks(2, _no_wait_for_the_sums, shard)


LONG = 0.5  # seconds the last bucket's addition of a no_sync() micro-batch takes
SHORT = 0.4  # seconds each job queued after it takes


def _own_addition_only(rank: int, world_size: int, sync: bool) -> None:
    run = InBackwardLockStep(  # (four buckets)
        Net(rank=rank, f64=False), OPTIMIZERS["adamw"], offload=True, bucket_cap_mb=0.0001
    )
    _train(run, "warmup", accum=2)
    reducer = run.ours.reducer
    n = len(reducer.bucket_indices())
    assert n >= 4, f"{n} buckets: no job queued between the last one's and its next use"
    for step in range(STEPS):
        x, y = torch.randn(BATCH, 12), torch.randn(BATCH, 12)
        # the last bucket's sum of micro-batch x is still being added (LONG) when micro-batch y
        # reaches that bucket; the jobs queued behind it meanwhile each take SHORT: the host
        # steps of y's other buckets (sync), or their additions of y (not sync)
        _delay(run.ours, 0, [0.0] * (n - 1) + [LONG])
        for ddp in (run.ref, run.ours):
            _micro_batch(ddp, x, sync=False)
        if sync:
            _delay(run.ours, SHORT, [0.0] * n)
        else:
            _delay(run.ours, 0, [SHORT] * (n - 1) + [0.0])
        _micro_batch(run.ref, y, sync=sync)
        with contextlib.nullcontext() if sync else run.ours.no_sync():
            loss = run.ours(y).square().mean()
            start = time.perf_counter()
            loss.backward()
            took = time.perf_counter() - start
        what = f"sync={sync} step {step}: the backward took {took:.3f} s"
        assert took < LONG + 1.5 * SHORT, what  # (waiting for the jobs after it: 2 SHORT more)
        _delay(run.ours, 0, [0.0] * n)
        if not sync:  # the step's synchronized micro-batch
            z = torch.randn(BATCH, 12)
            for ddp in (run.ref, run.ours):
                _micro_batch(ddp, z, sync=True)
        run.ref_opt.step()
        run.ref_opt.zero_grad()
        for sched in run.scheds:
            sched.step()
        _assert_equal(run, what)


@pytest.mark.parametrize("sync", [False, True], ids=["add", "launch"])
def test_a_bucket_waits_for_its_own_addition_only(sync: bool) -> None:
    """Inside backward, a bucket whose last addition on the host is not done waits for that
    addition only, not for the jobs the worker got after it (on a GPU: the copies and
    additions of the buckets before it, the host steps of this backward, and the device
    behind them). ``add``: a no_sync() micro-batch's copy of the bucket to the host; ``launch``:
    the synchronized micro-batch's launch of the bucket, which fetches its sum."""
    run_ranks(2, _own_addition_only, sync)


def _against_device_accumulation(model: nn.Module, dtype: torch.dtype, what: str) -> None:
    """``model`` trained with accumulate_on_host and without (torch's accumulation, by autograd
    on the device): equal bit for bit after every step; nothing on the device in between."""
    device = next(model.parameters()).device
    wrappers = {
        on_host: leanddp.DistributedDataParallel(
            copy.deepcopy(model),
            process_group=dist.new_group(),
            device_ids=[device.index] if device.type == "cuda" else None,
            optimizer_in_backward=OPTIMIZERS["adamw"],
            offload_to_cpu=True,
            accumulate_on_host=on_host,
            bucket_cap_mb=0.0005,
        )
        for on_host in (True, False)
    }
    for step in range(STEPS):
        for i in range(4):
            x = torch.randn(BATCH, 12, dtype=dtype, device=device)
            for ddp in wrappers.values():
                _micro_batch(ddp, x, sync=i == 3)
            if i < 3:
                _assert_device_holds_nothing(wrappers[True], f"{what} step {step} {i}")
        on_device = wrappers[False].module.state_dict()
        for name, value in wrappers[True].module.state_dict().items():
            assert torch.equal(value, on_device[name]), f"{what} step {step} {name}"
    assert wrappers[False].memory_stats()["host_accumulation_bytes"] == 0


def _bf16(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3)).to(torch.bfloat16)
    _against_device_accumulation(model, torch.bfloat16, "bf16")


def test_bfloat16_accumulates_in_bfloat16_as_torch_does() -> None:
    run_ranks(2, _bf16)


def _cuda(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    _against_device_accumulation(Net(rank=rank, f64=False).cuda(), torch.float32, "cuda fp32")
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    _against_device_accumulation(model.to("cuda", torch.bfloat16), torch.bfloat16, "cuda bf16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
def test_cuda_copy_streams_and_pinned_sums_on_a_shared_gpu() -> None:
    """On a GPU (two gloo ranks sharing GPU 0): the copies to the host on the device-to-host
    stream, the sums fetched on the host-to-device stream, pinned host sums."""
    run_ranks(2, _cuda)


def _peak(rank: int, world_size: int) -> None:
    peaks = {}
    for accum in (1, 4):
        run = InBackwardLockStep(
            Net(rank=rank, f64=False), OPTIMIZERS["adamw"], offload=True, bucket_cap_mb=0.0005
        )
        _train(run, f"peak accum={accum}", accum)
        peaks[accum] = run.ours.memory_stats()["peak_bucket_bytes"]
        largest = max(run.ours.reducer.bucket_bytes())
    # The synchronized micro-batch allocates a summed bucket at its first gradient, not at its
    # launch: at most one bucket more than without accumulation.
    assert 0 < peaks[4] <= peaks[1] + largest, (peaks, largest)


def test_synchronized_backward_peak_stays_bounded() -> None:
    run_ranks(2, _peak)


def test_accumulate_on_host_needs_offload() -> None:
    with pytest.raises(ValueError, match="accumulate_on_host=True needs offload_to_cpu=True"):
        leanddp.DistributedDataParallel(
            nn.Linear(2, 2), optimizer_in_backward=OPTIMIZERS["adamw"], accumulate_on_host=True
        )
    with pytest.raises(TypeError, match="accumulate_on_host must be a bool"):
        leanddp.DistributedDataParallel(nn.Linear(2, 2), accumulate_on_host="yes")
