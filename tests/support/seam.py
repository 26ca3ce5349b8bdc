"""The host-ordering seam (csrc/streams.h) for tests: CPU tensors ordered as if on a GPU.

Host ordering is read where the Reducer, the in-backward optimizer and HostOffload decide how
they order work, at construction: turn it on around building the wrapper (:func:`host_ordered`).
Its streams and events are counted (``_C._testing.host_ordering_counts()``), so a test can tell
which device-ordered branches ran (:func:`counts_moved`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from leanddp._extension import _C

T = TypeVar("T")


def host_ordered(build: Callable[[], T]) -> T:
    """``build()`` with host ordering on (read at construction), then off again."""
    _C._testing.set_host_ordering(True)
    try:
        return build()
    finally:
        _C._testing.set_host_ordering(False)


def counts_moved(before: dict, what: str, *keys: str) -> None:
    """Asserts that each of host ordering's counts ``keys`` grew since ``before``."""
    after = _C._testing.host_ordering_counts()
    for key in keys:
        assert after[key] > before[key], f"{what}: no {key} under host ordering ({after})"


def events_created(ddp: Any) -> int:
    """CUDA (or host-ordering) events the wrapper made so far for ordering its work: the
    Reducer's and its in-backward optimizer's (pooled, so constant once every bucket went
    through a step)."""
    core = ddp._optimizer_core
    return int(ddp.reducer.events_created()) + (int(core.events_created()) if core else 0)
