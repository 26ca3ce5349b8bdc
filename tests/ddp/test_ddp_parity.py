"""leanddp.DistributedDataParallel against torch's DDP, run in the same processes on the same
random data: gradients and parameters after every step, for every combination of
gradient_as_bucket_view x no_sync accumulation x find_unused_parameters x static_graph x tiny
buckets, with SGD (momentum) and AdamW, on world sizes 2 and 3 (and a smaller matrix on 4).

Results must be bitwise equal on every world size: leanddp averages as torch's reducer does
(a gradient copied into its bucket multiplied by 1/world, one already in place divided by the
world size) and lays its buckets out as torch does before the first rebuild, so gloo adds
every element in the same order.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from ddp_models import Case, LockStep, Net, assert_same
from dist_harness import run_ranks

STEPS = 5
BATCH = 6


def _cases(unused: bool, optimizer: str) -> list[Case]:
    cases = []
    for views, accum, find_unused, static, tiny in itertools.product(
        (True, False), (1, 3), (False, True), (False, True), (False, True)
    ):
        if unused and not (find_unused or static):
            continue  # torch's DDP itself refuses unused parameters without these
        cases.append(Case(views, accum, find_unused, static, tiny, optimizer))
    return cases


def _parity(
    rank: int, world_size: int, unused: bool, optimizer: str, cases: list[Case] | None = None
) -> None:
    for case in cases if cases is not None else _cases(unused, optimizer):
        model = Net(unused=unused, rank=rank)  # different initial weights on every rank
        run = LockStep(model, case)
        for step in range(STEPS):
            # torch's DDP asserts when a static graph's first iteration runs under no_sync
            accum = 1 if case.static_graph and step == 0 else case.accum
            batches = [torch.randn(BATCH, 12) for _ in range(accum)]
            try:
                run.backward(batches, set_to_none=step % 2 == 0)
            except Exception as exc:
                raise AssertionError(f"{case} step {step}: backward failed") from exc
            for name, a, b in run.pairs():
                assert_same(a.grad, b.grad, f"{case} step {step} grad of {name}", exact=True)
            run.step()
            for name, a, b in run.pairs():
                assert_same(a, b, f"{case} step {step} {name}", exact=True)
        for (name, a), b in zip(
            run.ref.module.named_buffers(), run.ours.module.buffers(), strict=True
        ):
            assert_same(a, b, f"{case} buffer {name}", exact=True)
        ours = run.ours.module
        assert ours.frozen.weight.grad is None
        assert torch.equal(ours.frozen.weight, run.ref.module.frozen.weight)
        if unused:
            assert ours.never.weight.grad is None, "a globally unused parameter got a gradient"
            if case.find_unused and not case.static_graph:
                # used on rank 0 only: every rank holds the reduced gradient
                assert ours.branch.weight.grad is not None


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.extra_ranks)])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("unused", [False, True], ids=["all-used", "unused-branch"])
def test_parity_with_torch_ddp(world_size: int, optimizer: str, unused: bool) -> None:
    run_ranks(world_size, _parity, unused, optimizer)


@pytest.mark.extra_ranks
def test_parity_with_torch_ddp_on_four_ranks() -> None:
    """Four ranks (slow on small machines): views x no_sync x find_unused, default buckets."""
    cases = [
        Case(views, accum, find_unused, optimizer="adamw")
        for views, accum, find_unused in itertools.product((True, False), (1, 3), (False, True))
    ]
    run_ranks(4, _parity, False, "adamw", cases)
