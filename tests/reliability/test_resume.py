"""Resuming: a checkpoint saved in the middle of gradient accumulation or after a caught
exception, loaded into a fresh wrapper, continues exactly as the run that was not interrupted;
and a backward that raises part-way leaves every rank with the same weights (docs/reliability.md).
"""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch
from dist_harness import run_ranks
from fault_models import (
    ADAMW,
    Poison,
    Tower,
    Trainer,
    assert_close,
    assert_ranks_agree,
    batches,
)
from torch import nn

import leanddp

STEPS, ACCUM = 4, 3


def checkpoint(trainer: Trainer) -> bytes:
    buffer = io.BytesIO()
    state = {"model": trainer.ddp.module.state_dict(), "optim": trainer.optimizer.state_dict()}
    torch.save(state, buffer)
    return buffer.getvalue()


def restored(config: str, blob: bytes, accum: int) -> Trainer:
    """A fresh wrapper around a differently initialised model, loaded from ``blob``."""
    torch.manual_seed(99)
    trainer = Trainer(Tower(poison_at="output"), config, accum)
    state = torch.load(io.BytesIO(blob), weights_only=True)
    trainer.ddp.module.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optim"])
    return trainer


def _mid_accumulation(rank: int, world_size: int, config: str) -> None:
    torch.manual_seed(5)
    model = Tower(poison_at="output")
    data = batches(STEPS, ACCUM, seed=11)
    straight, saving = Trainer(model, config, ACCUM), Trainer(model, config, ACCUM)
    ref = Trainer(model, "torch", ACCUM)
    saved: list[bytes] = []
    for step, micro in enumerate(data):
        straight.step(micro)
        ref.step(micro)
        # step 2: saved after its first micro-batch, while gradients are accumulating
        saving.step(
            micro, after=0 if step == 2 else -1, then=lambda: saved.append(checkpoint(saving))
        )
    assert len(saved) == 1
    assert torch.equal(saving.params(), straight.params()), "saving disturbed the run"
    assert_close(straight.params(), ref.params(), config, "uninterrupted vs torch")
    resumed = restored(config, saved[0], ACCUM)
    for micro in data[2:]:  # the interrupted step again, from its first micro-batch
        resumed.step(micro)
    assert torch.equal(resumed.params(), straight.params()), (
        f"resumed: max diff {(resumed.params() - straight.params()).abs().max().item()}"
    )


@pytest.mark.parametrize("config", ["views", "in_backward", "offload"])
def test_checkpoint_in_the_middle_of_accumulation_resumes_exactly(config: str) -> None:
    run_ranks(2, _mid_accumulation, config)


def _poisoned(trainer: Trainer, micro: list[torch.Tensor]) -> None:
    """The step's last (synchronized) micro-batch raises in its backward."""

    def arm() -> None:
        Poison.mode = "raise"

    try:
        with pytest.raises(ValueError, match="poisoned backward"):
            trainer.step(micro, after=len(micro) - 2, then=arm)
    finally:
        Poison.mode = None


def _after_exception(rank: int, world_size: int, config: str, where: str) -> None:
    """Step 1 raises in backward and is skipped; the run equals one that never saw it."""
    torch.manual_seed(5)
    model = Tower(poison_at=where)
    accum = 2
    data = batches(STEPS, accum, seed=13)
    skipping, failing = Trainer(model, config, accum), Trainer(model, config, accum)
    ref = Trainer(model, "torch", accum)
    blob = b""
    for step, micro in enumerate(data):
        if step == 1:
            _poisoned(failing, micro)
            blob = checkpoint(failing)
            continue
        for trainer in (skipping, failing, ref):
            trainer.step(micro)
    assert torch.equal(failing.params(), skipping.params())
    assert_close(skipping.params(), ref.params(), config, "skipping vs torch")
    resumed = restored(config, blob, accum)
    for micro in data[2:]:
        resumed.step(micro)
    assert torch.equal(resumed.params(), skipping.params())


@pytest.mark.parametrize(
    "config,where",
    [("views", "first"), ("views", "output"), ("in_backward", "output"), ("offload", "output")],
)
def test_resume_after_a_caught_exception(config: str, where: str) -> None:
    run_ranks(2, _after_exception, config, where)


def _raised_part_way(rank: int, world_size: int, config: str) -> None:
    """optimizer_in_backward, and the backward raises after some buckets were reduced: those
    are stepped on every rank alike (at once or at the next forward), the others are not."""
    torch.manual_seed(5)
    trainer = Trainer(Tower(poison_at="first"), config, 2)
    data = batches(3, 2, seed=17)
    trainer.step(data[0])
    before = trainer.named()
    _poisoned(trainer, data[1])
    trainer.ddp(data[2][0])  # the next forward winds the failed step up
    after = trainer.named()
    changed = {name for name, value in before.items() if not torch.equal(after[name], value)}
    assert changed and not any(name.startswith("layers.0.") for name in changed), changed
    assert_ranks_agree(trainer.params())
    assert all(p.grad is None for p in trainer.ddp.parameters()), "the step's grads were dropped"
    trainer.step(data[2])
    assert torch.isfinite(trainer.params()).all()
    assert_ranks_agree(trainer.params())


@pytest.mark.parametrize("config", ["in_backward", "offload"])
def test_backward_raising_part_way_leaves_ranks_in_agreement(config: str) -> None:
    run_ranks(2, _raised_part_way, config)


def _dropped_right_after_backward(rank: int, world_size: int) -> None:
    """A framework may drop the wrapper right after the last backward (Lightning's teardown):
    the host steps still queued then must land in the parameters, not be discarded."""
    torch.manual_seed(3)
    big = nn.Sequential(nn.Linear(2048, 2048), nn.Tanh(), nn.Linear(2048, 2048))
    x = torch.randn(16, 2048)
    modules = [copy.deepcopy(big), copy.deepcopy(big)]
    wrappers = [
        leanddp.DistributedDataParallel(
            m, optimizer_in_backward=ADAMW, offload_to_cpu=True, bucket_cap_mb=0.5
        )
        for m in modules
    ]
    wrappers[1](x).square().mean().backward()
    wrappers[1].synchronize()
    wrappers[0](x).square().mean().backward()
    wrappers.pop(0)  # the only reference: collected now, while its worker is still stepping
    gc.collect()
    for a, b in zip(modules[0].parameters(), modules[1].parameters(), strict=True):
        assert torch.equal(a, b), "a host step queued when the wrapper was dropped was lost"


def test_wrapper_dropped_right_after_backward_keeps_the_step() -> None:
    run_ranks(2, _dropped_right_after_backward)
