"""The wrapper's bookkeeping around the module's forward (``DistributedDataParallel.forward``).

:func:`before_module` and :func:`after_module` run before and after the module's forward: they
are not traced by torch.compile (they call into the C++ Reducer and handle errors), so that the
module's forward between them is. Before it: Join's notification, the last backward's
in-backward steps waited for (or, with offload_to_cpu, waited for bucket by bucket as the
forward reads them: ``_waits``), the checks of the parameters, the Reducer prepared for a
forward, the buffers broadcast from rank 0. After it: the Reducer armed for backward (with
``find_unused_parameters``, over the output's tensors). Also here: inputs moved to the module's
device (``device_ids``), the warning for gradients replaced out of place, and the hook torch's
``Join`` context asks for (uneven inputs are not supported yet).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.distributed.algorithms.join import Join, JoinHook
from torch.nn.parallel.distributed import _find_tensors

if TYPE_CHECKING:
    from ._waits import ReadWaits
    from .ddp import DistributedDataParallel


@torch.compiler.disable  # type: ignore[untyped-decorator]  # unannotated in torch
def before_module(
    ddp: DistributedDataParallel, grad_enabled: bool, compiling: bool
) -> ReadWaits | None:
    """What ``ddp``'s forward does before the module's; returns the waits of a forward that
    waits for the host steps bucket by bucket (offload_to_cpu), to enter around the module's
    forward, or None."""
    if ddp._join_config.enable:  # inside an enabled Join context: "not joined yet"
        Join.notify_join_context(ddp)
    # Last step's weights are in place; offload_to_cpu: host steps still pending are waited
    # for as the module reads them (ddp._waits.begin below).
    ddp._step_error = None
    # (the buckets not pending were stepped: the current stream is ordered after their
    # copies back here, which may still run on a GPU)
    core = ddp._optimizer_core  # (None without optimizer_in_backward)
    pending = core.pending_steps(follow_copies=True) if core is not None else []
    if core is not None and not pending:
        _wait_for_steps(ddp, core.follow_steps)
    if grad_enabled:
        try:
            ddp._check_parameters_unchanged()
            if ddp.require_backward_grad_sync:
                ddp.logger.before_forward()
            ddp._warn_replaced_grads(ddp.reducer.prepare_for_forward())
            ddp.reducer.rebuild_buckets()
        except Exception as e:
            ddp.logger.set_error_and_log(f"{type(e)}: {e}")
            raise
        if ddp._in_backward is not None:  # (pending: state adopted after the forward)
            ddp._in_backward.before_forward(adopt=not pending)
    if ddp.will_sync_module_buffers():
        ddp._sync_buffers()
    waits = ddp._waits.begin(pending, compiling) if pending else None
    if pending and waits is None:
        _wait_for_steps(ddp)
    return waits


def _wait_for_steps(ddp: DistributedDataParallel, wait: Callable[[], None] | None = None) -> None:
    """Waits for the last backward's steps (``wait``: the optimizer's ``wait_for_steps``, or
    its ``follow_steps`` where none is pending, which does not wait for the host
    worker's sums of no_sync() micro-batches). An error the host worker met is raised at the
    end of the forward (:func:`after_module`), where one met while the forward waited bucket by
    bucket is: at the same point on every rank, whichever way each one waited, so that no
    rank is left alone in a collective of the forward."""
    core = ddp._optimizer_core
    assert core is not None  # (optimizer_in_backward)
    try:
        (wait or core.wait_for_steps)()
    except Exception as e:  # noqa: BLE001 (re-raised by after_module)
        ddp._step_error = e


@torch.compiler.disable  # type: ignore[untyped-decorator]  # unannotated in torch
def after_module(
    ddp: DistributedDataParallel, grad_enabled: bool, output: Any, waited_per_bucket: bool
) -> None:
    """What ``ddp``'s forward does after the module's, which returned ``output``
    (``waited_per_bucket``: :func:`before_module` returned waits)."""
    if waited_per_bucket:
        assert ddp._optimizer_core is not None  # (only optimizer_in_backward waits per bucket)
        ddp._optimizer_core.wait_for_steps()  # what the forward did not read (or an error)
        if grad_enabled:
            assert ddp._in_backward is not None  # (only offload_to_cpu waits per bucket)
            ddp._in_backward.adopt_state()
    error, ddp._step_error = ddp._step_error, None  # (set by before_module)
    if error is not None:
        raise error
    if grad_enabled and ddp.require_backward_grad_sync:
        ddp.require_forward_param_sync = True
        track = ddp.find_unused_parameters and not ddp.static_graph
        ddp.reducer.prepare_for_backward(list(_find_tensors(output)) if track else [])  # type: ignore[no-untyped-call]  # unannotated in torch
        if track:
            ddp.logger.after_search()
    else:
        ddp.require_forward_param_sync = False


def move_to(
    inputs: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``inputs`` and ``kwargs`` with every tensor in them (in lists, tuples and dicts, not in
    named tuples) copied to ``device``, asynchronously."""

    def move(obj: Any) -> Any:
        if isinstance(obj, Tensor):
            return obj.to(device, non_blocking=True)
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(move(o) for o in obj)
        if isinstance(obj, dict):
            return type(obj)((k, move(v)) for k, v in obj.items())
        return obj

    return move(inputs), move(kwargs)


def warn_replaced_grads(names: list[str], stacklevel: int) -> None:
    """Warns that the gradients of the parameters ``names`` are no longer views into their
    buckets (``stacklevel``: as ``warnings.warn``'s, counted from this function)."""
    warnings.warn(
        "leanddp.DistributedDataParallel: the gradient of "
        f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''} is no longer a view "
        "into its communication bucket (code replaced param.grad out of place). Results "
        "stay correct (it is copied into the bucket at the next reduction), but the "
        "memory saving of gradient_as_bucket_view is lost while it is held. Modify "
        "gradients in place, or set them to None.",
        stacklevel=stacklevel,
    )


class UnevenInputsHook(JoinHook):
    """Join's hook: runs only on a rank that left an enabled ``Join`` while others train on."""

    def main_hook(self) -> None:
        raise NotImplementedError(
            "leanddp.DistributedDataParallel: this rank ran out of inputs before the others "
            "(uneven inputs), which join() does not support yet. Give every rank the same number "
            "of batches, for example with DistributedSampler(..., drop_last=True)."
        )
