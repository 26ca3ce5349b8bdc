"""Models and a lock-step trainer for comparing leanddp against torch's DDP in one process."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch import nn

import leanddp

D = 12
#: rows of one micro-batch of Net's input
BATCH = 6


class Net(nn.Module):
    """Tied weights (enc/dec share one Parameter), a frozen layer, BatchNorm buffers, a float64
    layer (float32 if ``f64=False``); with ``unused=True`` also a branch only rank 0 uses and a
    layer no rank uses."""

    def __init__(self, unused: bool = False, rank: int = 0, f64: bool = True) -> None:
        super().__init__()
        self.enc = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.bn = nn.BatchNorm1d(D)
        self.f64 = nn.Linear(D, D).to(torch.float64 if f64 else torch.float32)
        self.dec = nn.Linear(D, D)
        self.dec.weight = self.enc.weight
        self.head = nn.Linear(D, 3)
        self.unused = unused
        self.use_branch = unused and rank == 0
        if unused:
            self.branch = nn.Linear(D, D)
            self.never = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc(x))
        h = self.bn(self.frozen(h))
        h = h + self.f64(h.to(self.f64.weight.dtype)).float()
        if self.use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(torch.relu(self.dec(h)))


@dataclasses.dataclass
class Case:
    views: bool = True
    accum: int = 1
    find_unused: bool = False
    static_graph: bool = False
    tiny_buckets: bool = False
    optimizer: str = "sgd"

    def ddp_kwargs(self) -> dict:
        return dict(
            gradient_as_bucket_view=self.views,
            find_unused_parameters=self.find_unused,
            static_graph=self.static_graph,
            bucket_cap_mb=0.0005 if self.tiny_buckets else None,
        )


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


class LockStep:
    """torch's DDP and leanddp's over copies of one model, each on its own process group,
    stepped on the same data so every intermediate can be compared."""

    def __init__(self, model: nn.Module, case: Case) -> None:
        self.case = case
        kwargs = case.ddp_kwargs()
        self.ref = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(model), process_group=dist.new_group(), **kwargs
        )
        self.ours = leanddp.DistributedDataParallel(
            copy.deepcopy(model), process_group=dist.new_group(), **kwargs
        )
        self.opts = [make_optimizer(case.optimizer, d.parameters()) for d in (self.ref, self.ours)]

    def backward(self, batches: list[torch.Tensor], set_to_none: bool = True) -> None:
        """One optimizer step's worth of micro-batches (all but the last under no_sync)."""
        for ddp, opt in zip((self.ref, self.ours), self.opts, strict=True):
            opt.zero_grad(set_to_none=set_to_none)
            accumulate(ddp, batches)

    def step(self) -> None:
        for opt in self.opts:
            opt.step()

    def pairs(self):
        """(name, torch's parameter, ours) for every parameter."""
        return [
            (name, a, b)
            for (name, a), b in zip(
                self.ref.module.named_parameters(), self.ours.module.parameters(), strict=True
            )
        ]


def accumulate(ddp: nn.Module, batches: list[torch.Tensor]) -> None:
    """Forward and backward over ``batches``, all but the last under ``ddp.no_sync()``."""
    for i, x in enumerate(batches):
        if i < len(batches) - 1:
            with ddp.no_sync():
                ddp(x).square().mean().backward()
        else:
            ddp(x).square().mean().backward()


def net_inputs(n: int, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """``n`` random micro-batches of Net's input (BATCH x D) on ``device``."""
    return [torch.randn(BATCH, D, device=device) for _ in range(n)]


def assert_same(a: torch.Tensor | None, b: torch.Tensor | None, what: str, exact: bool) -> None:
    """Equal bitwise (``exact``) or within 1e-5 relative; None only where the other is None."""
    assert (a is None) == (b is None), f"{what}: torch has {a is None and 'None'}, leanddp {b}"
    if a is None:
        return
    if exact:
        assert torch.equal(a, b), f"{what}: max abs difference {(a - b).abs().max().item()}"
    else:
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
