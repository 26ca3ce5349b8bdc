"""Checks an installed leanddp from outside its source tree: what a user gets from the wheel or
the source distribution.

    cd /somewhere/else && python /path/to/smoke_installed.py

Fails (exit 1, with the reason) unless leanddp imports from site-packages with its compiled
kernels; ``leanddp.__version__``, the package metadata and ``build_info()["version"]`` agree; the
metadata requires the torch the extension was compiled against; one op (flatten, and an AdamW
step against ``torch.optim.AdamW(fused=True)``) gives torch's results; and one training step of
two gloo ranks gives torch's DDP's parameters.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def check(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"smoke_installed: FAILED: {what}")
    print(f"ok: {what}")


def installed() -> None:
    import leanddp

    where = Path(leanddp.__file__).resolve()
    check("site-packages" in where.parts, f"leanddp imports from site-packages ({where.parent})")
    meta = importlib.metadata.version("leanddp")
    built = leanddp.build_info()["version"]
    check(
        leanddp.__version__ == meta == built,
        f"one version: __version__ {leanddp.__version__}, metadata {meta}, build_info {built}",
    )
    wanted = f"torch=={torch.__version__.split('+')[0]}"
    requires = importlib.metadata.requires("leanddp") or []
    check(wanted in requires, f"the metadata requires {wanted} (it says {requires})")


def one_op() -> None:
    from leanddp import ops

    tensors = [torch.randn(7, 3), torch.randn(129), torch.randn(2, 2, 5)]
    flat = torch.empty(sum(t.numel() for t in tensors))
    ops.flatten_into(tensors, flat)
    check(torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors])), "flatten = torch.cat")

    ours = nn.Parameter(torch.randn(1000))
    ref = nn.Parameter(ours.detach().clone())
    grad = torch.randn(1000)
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, fused=True)
    m, v = torch.zeros(1000), torch.zeros(1000)
    for step in range(1, 4):
        ref.grad = grad * step
        opt.step()
        ops.adamw_step_(
            [ours.data],
            [grad * step],
            [m],
            [v],
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            step=step,
        )
    check(torch.equal(ours, ref), "three AdamW steps = torch.optim.AdamW(fused=True), bitwise")


def train(r: int) -> bool:
    """One SGD step of leanddp's DDP and of torch's on twin models: equal parameters after."""
    import leanddp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    twin = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    twin.load_state_dict(model.state_dict())
    ours = leanddp.DistributedDataParallel(model)
    ref = nn.parallel.DistributedDataParallel(twin)
    torch.manual_seed(1 + r)
    x = torch.randn(8, 16)
    for ddp in (ours, ref):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp(x).square().sum().backward()
        opt.step()
    pairs = zip(model.parameters(), twin.parameters(), strict=True)
    return all(torch.equal(a, b) for a, b in pairs)


def rank(r: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    same = train(r)
    # the wrappers are gone with train's frame; every collective is done before the group is
    # destroyed (gloo's worker thread must not still be releasing a finished one)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"rank{r}").write_text("same" if same else "different")


def two_ranks() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank, args=(port, out), nprocs=2, start_method="spawn")
        results = [Path(out, f"rank{r}").read_text() for r in range(2)]
    check(results == ["same", "same"], f"a 2-rank step = torch's DDP's (ranks: {results})")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    installed()
    one_op()
    two_ranks()
    print("smoke_installed: every check passed")
