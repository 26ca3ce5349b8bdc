"""Runs a function on local ranks in fresh processes, under a deadline (for the benchmarks).

The same contract as tests/support/dist_harness.py's ``run_ranks`` (which benchmarks do not
import): a rank that raises fails the run with its traceback (torch's ``ProcessContext.join``);
ranks still running after ``deadline_s`` (a hang a process group timeout does not cut off: a
thread the exit waits for, a lock, a collective with a long timeout) print every thread's stack
to their stderr (faulthandler on SIGUSR1), are killed, and the run raises ``TimeoutError``.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

#: How long the ranks get, after SIGUSR1, to write their stacks before they are killed (seconds).
DUMP_GRACE_S = 2.0
#: How often the parent wakes up to check the deadline while it waits for the ranks (seconds).
POLL_S = 5.0


def _entry(rank: int, fn: Callable[..., Any], args: tuple) -> None:
    """A rank's first call: stacks on SIGUSR1 (the deadline's), then ``fn(rank, *args)``."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    fn(rank, *args)


def run_ranks(
    nprocs: int,
    fn: Callable[..., Any],
    args: tuple,
    deadline_s: float,
    what: str,
    start_method: str = "spawn",
) -> None:
    """Runs ``fn(rank, *args)`` in ``nprocs`` processes (``fn`` module-level, for spawn) and
    waits for them all; raises what a rank raised, or ``TimeoutError`` naming ``what`` once
    ``deadline_s`` seconds have passed (see module doc)."""
    ranks = mp.start_processes(
        _entry, args=(fn, args), nprocs=nprocs, join=False, start_method=start_method
    )
    deadline = time.monotonic() + deadline_s
    while not ranks.join(timeout=max(0.0, min(POLL_S, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            _kill_hung(ranks.processes, what, deadline_s)


def _kill_hung(processes: list, what: str, deadline_s: float) -> None:
    """Has the ranks still running print their threads' stacks, kills them, and raises."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(DUMP_GRACE_S)  # faulthandler writes to the rank's stderr
    for p in alive:
        p.kill()
        p.join()
    raise TimeoutError(
        f"{what}: {len(alive)} rank(s) still running after the deadline of {deadline_s:.0f} s "
        "(--deadline-s); killed, their threads' stacks are on stderr above"
    )
