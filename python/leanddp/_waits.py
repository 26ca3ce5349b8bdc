"""optimizer_in_backward's Python glue: where parameters are read or written, wait for the steps.

The steps of a backward may still be running after backward returns: on a GPU they are queued
on a side stream (the stream that called backward is ordered after them, the host does not wait),
and with offload_to_cpu the host worker finishes them. ``DistributedDataParallel.forward`` waits
for them. So that code using the parameters another way sees the stepped weights too (and does
not race with the writes), the wrapped module waits before its own forward (called directly, as
evaluation code often does), and every module that owns a trained parameter waits before its
``state_dict()`` and ``load_state_dict()``. (With offload_to_cpu the worker is stopped when the
wrapper is collected or at interpreter exit: see ``Reducer.close``.)
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn


def install_waits(module: nn.Module, trained: Sequence[Tensor], reducer: Any) -> None:
    """Installs the waits on ``module``, for the parameters ``trained`` that ``reducer`` (a
    ``_C.Reducer``) steps. The hooks hold the Reducer weakly: once the wrapper and its Reducer
    are gone they do nothing."""
    ref = weakref.ref(reducer)

    def before_forward(module: nn.Module, args: Any) -> None:
        owner = ref()
        if owner is not None:
            owner.wait_for_steps()

    def before_state_dict(module: nn.Module, *args: Any) -> None:
        owner = ref()
        if owner is not None:
            owner.wait_for_steps(host_too=True)

    module.register_forward_pre_hook(before_forward)
    ids = {id(p) for p in trained}
    for sub in module.modules():
        if any(id(p) in ids for p in sub.parameters(recurse=False)):
            sub.register_state_dict_pre_hook(before_state_dict)
            sub.register_load_state_dict_pre_hook(before_state_dict)
