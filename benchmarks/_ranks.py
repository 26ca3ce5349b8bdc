"""Runs a function on local ranks in fresh processes, under a deadline (for the benchmarks).

The same contract as tests/support/dist_harness.py's ``run_ranks``, which shares this module's
stack dumps (benchmarks import nothing of the tests): a rank that raises fails the run with its
traceback (torch's ``ProcessContext.join``); ranks still running after ``deadline_s`` (a hang a
process group timeout does not cut off: a thread the exit waits for, a lock, a collective with a
long timeout) write every thread's stack (faulthandler on SIGUSR1), are killed, their stacks are
printed to stderr rank by rank, and the run raises ``TimeoutError``.

Each rank writes its stacks to a file of its own, not to the stderr the ranks share: two ranks
dumping at once interleave their writes there (faulthandler writes a frame in several pieces),
and a line such as ``line 355 in worker`` can come out in fragments of both.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch.multiprocessing as mp

#: How long the ranks get, after SIGUSR1, to write their stacks before they are killed (seconds).
DUMP_GRACE_S = 2.0
#: How often the parent wakes up to check the deadline while it waits for the ranks (seconds).
POLL_S = 5.0

#: This rank's stack file, open for faulthandler for the process's life (arm_stack_dump).
_stack_file: IO[str] | None = None


def arm_stack_dump(folder: str, rank: int) -> None:
    """In a rank: on SIGUSR1, every thread's stack goes to ``folder``'s file for ``rank``."""
    global _stack_file
    _stack_file = open(Path(folder) / f"rank{rank}.stacks", "w")  # noqa: SIM115 (kept open)
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def dump_and_kill(processes: list, folder: str) -> int:
    """Has the ranks still running write their stacks (``arm_stack_dump``), kills them, prints
    each one's stacks to stderr under its rank, and returns how many were still running."""
    alive = [(rank, p) for rank, p in enumerate(processes) if p.is_alive()]
    for _, p in alive:
        os.kill(p.pid, signal.SIGUSR1)
    time.sleep(DUMP_GRACE_S)
    for _, p in alive:
        p.kill()
        p.join()
    for rank, _ in alive:
        path = Path(folder) / f"rank{rank}.stacks"
        stacks = path.read_text() if path.exists() else ""
        print(f"--- rank {rank}'s threads at the deadline ---\n{stacks or '(none written)'}",
              file=sys.stderr, flush=True)  # fmt: skip
    return len(alive)


def join_by_deadline(ranks: Any, folder: str, deadline_s: float, what: str, knob: str) -> None:
    """Waits for every rank of ``ranks`` (torch's ``ProcessContext``), raising what one raised;
    once ``deadline_s`` seconds have passed, the ranks still running are dumped and killed
    (``dump_and_kill``) and ``TimeoutError`` names ``what`` and ``knob``, the deadline's setting."""
    deadline = time.monotonic() + deadline_s
    while not ranks.join(timeout=max(0.0, min(POLL_S, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            alive = dump_and_kill(ranks.processes, folder)
            raise TimeoutError(
                f"{what}: {alive} rank(s) still running after the deadline of {deadline_s:.0f} s "
                f"({knob}); killed, their threads' stacks are on stderr above"
            )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], args: tuple, folder: str) -> None:
    """A rank's first call: stacks on SIGUSR1 (the deadline's), then ``fn(rank, *args)``."""
    arm_stack_dump(folder, rank)
    fn(rank, *args)


def run_ranks(
    nprocs: int,
    fn: Callable[..., Any],
    args: tuple,
    deadline_s: float,
    what: str,
    start_method: str = "spawn",
    knob: str = "--deadline-s",
) -> None:
    """Runs ``fn(rank, *args)`` in ``nprocs`` processes (``fn`` module-level, for spawn) and
    waits for them all; raises what a rank raised, or ``TimeoutError`` naming ``what`` and
    ``knob`` (the deadline's setting) once ``deadline_s`` seconds have passed (see module doc)."""
    with tempfile.TemporaryDirectory(prefix="ranks-stacks-") as folder:
        ranks = mp.start_processes(
            _entry, args=(fn, args, folder), nprocs=nprocs, join=False, start_method=start_method
        )
        join_by_deadline(ranks, folder, deadline_s, what, knob)
