"""A persistent pool of gloo ranks that run one example at a time, for property-based tests
whose examples are drawn (and shrunk) in the pytest process.

``RankPool.run(spec)`` hands ``spec`` to every rank, which calls
``property_models.run_example(spec, rank, groups)``; it returns the failures (one message with
the traceback per failing rank, or one saying which rank died or hung), empty if the example
passed. After any failure the ranks are stopped (one may be stuck in a collective its peer
never joined) and the next ``run`` starts fresh ones. Nothing waits without a time limit.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from typing import Any

import torch.multiprocessing as mp
from dist_harness import _free_port

#: Collectives fail instead of hanging after this long.
GLOO_TIMEOUT = datetime.timedelta(seconds=60)
#: How long one example may take, start-up of fresh ranks included.
EXAMPLE_TIMEOUT = 150.0
#: After one rank failed, how long its peers get to report before they are stopped.
GRACE = 5.0


def _worker(rank: int, world_size: int, port: int, inbox: Any, outbox: Any) -> None:
    """One rank: initialises gloo and two groups (torch's DDP and leanddp each get their own,
    reused by every example), then runs the examples it receives until it receives None."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")  # torch's DDP warns about find_unused_parameters etc.
    try:
        from dist_harness import init_rank
        from property_models import run_example

        init_rank(rank, world_size, port, GLOO_TIMEOUT)
        groups = (dist.new_group(timeout=GLOO_TIMEOUT), dist.new_group(timeout=GLOO_TIMEOUT))
    except BaseException:
        item = inbox.get(timeout=EXAMPLE_TIMEOUT)
        outbox.put((item[0] if item else -1, rank, "start-up failed:\n" + traceback.format_exc()))
        return
    parent = os.getppid()
    while True:
        try:
            item = inbox.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # pytest was killed: do not linger
                return
            continue
        if item is None:
            break
        number, spec = item
        try:
            run_example(spec, rank, groups)
            dist.barrier(group=groups[0])  # both ranks leave the example together
            outbox.put((number, rank, None))
        except BaseException:
            outbox.put((number, rank, traceback.format_exc()))
            return  # the pool is restarted after a failure
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.inboxes: list[Any] = []
        self.examples = 0  # how many examples ran
        self.starts = 0  # how many times ranks were started

    def _start(self) -> None:
        port = _free_port()
        self.inboxes = [self.ctx.Queue() for _ in range(self.world_size)]
        self.outbox = self.ctx.Queue()
        self.procs = [
            self.ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, self.inboxes[rank], self.outbox),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        # torch's C++ warnings (find_unused_parameters=True without unused parameters...) would
        # flood the output: the ranks log errors only, unless told otherwise.
        quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
        if quiet:
            os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        try:
            for p in self.procs:
                p.start()
        finally:
            if quiet:
                del os.environ["TORCH_CPP_LOG_LEVEL"]
        self.starts += 1

    def run(self, spec: Any) -> list[str]:
        """Runs ``spec`` on every rank; returns the failures (empty: it passed)."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.stop()
            self._start()
        self.examples += 1
        number = self.examples
        for inbox in self.inboxes:
            inbox.put((number, spec))
        results: dict[int, str | None] = {}
        deadline = time.monotonic() + EXAMPLE_TIMEOUT
        while len(results) < self.world_size and time.monotonic() < deadline:
            try:
                got, rank, message = self.outbox.get(timeout=0.5)
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(self.procs) if r not in results and not p.is_alive()
                ]
                for r in dead:  # a crash, not an exception: no traceback came back
                    results[r] = f"rank {r} died (exit code {self.procs[r].exitcode})"
                    deadline = min(deadline, time.monotonic() + GRACE)
                continue
            if got != number:
                continue  # cannot happen: the queues are new after every failure
            results[rank] = message
            if message is not None:
                deadline = min(deadline, time.monotonic() + GRACE)
        failures = [f"rank {r}:\n{m}" for r, m in sorted(results.items()) if m is not None]
        for r in range(self.world_size):
            if r not in results:
                failures.append(f"rank {r}: no result (hung, or waiting for a failed peer)")
        if failures:
            self.stop(graceful=False)
        return failures

    def stop(self, graceful: bool = True) -> None:
        """Stops the ranks: asks them to finish (``graceful``), then terminates what is left."""
        if graceful:
            for inbox, p in zip(self.inboxes, self.procs, strict=True):
                if p.is_alive():
                    inbox.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs, self.inboxes = [], []
