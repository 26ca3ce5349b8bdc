"""The end of a wrapper's life: what its Reducer and the wrapper let go of, and when."""

from __future__ import annotations

import weakref
from typing import Any


def close_at_end(ddp: Any, reducer: Any) -> None:
    """Closes ``reducer`` (``ddp``'s) when ``ddp`` is collected or, at the latest, at interpreter
    exit (``weakref.finalize`` is an atexit hook too): see ``_close``."""
    weakref.finalize(ddp, _close, reducer, weakref.ref(ddp))


def _close(reducer: Any, wrapper: weakref.ref) -> None:
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
