"""A model whose backward can be poisoned on purpose (NaN gradients, or an exception part-way),
a runner that trains it with leanddp or with torch's DDP + the same torch optimizer, and the
NaN-check scenario over them (test_nan_check.py, and under host ordering test_host_ordering.py)."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import leanddp

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)

#: leanddp's configurations: constructor arguments beyond the model's.
CONFIGS = {
    "views": {},
    "in_backward": {"optimizer_in_backward": ADAMW},
    "offload": {"optimizer_in_backward": ADAMW, "offload_to_cpu": True},
}


class Poison(torch.autograd.Function):
    """Identity forward; its backward returns NaN gradients or raises, when ``Poison.mode`` says
    so (a class attribute, so the same model can be poisoned for one step only)."""

    mode: str | None = None  # None, "nan" or "raise"

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if Poison.mode == "raise":
            raise ValueError("poisoned backward")
        if Poison.mode == "nan":
            return grad * float("nan")
        return grad


@contextlib.contextmanager
def nan_gradients() -> Iterator[None]:
    """Poison's backward returns NaN gradients inside the block."""
    Poison.mode = "nan"
    try:
        yield
    finally:
        Poison.mode = None


class Tower(nn.Module):
    """Four layers; ``poison_at`` is where Poison sits: "first" after layers[0] (so only
    layers.0's gradients are poisoned: they are reduced in the last bucket), "output" on the
    output (the backward's first node: nothing is reduced before it)."""

    def __init__(self, poison_at: str = "first") -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.poison_at = poison_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 0 and self.poison_at == "first":
                x = Poison.apply(x)
        return Poison.apply(x) if self.poison_at == "output" else x


class Trainer:
    """One of the runs compared: leanddp in ``config`` (or torch's DDP + torch AdamW when
    ``config`` is "torch"), with ``accum`` micro-batches per step."""

    def __init__(self, model: nn.Module, config: str, accum: int = 1, **kwargs) -> None:
        self.config = config
        self.accum = accum
        model = copy.deepcopy(model)
        if config == "torch":
            self.ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=new_group())
            self.optimizer = ADAMW(self.ddp.parameters())
        else:
            self.ddp = leanddp.DistributedDataParallel(
                model,
                process_group=new_group(),
                bucket_cap_mb=0.002,
                **CONFIGS[config],
                **kwargs,
            )
            self.optimizer = self.ddp.optimizer or ADAMW(self.ddp.parameters())

    def micro_batch(self, x: torch.Tensor, last: bool) -> None:
        if last:
            self.ddp(x).square().mean().backward()
        else:
            with self.ddp.no_sync():
                self.ddp(x).square().mean().backward()

    def step(self, batches: list[torch.Tensor], after: int = -1, then=None) -> None:
        """One optimizer step over ``batches`` (``accum`` of them); ``then()`` runs after
        micro-batch ``after``."""
        self.optimizer.zero_grad(set_to_none=True)
        for i, x in enumerate(batches):
            self.micro_batch(x, last=i == len(batches) - 1)
            if i == after and then is not None:
                then()
        self.optimizer.step()

    def params(self) -> torch.Tensor:
        if self.config != "torch":
            self.ddp.synchronize()
        return torch.cat([p.detach().flatten() for p in self.ddp.module.parameters()])

    def named(self) -> dict[str, torch.Tensor]:
        if self.config != "torch":
            self.ddp.synchronize()
        return {n: p.detach().clone() for n, p in self.ddp.module.named_parameters()}


def new_group() -> dist.ProcessGroup:
    return dist.new_group()


def batches(steps: int, accum: int, seed: int) -> list[list[torch.Tensor]]:
    """The same data on every rank of a run: ``steps`` lists of ``accum`` micro-batches."""
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    return [[torch.randn(8, 16, generator=g) for _ in range(accum)] for _ in range(steps)]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, config: str, what: str) -> None:
    """Bitwise for plain leanddp (torch's optimizer on the same gradients); leanddp's fused
    in-backward/host kernels round differently from torch's AdamW: the in-backward parity
    tests' tolerance."""
    if config == "views":
        assert torch.equal(ours, ref), f"{what}: max diff {(ours - ref).abs().max().item()}"
    else:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def assert_ranks_agree(t: torch.Tensor) -> None:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks hold different weights"


NAN_STEPS, NAN_AT = 4, 1  # nan_step's steps; step NAN_AT's gradients of layers.0 are NaN


def nan_step(rank: int, world_size: int, config: str, check: bool | str, accum: int) -> None:
    """check_for_nan_in_grad=``check`` in ``config`` against torch's DDP + AdamW: step NAN_AT's
    gradients of layers.0 are NaN; every rank raises, naming them, and no weight changed (or,
    in-backward on the device, exactly the weights the error lists, whose step counts are one
    ahead from then on); the other steps train as torch's run does."""
    torch.manual_seed(7)
    model = Tower(poison_at="first")
    data = batches(NAN_STEPS, accum, seed=3)
    ref = Trainer(model, "torch", accum)
    ours = Trainer(model, config, accum, check_for_nan_in_grad=check)
    for step, micro in enumerate(data):
        if step != NAN_AT:
            ref.step(micro)
            ours.step(micro)
            assert_close(ours.params(), ref.params(), config, f"step {step}")
            continue
        before = ours.named()
        with nan_gradients(), pytest.raises(RuntimeError, match="check_for_nan_in_grad") as caught:
            ours.step(micro)
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
