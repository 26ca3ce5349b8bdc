"""offload_to_cpu's Python glue: where parameters are read or written, wait for the host steps.

The host step of a backward finishes after backward returns; ``DistributedDataParallel.forward``
waits for it. So that code using the parameters another way sees the stepped weights too (and
does not race with the worker writing them), the wrapped module waits before its own forward
(called directly, as evaluation code often does), and every module that owns a trained
parameter waits before its ``state_dict()`` and ``load_state_dict()``. At interpreter exit the
worker is stopped before torch tears down.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn


def install_waits(ddp: nn.Module) -> None:
    """Installs the waits on ``ddp.module`` and the exit-time shutdown of ``ddp.reducer``."""
    ref = weakref.ref(ddp)

    def before_forward(module: nn.Module, args: Any) -> None:
        owner = ref()
        if owner is not None:
            owner.reducer.wait_for_offload()

    def before_state_dict(module: nn.Module, *args: Any) -> None:
        owner = ref()
        if owner is not None:
            owner.reducer.wait_for_offload(host_too=True)

    ddp.module.register_forward_pre_hook(before_forward)
    trained = {id(p) for p in ddp._params}
    for sub in ddp.module.modules():
        if any(id(p) in trained for p in sub.parameters(recurse=False)):
            sub.register_state_dict_pre_hook(before_state_dict)
            sub.register_load_state_dict_pre_hook(before_state_dict)
    # Runs when ddp is collected or, at the latest, at interpreter exit (weakref.finalize is an
    # atexit hook too): a worker still stepping then finishes its bucket and stops.
    weakref.finalize(ddp, ddp.reducer.shutdown_offload)
