"""The device-ordered paths run on the CPU: under host ordering (csrc/streams.h, a test seam) CPU
tensors are ordered as if they lived on a GPU, so the Reducer and HostOffload take the branches
that otherwise only a GPU executes (the side stream, the events a bucket's step waits for and
records, the window's finish path and its bytes carried across iterations, the release of a
bucket recorded on the side stream, offload's per-bucket copy events and device staging buffer,
the sharded gather ordered on the side stream, a comm hook's result followed on the stream).
Their operations complete at once on the host, and are counted: each case asserts the branches
ran, and trains against torch's DDP + the same torch optimizer in the same processes.

What a seam cannot show (real concurrency between the host and a device, NCCL's own ordering,
pinned memory, CUDA timing) is tests/device/test_cuda_ddp_parity.py's and
test_cuda_ddp_async.py's, on a GPU.
"""

from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
from ddp_models import Case, LockStep, Net, accumulate, assert_same
from dist_harness import run_ranks
from fault_models import nan_step
from in_backward_models import (
    OPTIMIZERS,
    Deep,
    InBackwardLockStep,
    assert_params_close,
    train_lock_step,
)
from seam import counts_moved, events_created, host_ordered
from sparse_models import SparseCase, sparse_parity_case
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import leanddp
from leanddp._extension import _C

pytestmark = pytest.mark.leanddp_paths

STEPS = 3
TINY = 0.0005  # MiB: a bucket per parameter or two, so the window fills and finishes buckets


def _in_backward(rank: int, world_size: int) -> None:
    # (SGD's kernel runs through the same step_bucket as AdamW's: test_in_backward_* cover it)
    for name, accum, offload in itertools.product(("adamw", "adagrad"), (1, 3), (False, True)):
        if offload and name == "adagrad":
            continue  # offload_to_cpu steps the fused kinds only
        what = f"host-ordered {name} accum={accum} offload={offload}"
        before = _C._testing.host_ordering_counts()
        run = host_ordered(
            lambda name=name, offload=offload: InBackwardLockStep(
                Net(rank=rank, f64=False), OPTIMIZERS[name], offload=offload, bucket_cap_mb=TINY
            )
        )
        train_lock_step(run, what, accum, STEPS)
        stats = run.ours.memory_stats()
        assert 0 < stats["max_buckets_in_flight"] <= _C.BUCKETS_IN_FLIGHT, (what, stats)
        # side streams, events recorded and waited for on a stream, the bucket's memory recorded
        # on its stream; the host waited for a step's event (the full window's finish, or with
        # offload the worker's wait for a bucket's copy to the host)
        counts_moved(before, what, "streams", "records", "blocks", "synchronizes")
        if not offload:
            counts_moved(before, what, "records_on_stream")


def test_in_backward_and_offload_take_the_device_branches() -> None:
    """optimizer_in_backward (fused and fallback) and offload_to_cpu, tiny buckets and
    accumulation: the side-stream steps, the window's finish path and offload's copy events."""
    run_ranks(2, _in_backward)


def _lowbit(rank: int, world_size: int) -> None:
    """torchao's AdamW8bit stepped by leanddp's 8-bit kernels, in-backward and offloaded, whole
    or sharded, tiny buckets and accumulation: equal to torch's DDP + AdamW8bit bit for bit
    (parameters, codes, scales; sharded, gathered by state_dict()), through the side stream,
    offload's copy events and the sharded gathers on the side stream."""
    from lowbit_models import Quantizable, assert_torchao_state_equal
    from torchao.optim import AdamW8bit

    factory = functools.partial(AdamW8bit, lr=1e-2, weight_decay=0.1)
    for offload, sharded in itertools.product((False, True), (False, True)):
        what = f"host-ordered 8-bit offload={offload} sharded={sharded}"
        before = _C._testing.host_ordering_counts()
        torch.manual_seed(0)
        run = host_ordered(
            lambda offload=offload, sharded=sharded: InBackwardLockStep(
                Quantizable(),
                factory,
                offload=offload,
                bucket_cap_mb=0.02,
                fused_reference=False,
                ours_kwargs=dict(shard_optimizer_state=sharded),
            )
        )
        torch.manual_seed(1 + rank)
        for step in range(STEPS):
            run.step([torch.randn(6, Quantizable.IN) for _ in range(2)])
            for name, a, b in run.pairs():
                assert torch.equal(a, b), f"{what} step {step} {name}"
        ours, ref = run.ours.optimizer.state_dict()["state"], run.ref_opt.state_dict()["state"]
        assert ours.keys() == ref.keys(), what
        for index, entry in ref.items():
            assert_torchao_state_equal(ours[index], entry, f"{what} {index}")
        assert run.ours._in_backward.fallback.calls == 0, what
        counts_moved(before, what, "streams", "records", "blocks", "synchronizes")


def test_8bit_state_takes_the_device_branches() -> None:
    pytest.importorskip("torchao.optim")
    run_ranks(2, _lowbit)


def _window_carried(rank: int, world_size: int) -> None:
    """Steps still queued on the side stream when a backward ends count against the next
    backward's window (a host that runs ahead must finish them before another launch)."""
    run = host_ordered(
        lambda: InBackwardLockStep(
            Net(rank=rank, f64=False), OPTIMIZERS["adamw"], bucket_cap_mb=TINY
        )
    )
    for step in range(STEPS):
        accumulate(run.ref, [torch.randn(6, 12)])
        before = _C._testing.host_ordering_counts()
        accumulate(run.ours, [torch.randn(6, 12)])
        stats = run.ours.memory_stats()
        assert stats["max_buckets_in_flight"] <= _C.BUCKETS_IN_FLIGHT, stats
        if step > 0:  # the carried steps were finished (host-waited) before the first launch
            after = _C._testing.host_ordering_counts()
            assert after["synchronizes"] - before["synchronizes"] >= stats["num_buckets"], after
        run.ref_opt.zero_grad()


def test_window_bound_carries_across_iterations() -> None:
    run_ranks(2, _window_carried)


#: Configurations whose in-backward steps all wait for the end of backward (no step in a hook)
END_OF_BACKWARD = {
    "find_unused_parameters": dict(find_unused_parameters=True),
    "strict NaN check": dict(ours_kwargs=dict(check_for_nan_in_grad="strict")),
    "sharded max_grad_norm": dict(
        max_grad_norm=0.05, ours_kwargs=dict(shard_optimizer_state=True, max_grad_norm=0.05)
    ),
}
ITERATIONS = 30


def _end_of_backward(rank: int, world_size: int) -> None:
    for name, kwargs in END_OF_BACKWARD.items():
        unused = "find_unused_parameters" in kwargs
        run = host_ordered(
            lambda kwargs=kwargs, unused=unused: InBackwardLockStep(
                Net(unused=unused, rank=rank, f64=False), OPTIMIZERS["sgd-nesterov"],
                bucket_cap_mb=TINY, **kwargs,
            )
        )  # fmt: skip
        created, peaks = [], []
        for step in range(ITERATIONS):
            run.step([torch.randn(6, 12)], legacy_calls=step % 2 == 1)
            stats = run.ours.memory_stats()
            assert stats["max_buckets_in_flight"] <= stats["num_buckets"], (name, step, stats)
            created.append(events_created(run.ours))
            peaks.append(stats["peak_bucket_bytes"])
        assert_params_close(run, f"{name} after {ITERATIONS} steps")
        # (the first two iterations rebuild the buckets and create the optimizer state)
        assert len(set(created[3:])) == 1, f"{name}: events created per iteration {created}"
        assert len(set(peaks[3:])) == 1, f"{name}: peak bucket bytes per iteration {peaks}"


def test_end_of_backward_steps_do_not_pile_up() -> None:
    """Where every in-backward step waits for the end of backward (unused parameters searched
    for, the strict NaN check, sharded clipping) no backward finishes the side stream's steps
    before launching: over 30 iterations the events created and the bytes counted in flight
    stay those of one iteration, and the buckets in flight never exceed the bucket count (as if
    each iteration's steps were still running in every later one)."""
    run_ranks(2, _end_of_backward)


def _sharded(rank: int, world_size: int) -> None:
    for name, accum, offload in (
        ("adamw", 1, False),
        ("sgd-nesterov", 2, False),
        ("adamw", 2, True),
    ):
        what = f"host-ordered sharded {name} accum={accum} offload={offload}"
        before = _C._testing.host_ordering_counts()
        run = host_ordered(
            lambda name=name, offload=offload: InBackwardLockStep(
                Net(rank=rank, f64=False),
                OPTIMIZERS[name],
                offload=offload,
                bucket_cap_mb=TINY,
                ours_kwargs=dict(shard_optimizer_state=True),
            )
        )
        train_lock_step(run, what, accum, STEPS)
        counts_moved(before, what, "records", "blocks")


def test_sharded_gathers_on_the_side_stream() -> None:
    """shard_optimizer_state, on the device and with offload_to_cpu: a bucket's gather is
    enqueued on the side stream right after its step (no host wait for it)."""
    run_ranks(2, _sharded)


def _comm_hooks(rank: int, world_size: int) -> None:
    for hook, offload in itertools.product(
        (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook), (False, True)
    ):
        what = f"host-ordered {hook.__name__} offload={offload}"
        before = _C._testing.host_ordering_counts()
        run = host_ordered(  # twelve layers of 12 x 12: a bucket each
            lambda offload=offload: InBackwardLockStep(
                Deep(width=12), OPTIMIZERS["adamw"], offload=offload, bucket_cap_mb=TINY
            )
        )
        for ddp in (run.ref, run.ours):
            ddp.register_comm_hook(ddp.process_group, hook)
        train_lock_step(run, what, 1, STEPS)
        counts_moved(before, what, "records", "blocks")
        # A hook's collective may keep a released bucket (NCCL's stash): its storage is kept
        # and reused for the next buckets, so what is held stays bounded whatever the count.
        stats = run.ours.memory_stats()
        largest = max(run.ours.reducer.bucket_bytes())
        window = _C.BUCKETS_IN_FLIGHT
        assert stats["num_buckets"] > 2 * (window + 1), stats  # a bound the count would break
        assert 0 < stats["recycled_bucket_bytes"] <= (window + 1) * largest, (what, stats)
        assert stats["peak_bucket_bytes"] <= (window + 2) * largest, (what, stats)
        train_lock_step(run, f"{what} accum=2", 2, 2)  # (every bucket held across micro-batches)
    # gradient views without in-backward steps: a hook's result followed on the stream
    for accum in (1, 3):
        case = Case(accum=accum, tiny_buckets=True, optimizer="adamw")
        run = host_ordered(lambda case=case: LockStep(Net(rank=rank, f64=False), case))
        for ddp in (run.ref, run.ours):
            ddp.register_comm_hook(ddp.process_group, default_hooks.fp16_compress_hook)
        for step in range(STEPS):
            run.backward([torch.randn(6, 12) for _ in range(accum)])
            for name, a, b in run.pairs():
                assert_same(a.grad, b.grad, f"{case} step {step} {name}.grad", exact=False)
            run.step()


def test_comm_hooks_with_device_ordering() -> None:
    """torch's allreduce and fp16 compression hooks, in-backward (with and without offload)
    and with plain gradient views, their results followed on the side or current stream."""
    run_ranks(2, _comm_hooks)


class _Mixed(nn.Module):
    """bfloat16 Linear layers and float32 LayerNorms: two dtypes, so buckets of each."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 24).to(torch.bfloat16)
        self.norm = nn.LayerNorm(24)
        self.b = nn.Linear(24, 12).to(torch.bfloat16)
        self.out_norm = nn.LayerNorm(12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.a(x.to(torch.bfloat16)).float())
        return self.out_norm(self.b(torch.tanh(h).to(torch.bfloat16)).float())


def _mixed_offload(rank: int, world_size: int) -> None:
    """offload_to_cpu with bfloat16 and float32 buckets through the device staging path (each
    bucket's weights come back through a device buffer of its own dtype), bitwise equal to the
    host path, which tests/offload/test_offload.py holds to torch and to float64; float32 state
    and masters for both."""
    torch.manual_seed(0)
    model = _Mixed()
    factory = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)

    def wrap() -> leanddp.DistributedDataParallel:
        return leanddp.DistributedDataParallel(
            copy.deepcopy(model), process_group=dist.new_group(), optimizer_in_backward=factory,
            offload_to_cpu=True, bucket_cap_mb=TINY,
        )  # fmt: skip

    before = _C._testing.host_ordering_counts()
    ordered, plain = host_ordered(wrap), wrap()
    dtypes = {p.dtype for p in ordered.module.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}, dtypes
    for step in range(4):
        batches = [torch.randn(6, 12) for _ in range(2)]
        for ddp in (ordered, plain):
            accumulate(ddp, batches)
            ddp.synchronize()  # the host steps and the copies back are done
        for (name, a), b in zip(
            ordered.module.named_parameters(), plain.module.parameters(), strict=True
        ):
            assert torch.equal(a, b), f"step {step} {name}"
    initial = dict(model.named_parameters())
    for name, p in ordered.module.named_parameters():
        assert not torch.equal(p, initial[name]), f"{name} never moved"
        if p.dtype == torch.bfloat16:
            assert ordered.optimizer.state[p]["master_weight"].dtype == torch.float32, name
    counts_moved(before, "mixed-dtype offload", "records", "synchronizes", "blocks")


def test_offload_with_mixed_dtypes_through_the_device_staging_path() -> None:
    run_ranks(2, _mixed_offload)


def _nan_check(rank: int, world_size: int) -> None:
    _C._testing.set_host_ordering(True)  # (torch's DDP beside ours is not affected)
    before = _C._testing.host_ordering_counts()
    cases = (("in_backward", True, 1), ("in_backward", "strict", 2), ("offload", True, 2))
    for config, check, accum in cases:
        nan_step(rank, world_size, config, check, accum)
    counts_moved(before, "NaN check", "records", "blocks")


def test_nan_check_flags_on_the_side_stream() -> None:
    """check_for_nan_in_grad with in-backward steps and with offload_to_cpu: each bucket's
    flags are set on the side stream, read once at the end of backward (offload's host steps
    are held until then, and dropped on a NaN); strict: buckets collected on the caller's
    stream at the end of backward, the side stream following that stream."""
    run_ranks(2, _nan_check)


def _sparse(rank: int, world_size: int) -> None:
    _C._testing.set_host_ordering(True)  # (torch's DDP beside ours is not affected)
    sparse_parity_case(rank, world_size, SparseCase(comm_hook=True, accum=2))


def test_sparse_bucket_with_a_comm_hook() -> None:
    """A sparse gradient's bucket reduced by a comm hook under device order, against torch's
    DDP: the current stream follows the default stream the hook's result was completed on
    (both are the host's one stream here, as a backward on the default stream has them on a
    GPU: the wait is a no-op either way, so no count shows it)."""
    run_ranks(2, _sparse)
