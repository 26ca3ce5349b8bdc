"""Optimizer factories and a lock-step trainer comparing optimizer_in_backward against torch's
DDP followed by the same torch optimizer, in the same processes on the same data."""

from __future__ import annotations

import contextlib
import copy
import functools
import io
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from ddp_models import accumulate
from torch import nn

import leanddp

Factory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def grouped(cls: type, **kwargs) -> Factory:
    """A factory with two param groups: matrices with weight decay, the rest without it and at
    twice the learning rate (the usual no-decay-on-biases-and-norms split)."""

    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        decay = [p for p in params if p.ndim >= 2]
        rest = [p for p in params if p.ndim < 2]
        return cls(
            [{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 2 * kwargs["lr"]}],
            **kwargs,
        )

    return make


OPTIMIZERS: dict[str, Factory] = {
    "sgd-nesterov": functools.partial(
        torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
    "sgd-dampening": functools.partial(
        torch.optim.SGD, lr=0.05, momentum=0.5, dampening=0.2, weight_decay=0.01, maximize=True
    ),
    "sgd-plain": functools.partial(torch.optim.SGD, lr=0.05),
    "adam": functools.partial(torch.optim.Adam, lr=0.01, weight_decay=0.01),
    "adamw": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
    "adamw-groups": grouped(torch.optim.AdamW, lr=0.01, weight_decay=0.1),
    "sgd-groups": grouped(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adagrad": functools.partial(torch.optim.Adagrad, lr=0.05),  # no fused kernel: fallback
    "adamw-amsgrad": functools.partial(torch.optim.AdamW, lr=0.01, amsgrad=True),  # fallback
}


def reference_optimizer(factory: Factory, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """``factory(params)`` for torch's side of a comparison; Adam(W) on the CPU with torch's
    fused kernel, which leanddp's kernels equal bit for bit. torch's default (single-tensor)
    path differs from it in the last bits, and Adam makes a step of up to lr out of a last-bit
    difference where a gradient is rounding noise: Net's enc.bias where a ReLU unit is active on
    the whole batch, whose gradient BatchNorm makes zero in exact arithmetic."""
    opt = factory(params)
    cpu = all(p.device.type == "cpu" for g in opt.param_groups for p in g["params"])
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW) and cpu and not opt.state:
        for group in [*opt.param_groups, opt.defaults]:  # (read at each step)
            group.update(fused=True, foreach=False)
    return opt


class Deep(nn.Module):
    """Twelve equal ``width`` x ``width`` layers: with a bucket cap of one layer's bytes
    (``LAYER_BYTES`` at the default width), one bucket per layer."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


#: Bytes of one of Deep's layers (float32).
LAYER_BYTES = 32 * 32 * 4


def scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


class InBackwardLockStep:
    """torch's DDP + ``factory``'s optimizer (+ an LR scheduler) against leanddp with
    ``optimizer_in_backward=factory`` (+ the same scheduler on ``ddp.optimizer``), each on its
    own process group. ``offload``: ours with offload_to_cpu=True; ``max_grad_norm``: ours
    clips with it (offload), torch's side with clip_grad_norm_ before its step. ``ours_kwargs``:
    passed to leanddp's wrapper only (``ddp_kwargs`` to both). ``fused_reference``: torch's side
    steps with its fused kernel (reference_optimizer); False where a test needs ``factory``'s
    optimizer exactly as the user builds it (its checkpoint format, param_groups included).
    ``reference_context``: what torch's side steps inside (lowbit_models.reference_numerics)."""

    def __init__(
        self,
        model: nn.Module,
        factory: Factory,
        with_scheduler: bool = True,
        offload: bool = False,
        max_grad_norm: float | None = None,
        offload_threads: int | None = None,
        ours_kwargs: dict | None = None,
        fused_reference: bool = True,
        reference_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        **ddp_kwargs,
    ) -> None:
        self.ref = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(model), process_group=dist.new_group(), **ddp_kwargs
        )
        params = self.ref.module.parameters()
        self.ref_opt = reference_optimizer(factory, params) if fused_reference else factory(params)
        self.ours = leanddp.DistributedDataParallel(
            copy.deepcopy(model),
            process_group=dist.new_group(),
            optimizer_in_backward=factory,
            **(
                dict(
                    offload_to_cpu=True,
                    max_grad_norm=max_grad_norm,
                    offload_threads=offload_threads,
                )
                if offload
                else {}
            ),
            **(ours_kwargs or {}),
            **ddp_kwargs,
        )
        self.max_grad_norm = max_grad_norm
        self.reference_context = reference_context or contextlib.nullcontext
        self.ref_norm: float | None = None
        self.scheds = (
            [scheduler(self.ref_opt), scheduler(self.ours.optimizer)] if with_scheduler else []
        )

    def step(self, batches: list[torch.Tensor], legacy_calls: bool = False) -> None:
        """One optimizer step over ``batches`` (all but the last under no_sync) on both.
        ``legacy_calls``: our loop also calls optimizer.step() and zero_grad(), as an
        unchanged training loop would."""
        for ddp in (self.ref, self.ours):
            accumulate(ddp, batches)
        if self.max_grad_norm is not None:
            params = self.ref.module.parameters()
            self.ref_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        with self.reference_context():
            self.ref_opt.step()
        self.ref_opt.zero_grad()
        if legacy_calls:
            self.ours.optimizer.step()
            self.ours.optimizer.zero_grad()
        for s in self.scheds:
            s.step()

    def pairs(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, torch's parameter, ours), ours read through ``state_dict()``, which waits for
        offload_to_cpu's host steps."""
        ours = self.ours.module.state_dict(keep_vars=True)
        return [(name, a, ours[name]) for name, a in self.ref.module.named_parameters()]


def train_lock_step(
    run: InBackwardLockStep,
    what: str,
    accum: int,
    steps: int,
    static: bool = False,
    exact: bool = False,
) -> None:
    """``steps`` optimizer steps of ``accum`` micro-batches each (one in a static graph's first
    step: torch's DDP asserts when that one runs under no_sync), every other one with the loop's
    legacy calls; after each, every gradient and bucket of ours is released and the parameters
    are within 1e-5 of torch's (``exact``: equal to them)."""
    for step in range(steps):
        n = 1 if static and step == 0 else accum
        run.step([torch.randn(6, 12) for _ in range(n)], legacy_calls=step % 2 == 1)
        for p in run.ours.module.parameters():
            assert p.grad is None, f"{what} step {step}: a gradient survived the in-backward step"
        assert run.ours.memory_stats()["bucket_bytes"] == 0, f"{what}: buckets not released"
        assert_params_close(run, f"{what} step {step}", exact)


def completed_allreduce_hook(state, bucket):  # (string annotations fail torch's hook check)
    """A comm hook whose reduction is complete when it returns (averaged over ``state``, the
    default group if None), so each bucket is stepped at its launch: in flight is always 1."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=state)
    buffer.div_(dist.get_world_size(state))
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def assert_params_close(run: InBackwardLockStep, what: str, exact: bool = False) -> None:
    """Ours within 1e-5 of torch's parameters, or (``exact``) equal to them bit for bit."""
    tol = dict(rtol=0.0, atol=0.0) if exact else dict(rtol=1e-5, atol=1e-6)
    for name, a, b in run.pairs():
        torch.testing.assert_close(b, a, **tol, msg=lambda m, name=name: f"{what} {name}: {m}")


def round_trip(state_dict: dict) -> dict:
    """``state_dict`` through torch.save and torch.load (weights only), as a checkpoint file
    takes it."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)
