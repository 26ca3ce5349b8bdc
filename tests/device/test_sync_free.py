"""The training loop's hot path asks the host to wait for nothing, checked on the CPU.

On a GPU, `torch.cuda.set_sync_debug_mode("error")` catches host synchronizations
(tests/device/test_cuda_ddp_async.py). On the CPU nothing synchronizes, so the operations that
would are counted instead: a dispatch mode sees every tensor operation leanddp runs in the
forward glue, the C++ gradient hooks, the launches, the in-backward steps and the end of
backward, and records reads of a tensor's value on the host (`.item()`, `float(t)`:
`aten::_local_scalar_dense`) and blocking cross-device copies (`.to(device)` without
`non_blocking`, which from pageable memory waits for the device).
"""

from __future__ import annotations

import collections
import functools

import torch
from ddp_models import Net
from dist_harness import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

import leanddp

ITERATIONS = 3


class HostWaits(TorchDispatchMode):
    """Counts the operations a GPU would make the host wait for, and every operation seen (so a
    test can check that the mode saw leanddp's C++ code at all)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[str] = []
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        self.seen[name] += 1
        if name == "_local_scalar_dense":
            self.waits.append(name)
        elif (
            name == "_to_copy"
            and not kwargs.get("non_blocking", False)
            and (kwargs.get("device") is not None or kwargs.get("pin_memory"))
        ):
            self.waits.append(f"{name}(device={kwargs.get('device')}, non_blocking=False)")
        return func(*args, **kwargs)


CONFIGS = {
    "views": {},
    "find_unused": {"find_unused_parameters": True},
    "in_backward": {
        "optimizer_in_backward": functools.partial(torch.optim.AdamW, lr=1e-3, fused=True)
    },
    "offload": {
        "optimizer_in_backward": functools.partial(torch.optim.AdamW, lr=1e-3),
        "offload_to_cpu": True,
    },
}


def _count(rank: int, world_size: int) -> None:
    for name, kwargs in CONFIGS.items():
        ddp = leanddp.DistributedDataParallel(
            Net(rank=rank, f64=False), bucket_cap_mb=0.0005, **kwargs
        )
        x = torch.randn(6, 12)
        for _ in range(3):  # the bucket rebuild (a broadcast read on the host) happens here
            ddp(x).square().mean().backward()
        ddp.synchronize()
        mode = HostWaits()
        with mode:
            for _ in range(ITERATIONS):
                with ddp.no_sync():
                    ddp(x).square().mean().backward()
                ddp(x).square().mean().backward()
                if "optimizer_in_backward" not in kwargs:
                    for p in ddp.module.parameters():
                        p.grad = None
        # the mode saw leanddp's own kernels, run from the C++ hooks
        assert mode.seen["flatten_into"] > 0, (name, mode.seen)
        if name == "in_backward":
            assert mode.seen["adam_step_"] > 0, (name, mode.seen)
        assert mode.waits == [], (name, mode.waits)


def test_hot_path_reads_nothing_back() -> None:
    run_ranks(2, _count)
