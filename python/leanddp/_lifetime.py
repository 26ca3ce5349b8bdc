"""The end of a wrapper's life (what its Reducer and the wrapper let go of, and when) and of a
finished process (``leave``)."""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from ._extension import _C

#: How long a wrapper still alive at interpreter exit releases the GIL after closing (seconds):
#: the gloo workers' pending releases of finished works run meanwhile (docs/troubleshooting.md).
EXIT_GIL_YIELD_S = 0.05


def close_at_end(ddp: Any, reducer: _C.Reducer) -> None:
    """Closes ``reducer`` (``ddp``'s) when ``ddp`` is collected or, at the latest, at interpreter
    exit (``weakref.finalize`` is an atexit hook too): see ``_close``."""
    weakref.finalize(ddp, _close, reducer, weakref.ref(ddp))


def _close(reducer: _C.Reducer, wrapper: weakref.ref[Any]) -> None:
    """A wrapper's end, when it is collected or at the latest at interpreter exit: the Reducer
    stops its offload worker and lets go of the process group, its in-flight works and its
    Python hook and stepper, while every thread can still take the GIL. A wrapper still alive at
    exit also drops its own references to the group, so that a group the script destroyed is
    torn down here, joining gloo's threads, and not during interpreter finalization, where torch
    can abort a finished process (docs/troubleshooting.md)."""
    reducer.close()
    ddp = wrapper()
    if ddp is not None and ddp.__dict__.get("reducer") is reducer:
        ddp.process_group = None
        ddp._config = ddp._config.without_group()
        ddp._comm_hooks.clear()  # a hook's state may be the group
        # Alive at exit: gloo's worker threads drop a finished work's last reference on their own
        # thread, which takes the GIL (Python-owned tensors, the thread-local state the work
        # captured) and, once finalization has begun, aborts the process. Give them the GIL now.
        time.sleep(EXIT_GIL_YIELD_S)


def leave() -> NoReturn:
    """Ends this process with exit code 0 as a normal exit would up to its exit handlers (waits
    for non-daemon threads, runs ``atexit`` and so ``weakref.finalize`` handlers, flushes), but
    without finalizing the interpreter or running C/C++ exit handlers and static destructors,
    where torch's gloo worker can abort a finished process (docs/troubleshooting.md,
    "terminate called without an active exception"). For a process whose work is done and whose
    process groups are torn down (the test harness's ranks, the bench's workers). An exception in
    an exit handler is printed, as at a normal exit; an abort in one still kills the process."""
    # As a normal exit: threading's own exit callbacks (they tell a concurrent.futures pool's
    # workers to finish), then the wait for non-daemon threads; joining those threads without
    # the callbacks first waits forever on an idle pool's workers (inductor's compile pool).
    threading._shutdown()  # type: ignore[attr-defined]  # private: not in typeshed's threading
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    ctypes.CDLL(None).fflush(None)  # C stdio buffers (a C++ library's printf)
    os._exit(0)
