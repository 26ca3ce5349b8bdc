"""Gradients are views into bucket memory, accumulation allocates nothing, and a gradient user
code replaced out of place is copied in with one warning and correct results."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_models import Case, LockStep, Net, assert_same
from dist_harness import run_ranks

import leanddp


def _bucket_ranges(ddp: leanddp.DistributedDataParallel) -> list[tuple[int, int]]:
    """(start, end) addresses of every bucket, from the parameters' views after a step."""
    stats = ddp.memory_stats()
    assert stats["grads_outside"] == 0
    return sorted(
        (p.grad.data_ptr(), p.grad.data_ptr() + p.grad.nbytes)
        for p in ddp.module.parameters()
        if p.grad is not None
    )


def _views_and_no_allocation(rank: int, world_size: int) -> None:
    model = leanddp.DistributedDataParallel(Net(rank=rank), bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    params = [p for p in model.module.parameters() if p.requires_grad]
    stats = model.memory_stats()
    assert stats["bucket_bytes"] == stats["param_bytes"], stats
    pointers = None
    for step in range(4):
        opt.zero_grad(set_to_none=step % 2 == 0)
        for micro in range(3):
            if micro < 2:
                with model.no_sync():
                    model(torch.randn(4, 12)).sum().backward()
            else:
                model(torch.randn(4, 12)).sum().backward()
            if step >= 1:  # after the one-time rebuild (first forward of step 1)
                now = [p.grad.data_ptr() for p in params]
                if pointers is not None:
                    assert now == pointers, f"step {step} micro-batch {micro}: grads moved"
                pointers = now
        stats = model.memory_stats()
        assert stats["grads_as_views"] == len(params), stats
        assert stats["grads_outside"] == 0 and stats["grad_bytes"] == 0, stats
        opt.step()
    # every gradient lies inside the flat buckets: the buckets are the only gradient memory
    assert sum(end - start for start, end in _bucket_ranges(model)) == stats["bucket_bytes"]


def _copies_without_views(rank: int, world_size: int) -> None:
    model = leanddp.DistributedDataParallel(Net(rank=rank), gradient_as_bucket_view=False)
    model(torch.randn(4, 12)).sum().backward()
    stats = model.memory_stats()
    assert stats["grads_as_views"] == 0
    assert stats["grad_bytes"] == stats["param_bytes"] == stats["bucket_bytes"], stats


def _replaced_grad(rank: int, world_size: int) -> None:
    run = LockStep(Net(rank=rank), Case(optimizer="sgd"))
    for step in range(4):
        x = torch.randn(5, 12)
        run.backward([x], set_to_none=False)
        if step == 1:
            for ddp in (run.ref, run.ours):  # user code replaces a gradient out of place
                ddp.module.head.weight.grad = ddp.module.head.weight.grad * 2.0
        run.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run.backward([torch.randn(5, 12)], set_to_none=False)
        replaced = [w for w in caught if "no longer a view" in str(w.message)]
        assert len(replaced) == (1 if step == 1 else 0), [str(w.message) for w in caught]
        for name, a, b in run.pairs():
            assert_same(a.grad, b.grad, f"step {step} grad of {name}", exact=True)
        run.step()
    assert run.ours.memory_stats()["grads_outside"] == 0  # the view came back


@pytest.mark.parametrize(
    "body",
    [_views_and_no_allocation, _copies_without_views, _replaced_grad],
    ids=["views-no-allocation", "copies-without-views", "replaced-grad"],
)
def test_gradient_memory(body) -> None:
    run_ranks(2, body)


def test_process_group_is_required() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        leanddp.DistributedDataParallel(torch.nn.Linear(2, 2))
