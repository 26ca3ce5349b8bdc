"""check_for_nan_in_grad: a NaN in a reduced gradient raises on every rank, naming the
parameter, and changes no weight (or, with optimizer_in_backward on the device, exactly the
weights the error lists); training then goes on as if the bad step had not happened."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from fault_models import Poison, Tower, Trainer, assert_close, assert_ranks_agree, batches

STEPS, BAD = 4, 1  # step BAD's gradients of layers.0 are NaN


def _nan_step(rank: int, world_size: int, config: str, check: bool | str, accum: int) -> None:
    torch.manual_seed(7)
    model = Tower(poison_at="first")
    data = batches(STEPS, accum, seed=3)
    ref = Trainer(model, "torch", accum)
    ours = Trainer(model, config, accum, check_for_nan_in_grad=check)
    for step, micro in enumerate(data):
        if step != BAD:
            ref.step(micro)
            ours.step(micro)
            assert_close(ours.params(), ref.params(), config, f"step {step}")
            continue
        before = ours.named()
        Poison.mode = "nan"
        try:
            with pytest.raises(RuntimeError, match="check_for_nan_in_grad") as caught:
                ours.step(micro)
        finally:
            Poison.mode = None
        message = str(caught.value)
        named = message.split("the reduced gradient of ")[1].split(" holds NaN or infinity")[0]
        assert set(named.split(", ")) == {"layers.0.weight", "layers.0.bias"}, message
        assert "every rank raises" in message
        after = ours.named()
        assert_ranks_agree(ours.params())
        partial = config == "in_backward" and check is True
        if not partial:
            assert "No weight was changed" in message, message
            for name, value in before.items():
                assert torch.equal(after[name], value), f"{name} changed"
            continue
        # buckets reduced before layers.0's were stepped, and the error lists exactly those
        assert "keep this step's update" in message, message
        changed = {name for name, value in before.items() if not torch.equal(after[name], value)}
        assert changed and not any(name.startswith("layers.0.") for name in changed), changed
        listed = message.split("already stepped")[1].split("keep this step's update")[0]
        for name in before:
            assert (name + "," in listed or name + ")" in listed) == (name in changed), (
                f"{name} listed wrongly: {message}"
            )
        # The steps the flags skipped are not counted: the stepped parameters are one step
        # ahead of the others, and training goes on from there on every rank.
        named = dict(ours.ddp.module.named_parameters())
        state = ours.ddp.optimizer.state
        for extra in range(3):
            counts = {name: int(state[p]["step"]) for name, p in named.items()}
            for name, count in counts.items():
                expected = step + extra + (1 if name in changed else 0)
                assert count == expected, f"{name}: step count {count}, expected {expected}"
            if extra < 2:
                ours.step(data[step + 1 + extra])
                assert_ranks_agree(ours.params())
                assert torch.isfinite(ours.params()).all()
        return  # the weights now differ from torch's run by design
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in ours.ddp.parameters())


@pytest.mark.parametrize(
    "config,check,accum",
    [
        ("views", True, 1),
        ("views", True, 2),
        ("in_backward", True, 1),
        ("in_backward", "strict", 2),
        ("offload", True, 2),
    ],
)
def test_nan_raises_on_every_rank_before_any_weight_changes(
    config: str, check: bool | str, accum: int
) -> None:
    run_ranks(2, _nan_step, config, check, accum)
