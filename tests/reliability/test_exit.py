"""The end of a wrapper's life: dropped, it is freed by reference counting (its buckets, optimizer
state and process group with it); still alive at interpreter exit, its Reducer lets go of the
process group, in-flight works and Python hook and stepper at exit, before finalization, and a
later synchronized forward raises a clear error.

And the end of a test rank (dist_harness): one that finished and tore its group down exits 0
after its exit handlers, without finalizing the interpreter, where torch can abort after the
work is done ("terminate called without an active exception", docs/troubleshooting.md); an
abort or exception before that still fails the test, with its traceback."""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import functools
import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import dist_harness
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_harness import _free_port, run_ranks
from torch import nn

import leanddp

ADAGRAD = functools.partial(torch.optim.Adagrad, lr=1e-2)  # stepped by the Python stepper
IDLE_POOLS: list[concurrent.futures.ThreadPoolExecutor] = []


def _dropped(rank: int, world_size: int) -> None:
    gc.disable()  # only reference counting frees what follows
    try:
        for kwargs in ({"optimizer_in_backward": ADAGRAD}, {}):
            ddp = leanddp.DistributedDataParallel(nn.Linear(4, 2), **kwargs)
            ddp(torch.randn(3, 4)).sum().backward()
            wrapper, reducer = weakref.ref(ddp), ddp.reducer
            del ddp
            assert wrapper() is None, f"the wrapper ({kwargs}) outlived its last reference"
            assert reducer.closed()
    finally:
        gc.enable()


def test_a_dropped_wrapper_is_freed_and_closed() -> None:
    """The first one built in a process too (its optimizer is the process's first)."""
    run_ranks(1, _dropped)


_ALIVE_AT_EXIT = """
import os, weakref
import torch, torch.distributed as dist
from torch import nn
import leanddp

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)

class Witness:
    pass

def report():
    # Runs at exit after the wrapper's own exit-time close (finalizers run newest first).
    print("closed", ddp.reducer.closed(), flush=True)
    dropped = ddp.process_group is None and ddp._config.process_group is None
    print("group dropped", dropped and not ddp._comm_hooks, flush=True)
    print("weight", torch.isfinite(ddp.module.weight).all().item(), flush=True)
    try:
        ddp(torch.randn(3, 4)).sum().backward()
    except RuntimeError as e:
        print("raised", str(e), flush=True)

witness = Witness()
weakref.finalize(witness, report)
ddp = leanddp.DistributedDataParallel(
    nn.Linear(4, 2), optimizer_in_backward=lambda p: torch.optim.Adagrad(p, lr=0.1)
)
ddp.register_comm_hook(None, lambda state, bucket: dist.all_reduce(
    bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0]))
for _ in range(3):
    ddp(torch.randn(3, 4)).sum().backward()
dist.destroy_process_group()
"""


def test_alive_at_exit_is_closed_before_finalization(tmp_path) -> None:
    script = tmp_path / "alive_at_exit.py"
    script.write_text(textwrap.dedent(_ALIVE_AT_EXIT).format(port=_free_port()))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "closed True" in lines and "weight True" in lines, done.stdout
    assert "group dropped True" in lines, done.stdout  # the wrapper's own references too
    raised = [line for line in lines if line.startswith("raised")]
    assert raised and "after the wrapper was closed" in raised[0], done.stdout


def _close_twice(rank: int, world_size: int) -> None:
    ddp = leanddp.DistributedDataParallel(nn.Linear(4, 2), optimizer_in_backward=ADAGRAD)
    ddp(torch.randn(3, 4)).sum().backward()
    ddp.reducer.close()
    ddp.reducer.close()
    assert ddp.reducer.closed()
    with pytest.raises(RuntimeError, match="after the wrapper was closed"):
        ddp(torch.randn(3, 4)).sum().backward()


def test_close_is_idempotent_and_a_closed_wrapper_refuses_to_reduce() -> None:
    run_ranks(1, _close_twice)


def _abort_in_c_exit_handlers() -> None:
    """abort() as a C exit handler: it runs only if the process finalizes the interpreter and
    exits through exit(), as torch's late aborts do."""
    libc = ctypes.CDLL(None)
    libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)


def _finishes(rank: int, world_size: int, marks: str) -> None:
    _abort_in_c_exit_handlers()
    atexit.register(lambda: open(f"{marks}.{rank}", "w").close())
    ddp = leanddp.DistributedDataParallel(nn.Linear(4, 2), optimizer_in_backward=ADAGRAD)
    ddp(torch.randn(3, 4)).sum().backward()
    # an idle pool never shut down, as torch.compile's inductor leaves its compile pool: its
    # non-daemon workers end only once threading's exit callbacks have told them to
    IDLE_POOLS.append(concurrent.futures.ThreadPoolExecutor(2))  # alive until the exit
    assert list(IDLE_POOLS[-1].map(abs, [-1, -2])) == [1, 2]


def test_a_finished_rank_runs_its_exit_handlers_and_skips_finalization(tmp_path) -> None:
    marks = tmp_path / "atexit"
    run_ranks(2, _finishes, str(marks))  # no SIGABRT from the C exit handler
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit.0", "atexit.1"]


def _fails(rank: int, world_size: int, where: str) -> None:
    _abort_in_c_exit_handlers()  # a late abort must not replace what failed first
    if where == "raise":
        raise ValueError(f"a check failed on rank {rank}")
    if where == "fn":
        os.abort()
    if where == "teardown":
        dist.destroy_process_group = os.abort  # the harness's teardown call
    if where == "exit handler":
        atexit.register(os.abort)


def _hangs(rank: int, world_size: int) -> None:
    threading.Thread(target=threading.Event().wait).start()  # a thread the exit waits for


def test_a_rank_that_does_not_end_is_killed_at_the_deadline(monkeypatch, capfd) -> None:
    monkeypatch.setattr(dist_harness, "RANK_DEADLINE_S", 3.0)
    with pytest.raises(TimeoutError, match="_hangs: 1 rank"):
        run_ranks(1, _hangs)
    err = capfd.readouterr().err  # the stacks, under their rank: the thread the exit waits for
    assert "--- rank 0's threads at the deadline ---" in err and " in wait\n" in err, err[-3000:]


@pytest.mark.parametrize("where", ["fn", "teardown", "exit handler"])
def test_an_abort_before_the_rank_ends_fails_the_test(where: str) -> None:
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        run_ranks(1, _fails, where)


def test_an_exception_fails_the_test_with_its_traceback() -> None:
    with pytest.raises(mp.ProcessRaisedException, match=r"(?s)in _fails.*ValueError: a check"):
        run_ranks(1, _fails, "raise")
