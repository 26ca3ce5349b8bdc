"""Runs a body on several gloo ranks where ranks may die, raise or hang on purpose.

``run_faulty(world_size, fn, *args)`` starts ``world_size`` processes; each initialises the
default group, makes a group whose collectives time out after ``PG_TIMEOUT`` (``group()``: the
one to train on) and calls ``fn(rank, world_size, *args)``.
Unlike dist_harness.run_ranks, a rank's exception or death is a result, not a failure: every
rank's outcome comes back as an ``Outcome``. Ranks still running after ``limit`` seconds are
killed and the call fails: a hang is a test failure.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_harness import START_METHOD, _free_port, init_rank

#: Collectives of group() fail after this long (a rank that raised and stays alive).
PG_TIMEOUT = datetime.timedelta(seconds=2)
#: The default group's timeout: process start-up on a busy machine may skew by seconds.
STARTUP_TIMEOUT = datetime.timedelta(seconds=120)
_group: dist.ProcessGroup | None = None


def group() -> dist.ProcessGroup:
    """This rank's group with the short timeout."""
    assert _group is not None
    return _group


@dataclasses.dataclass
class Outcome:
    rank: int
    value: Any = None  # what fn returned
    error: str | None = None  # type name of what it raised
    message: str = ""
    died: bool = False  # exited without reporting (os._exit, a crash)


def _entry(rank: int, world_size: int, port: int, results: Any, fn: Callable, args: tuple) -> None:
    global _group
    try:
        init_rank(rank, world_size, port, STARTUP_TIMEOUT)
        _group = dist.new_group(timeout=PG_TIMEOUT)
        torch.manual_seed(1234 + rank)
        results.put(Outcome(rank, value=fn(rank, world_size, *args)))
    except BaseException as e:  # the outcome under test
        message = f"{e}\n{traceback.format_exc()}"
        results.put(Outcome(rank, error=type(e).__name__, message=message))
    results.close()
    results.join_thread()  # the outcome is sent before the exit below
    # Leave without destroy_process_group: a peer may be dead or waiting on us.
    os._exit(0)


def run_faulty(world_size: int, fn: Callable[..., Any], *args: Any, limit: float = 90) -> list:
    """Every rank's Outcome, in rank order (see module doc)."""
    ctx = mp.get_context(START_METHOD)
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, results, fn, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, Outcome] = {}
    deadline = time.monotonic() + limit
    while len(outcomes) < world_size and time.monotonic() < deadline:
        try:
            got = results.get(timeout=0.5)
            outcomes[got.rank] = got
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                try:  # a last result may still be in flight
                    got = results.get(timeout=2)
                    outcomes[got.rank] = got
                    continue
                except queue.Empty:
                    break
    hung = [r for r, p in enumerate(procs) if p.is_alive() and r not in outcomes]
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung for {limit} s"
    return [outcomes.get(r, Outcome(r, died=True)) for r in range(world_size)]
