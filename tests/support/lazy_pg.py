"""A process group with NCCL's host-side semantics on top of gloo, for tests on the CPU.

With NCCL, autograd's hooks run far ahead of the GPU: when the host asks whether a reduction is
done (``Work::isCompleted()``), the answer is almost always no. ``LazyGroup`` reproduces that on
the CPU: it forwards every collective to a gloo group, and its works report not completed until
they are waited for (from C++, torch's trampoline for works written in Python never reports them
completed at all). It records the order in which reductions are launched and waited for.

Register it in each rank's process with :func:`register`, then build one with
``dist.new_group(backend=LAZY_BACKEND)``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

LAZY_BACKEND = "lazygloo"


class LazyWork(dist._Work):
    """A gloo work that reports done only once waited for."""

    def __init__(self, inner: dist.Work, group: LazyGroup, key: int | None) -> None:
        super().__init__()
        self._inner = inner
        self._group = group
        self._key = key
        self._waited = False

    def wait(self, timeout: Any = None) -> bool:
        self._inner.wait()
        if not self._waited and self._key is not None:
            self._group.waits.append(self._key)
        self._waited = True
        return True

    def is_completed(self) -> bool:
        return self._waited

    def get_future(self) -> Any:
        return self._inner.get_future()


class LazyGroup(dist.ProcessGroup):
    """Forwards to a gloo group; allreduces are numbered in launch order (``launches``), and
    ``waits`` lists their numbers in the order they were first waited for."""

    def __init__(self, inner: dist.ProcessGroup) -> None:
        super().__init__(inner.rank(), inner.size())
        self._inner = inner
        self.launches: list[int] = []
        self.waits: list[int] = []

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return LAZY_BACKEND

    def allreduce(self, tensors: Any, opts: Any) -> LazyWork:
        key = len(self.launches)
        self.launches.append(key)
        return LazyWork(self._inner.allreduce(tensors, opts), self, key)

    def broadcast(self, tensors: Any, opts: Any) -> LazyWork:
        return LazyWork(self._inner.broadcast(tensors, opts), self, None)

    def allgather(self, outputs: Any, inputs: Any, opts: Any) -> LazyWork:
        return LazyWork(self._inner.allgather(outputs, inputs, opts), self, None)

    def barrier(self, opts: Any) -> LazyWork:
        return LazyWork(self._inner.barrier(opts), self, None)


def register() -> None:
    """Makes ``dist.new_group(backend=LAZY_BACKEND)`` build a LazyGroup over gloo."""
    if hasattr(dist.Backend, LAZY_BACKEND.upper()):
        return
    dist.Backend.register_backend(
        LAZY_BACKEND,
        lambda store, rank, size, timeout: LazyGroup(
            dist.ProcessGroupGloo(store, rank, size, timeout)
        ),
        devices=["cpu"],
    )
