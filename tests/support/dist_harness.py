"""Runs a test body in several processes with a gloo process group, and re-raises failures.

``run_ranks(world_size, fn, *args)`` starts ``world_size`` processes (forked from a server that
has imported torch and leanddp once: ``START_METHOD``); each initialises the default group
(gloo, or ``backend=``) on a fresh TCP port and calls ``fn(rank, world_size, *args)``. ``fn``
must be a module-level function (it is pickled by name). A failure on any rank fails the test
with that rank's traceback. A hang in a collective is cut off by the process group timeout; any
other hang (a thread the exit waits for, a lock) by ``RANK_DEADLINE_S``: the ranks write every
thread's stack (faulthandler, to a file per rank), are killed, their stacks are printed rank by
rank, and the test fails with ``TimeoutError`` (benchmarks/_ranks.py's dump, which the
benchmarks' ranks use too).

A rank that finished ``fn`` and tore its group down leaves through ``leave()``: the exit
handlers run (atexit, ``weakref.finalize``: where leanddp closes a wrapper still alive), then
the process ends without finalizing the interpreter. Finalization would only free what is left
(a wrapper a test keeps alive holds its process group, and gloo's threads, into it), and torch
can abort there after the test passed (docs/troubleshooting.md, "terminate called without an
active exception"); test_exit.py runs leanddp through a real interpreter exit in subprocesses.
An abort or exception before that point (in ``fn``, in the teardown, in an exit handler) still
fails the test.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from leanddp._lifetime import leave

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _ranks import arm_stack_dump, join_by_deadline  # noqa: E402 (the deadline's stack dumps)
from _ranks import free_port as _free_port  # noqa: E402
from _ranks import run_ranks as run_processes  # noqa: E402, F401 (re-exported: own groups)

#: How ranks start: forked from multiprocessing's fork server, a process started once that has
#: imported torch and leanddp (START_PRELOAD), rather than each a fresh interpreter that imports
#: them again (spawn: about 5 s per run of two ranks on the 2-core CI machine, against 0.05 s).
#: The server touches no CUDA (importing torch and leanddp does not), so a rank initialises CUDA
#: itself as under spawn; what a rank inherits from the server is the environment and sys.path
#: pytest started with (conftest.py's folders included), not later changes to os.environ.
START_METHOD = "forkserver"
START_PRELOAD = ["torch", "torch.distributed", "leanddp", "pytest", "dist_harness"]
mp.set_forkserver_preload(START_PRELOAD)  # (before the server starts: at the first run)

#: Collectives fail instead of hanging after this long.
TIMEOUT = datetime.timedelta(seconds=60)
#: A run of ranks that has not ended after this long is dumped, killed and failed (seconds; the
#: longest run in the suite takes about a minute).
RANK_DEADLINE_S = float(os.environ.get("LEANDDP_TEST_RANK_DEADLINE_S", "600"))


def init_rank(
    rank: int,
    world_size: int,
    port: int,
    timeout: datetime.timedelta,
    backend: str = "gloo",
    set_device: bool = True,
) -> None:
    """One thread, and the default group of ``world_size`` ranks on 127.0.0.1:``port`` (NCCL:
    rank r uses GPU r, made the current device unless ``set_device`` is False)."""
    os.environ["LEANDDP_TEST_RANK"] = str(rank)
    torch.set_num_threads(1)
    if backend == "nccl" and set_device:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def _entry(
    rank: int,
    world_size: int,
    port: int,
    seed: int,
    fn: Callable,
    args: tuple,
    folder: str,
    backend: str = "gloo",
    set_device: bool = True,
) -> None:
    arm_stack_dump(folder, rank)  # run_ranks's deadline
    init_rank(rank, world_size, port, TIMEOUT, backend, set_device)
    try:
        torch.manual_seed(seed + 1000 * rank)
        fn(rank, world_size, *args)
        # A wrapper caught in a reference cycle (a test's hook closing over it) is freed here, as
        # reference counting frees the others when fn returns, rather than during interpreter
        # finalization with the process group it holds.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave()  # only once fn, its checks and the teardown all succeeded


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    set_device: bool = True,
) -> None:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks (see module doc)."""
    seed = int(torch.randint(0, 2**30, ()).item())
    with tempfile.TemporaryDirectory(prefix="ranks-stacks-") as folder:
        ranks = mp.start_processes(
            _entry,
            args=(world_size, _free_port(), seed, fn, args, folder, backend, set_device),
            nprocs=world_size,
            join=False,
            start_method=START_METHOD,
        )
        join_by_deadline(
            ranks, folder, RANK_DEADLINE_S, fn.__name__, "LEANDDP_TEST_RANK_DEADLINE_S"
        )
