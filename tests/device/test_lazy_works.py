"""optimizer_in_backward when reductions report done late, as NCCL's do on the host (a process
group whose works are not completed until waited for; tests/support/lazy_pg.py): buckets are
still stepped and released inside backward, in launch order, with never more than the window
of buckets in flight, and training matches torch's DDP + the same torch optimizer."""

from __future__ import annotations

import copy
import functools
import itertools

import torch
import torch.distributed as dist
from ddp_models import accumulate
from dist_harness import run_ranks
from in_backward_models import LAYER_BYTES, Deep, completed_allreduce_hook
from lazy_pg import LAZY_BACKEND, LazyGroup, register
from seam import host_ordered

import leanddp
from leanddp._extension import _C

STEPS = 4
WINDOW = _C.BUCKETS_IN_FLIGHT


def _lazy(rank: int, world_size: int, offload: bool, accum: int) -> None:
    register()
    group = dist.new_group(backend=LAZY_BACKEND)
    what = f"offload={offload} accum={accum}"
    assert isinstance(group, LazyGroup)
    factory = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    model = Deep()
    ref = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), process_group=dist.new_group()
    )
    ref_opt = factory(ref.module.parameters())
    ours = leanddp.DistributedDataParallel(
        copy.deepcopy(model),
        process_group=group,
        bucket_cap_mb=LAYER_BYTES / 2**20,
        optimizer_in_backward=factory,
        offload_to_cpu=offload,
    )
    layers = ours.module.layers
    probes: list[tuple[int, int]] = []  # at the last gradient: (layers stepped, bucket bytes)
    before: list[torch.Tensor] = []

    def probe(_: torch.Tensor) -> None:
        if not ours.require_backward_grad_sync:  # a no_sync micro-batch: nothing is stepped
            return
        stepped = sum(
            not torch.equal(layer.weight, b) for layer, b in zip(layers, before, strict=True)
        )
        probes.append((stepped, ours.memory_stats()["bucket_bytes"]))

    if not offload:  # (with offload the host worker writes the weights while this reads them)
        layers[0].weight.register_post_accumulate_grad_hook(probe)  # the last gradient ready
    for step in range(STEPS):
        batches = [torch.randn(4, 32) for _ in range(accum)]
        accumulate(ref, batches)
        ref_opt.step()
        ref_opt.zero_grad()
        ours.synchronize()
        before[:] = [layer.weight.detach().clone() for layer in layers]
        accumulate(ours, batches)
        stats = ours.memory_stats()
        # Nothing reports done by itself: the window fills up and holds.
        assert stats["max_buckets_in_flight"] == WINDOW, (what, step, stats)
        if accum == 1:  # (accumulation holds every bucket between micro-batches, by design)
            assert stats["peak_bucket_bytes"] <= (WINDOW + 1) * LAYER_BYTES, (what, step, stats)
        assert stats["bucket_bytes"] == 0, (what, stats)
        assert all(p.grad is None for p in layers.parameters()), what
        theirs = ref.module.state_dict()
        for name, value in ours.module.state_dict().items():
            torch.testing.assert_close(
                value,
                theirs[name],
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=f"{what} step {step} {name}": f"{n}: {m}",
            )
    # Every reduction was waited for exactly once, in the order it was launched.
    assert group.waits == group.launches, (what, group.launches, group.waits)
    if not offload:
        for stepped, bucket_bytes in probes[1:]:  # (the first backward runs before the rebuild)
            # When the last gradient arrives, all but the window and that gradient's own bucket
            # were stepped and released inside backward (its bucket holds the accumulated
            # gradient when there are micro-batches).
            assert stepped >= len(layers) - 1 - WINDOW, (what, probes)
            assert bucket_bytes <= (WINDOW + 1) * LAYER_BYTES, (what, probes)


def _all_cases(rank: int, world_size: int) -> None:
    for offload, accum in itertools.product((False, True), (1, 2)):
        _lazy(rank, world_size, offload, accum)


def test_late_completion_still_steps_inside_backward() -> None:
    """In-backward device steps and offload_to_cpu, with and without accumulation (one launch
    of the ranks for the four cases: each case builds its own groups and wrappers)."""
    run_ranks(2, _all_cases)


def _hook_reuses(rank: int, world_size: int) -> None:
    register()
    group = dist.new_group(backend=LAZY_BACKEND)
    factory = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    model = Deep()
    ref = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(model), process_group=dist.new_group()
    )
    ref.register_comm_hook(ref.process_group, completed_allreduce_hook)
    ref_opt = factory(ref.module.parameters())
    ours = host_ordered(
        lambda: leanddp.DistributedDataParallel(
            copy.deepcopy(model), process_group=group, bucket_cap_mb=LAYER_BYTES / 2**20,
            optimizer_in_backward=factory,
        )
    )  # fmt: skip
    # NCCL's future is complete when the hook returns (the result ordered on its stream): each
    # bucket is stepped right after its launch, as here, and released to the recycler
    ours.register_comm_hook(group, completed_allreduce_hook)
    for step in range(STEPS):
        batches = [torch.randn(4, 32)]
        accumulate(ref, batches)
        ref_opt.step()
        ref_opt.zero_grad()
        accumulate(ours, batches)
        reuses = ours.reducer._recycler_reuses()
        what = f"step {step}: (bucket, reused bucket, waits) {reuses}"
        if step > 0:  # (the first backward runs before the rebuild, and the recycler fills)
            assert len(reuses) >= len(ours.module.layers) - 2, what
        # No launch waits for the collective and step of the bucket launched just before it:
        # two collectives, not one, overlap the backward computation.
        for bucket, giver, waits in reuses:
            assert not waits or bucket - giver >= 2, what
        stats = ours.memory_stats()
        assert stats["recycled_bucket_bytes"] <= (WINDOW + 1) * LAYER_BYTES, (what, stats)
        assert stats["peak_bucket_bytes"] <= (WINDOW + 2) * LAYER_BYTES, (what, stats)
        theirs = ref.module.state_dict()
        for name, value in ours.module.state_dict().items():
            torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=1e-6, msg=what)


def test_a_comm_hook_overlaps_two_collectives() -> None:
    """optimizer_in_backward with a comm hook under device order (host ordering, csrc/streams.h;
    its side stream's steps known finished only once waited for, as NCCL's): a released
    bucket's storage is kept for the next buckets (bucket_recycler.h). The launch of bucket k never
    takes bucket k - 1's storage while that bucket's step is not known finished: the recycler
    grows to the window + 1 buffers first, so the compute stream never waits for the last
    collective launched."""
    run_ranks(2, _hook_reuses)
