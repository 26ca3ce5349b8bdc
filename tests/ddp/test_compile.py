"""torch.compile with leanddp: a compiled module wrapped in leanddp, and a leanddp-wrapped module
passed to torch.compile, train with the numbers of torch's eager DDP + AdamW (gloo, 2 ranks)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from torch import nn

import leanddp

GRAPHS: list[int] = []


def counting(gm: torch.fx.GraphModule, example_inputs, backend: str):
    """A backend that records each graph it is given, then compiles it with ``backend``."""
    GRAPHS.append(len(gm.graph.nodes))
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(backend)(gm, example_inputs)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )  # fmt: skip


def wrap(module: nn.Module, in_backward: bool) -> leanddp.DistributedDataParallel:
    kw = dict(process_group=dist.new_group(), bucket_cap_mb=0.005)  # several buckets
    if in_backward:
        kw["optimizer_in_backward"] = functools.partial(torch.optim.AdamW, lr=0.01)  # as torch's
    return leanddp.DistributedDataParallel(module, **kw)


def train_both(rank: int, world_size: int, where: str, in_backward: bool, backend: str) -> None:
    """Trains torch's eager DDP + AdamW and compiled leanddp side by side; aot_eager runs eager
    kernels
    (1e-5 relative), while inductor's fused kernels round differently from eager and AdamW
    turns a 1e-7 relative gradient difference into up to ~1e-4 of a step (1e-4 relative)."""
    tol = 1e-5 if backend == "aot_eager" else 1e-4
    GRAPHS.clear()
    compile_ = functools.partial(
        torch.compile, backend=functools.partial(counting, backend=backend)
    )
    eager = torch.nn.parallel.DistributedDataParallel(
        model(), process_group=dist.new_group(), bucket_cap_mb=0.005
    )
    if where == "inside":  # leanddp(torch.compile(model))
        compiled = wrap(compile_(model()), in_backward)
    else:  # torch.compile(leanddp(model))
        compiled = compile_(wrap(model(), in_backward))
    adamw = functools.partial(torch.optim.AdamW, lr=0.01)
    runs = [(eager, adamw(eager.parameters())),
            (compiled, None if in_backward else adamw(compiled.parameters()))]  # fmt: skip
    for step in range(4):
        batches = [torch.randn(8, 16) for _ in range(2)]
        for m, opt in runs:
            with m.no_sync():  # accumulation, then a synchronized backward
                m(batches[0]).square().mean().backward()
            m(batches[1]).square().mean().backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
        for (name, a), b in zip(
            eager.module.named_parameters(), compiled.parameters(), strict=True
        ):
            where_ = f"step {step} {name}"
            torch.testing.assert_close(b, a, rtol=tol, atol=tol / 10, msg=lambda m, w=where_: w + m)
    assert GRAPHS, "torch.compile compiled no graph: the module ran eagerly"
    # the parameters really moved, and equally on both ranks
    start = list(model().parameters())
    moved = max(
        (a - b).abs().max().item() for a, b in zip(compiled.parameters(), start, strict=True)
    )
    assert moved > 1e-3
    mine = torch.cat([p.detach().flatten() for p in compiled.parameters()])
    other = mine.clone()
    dist.broadcast(other, 0)
    assert torch.equal(mine, other)


@pytest.mark.parametrize("where", ["inside", "outside"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["optimizer", "in_backward"])
def test_compile_matches_eager(where: str, in_backward: bool) -> None:
    run_ranks(2, train_both, where, in_backward, "aot_eager")


@pytest.mark.slow
def test_compile_with_inductor_matches_eager() -> None:
    run_ranks(2, train_both, "outside", False, "inductor")
