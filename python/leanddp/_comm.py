"""Communication hooks: torch's ``register_comm_hook`` contract on top of leanddp's Reducer.

The Reducer calls :func:`make_launcher`'s function once per bucket, on the autograd thread, with
the bucket's flat buffer; the user's hook receives torch's own ``torch.distributed.GradBucket``
(built in C++ over that buffer), so torch's hooks (allreduce, fp16/bf16 compression, PowerSGD)
and code that checks ``isinstance(bucket, dist.GradBucket)`` work unchanged.

The buffer holds this rank's gradients, not yet divided by the world size: the hook averages,
as torch's hooks do. Its future's value (a tensor, or a list holding one) is copied back into
the bucket, whose slices are the parameters' gradients. As in torch, ``bucket.set_buffer(t)``
replaces the tensor the GradBucket hands out (it does not copy into the bucket). A hook that
returns something other than a future raises torch's ``RuntimeError`` ("DDP communication
hook's callback must return a torch.futures.Future object, but got ...") from ``backward()``,
when its bucket is launched, as torch's DDP does.

A parameter with sparse gradients (``nn.Embedding(sparse=True)``) has a bucket of its own whose
buffer is its sparse gradient, as in torch: the future must hold a sparse tensor of the
parameter's shape (``allreduce_hook`` does on gloo), and ``gradients()`` is empty.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ._extension import _C


def builtin_hook(kind: Any) -> Callable[[Any, dist.GradBucket], torch.futures.Future[Any]] | None:
    """The hook of a ``dist.BuiltinCommHookType`` (its state is the process group), or None.
    torch's C++ built-ins divide by the world size and then allreduce (ALLREDUCE) or do the same
    in float16 and copy the result back (FP16_COMPRESS): what these Python hooks do."""
    if kind == dist.BuiltinCommHookType.ALLREDUCE:
        return default_hooks.allreduce_hook
    if kind == dist.BuiltinCommHookType.FP16_COMPRESS:
        return default_hooks.fp16_compress_hook
    return None


def registration_error(registered: bool, reducer: _C.Reducer, modes: _C.Modes) -> str | None:
    """Why a communication hook cannot be registered now, or None: one is already
    (``registered``), ``reducer`` has run a backward, or the wrapper's ``modes`` do not combine
    with a hook (``_C.check_modes``)."""
    if registered:
        return (
            "register_comm_hook or register_builtin_comm_hook can only be called once. "
            "(leanddp.DistributedDataParallel: a communication hook is already registered.)"
        )
    if reducer.num_iterations() > 0:
        return (
            "leanddp.DistributedDataParallel: register_comm_hook may be called only before "
            "the first backward"
        )
    modes = copy.copy(modes)
    modes.comm_hook = True
    error = _C.check_modes(modes)
    return None if error is None else f"leanddp.DistributedDataParallel: {error.message}"


def _qualified_name(cls: type) -> str:
    """A type's name as torch's DDP writes it in its hook errors (``torch.Tensor``, ``int``)."""
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def make_launcher(
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future[Any]],
    state: Any,
    params: Sequence[torch.nn.Parameter],
    names: Sequence[str],
) -> Callable[[int, int, Tensor, list[int], list[int], list[int]], torch.futures.Future[Any]]:
    """The function the Reducer calls per bucket: the bucket's index, the number of buckets,
    its buffer, the indices into ``params`` of its parameters (``names`` names them) and their
    slices' offsets and lengths in the buffer (the Reducer's layout; empty for a sparse
    gradient). It builds the GradBucket and runs the hook."""

    def launch(
        index: int,
        bucket_count: int,
        buffer: Tensor,
        members: list[int],
        offsets: list[int],
        lengths: list[int],
    ) -> Any:
        bucket = _C.make_grad_bucket(
            index, bucket_count, buffer, offsets, lengths, [params[i] for i in members]
        )
        if not buffer.is_sparse:
            future = hook(state, bucket)
        else:
            try:
                future = hook(state, bucket)
            except Exception as e:
                raise RuntimeError(
                    "leanddp.DistributedDataParallel: the communication hook failed on the "
                    f"sparse gradient of {names[members[0]]} (a module with sparse=True), which "
                    "it receives as the bucket's buffer, as in torch's DDP: use a hook that "
                    "handles sparse tensors (torch's allreduce_hook does), or build the module "
                    f"with sparse=False. The error: {e}"
                ) from e
        if not isinstance(future, torch._C.Future):  # torch.futures.Future and c10d's futures
            raise RuntimeError(
                "DDP communication hook's callback must return a torch.futures.Future object, "
                f"but got {_qualified_name(type(future))}. (leanddp.DistributedDataParallel: "
                f"the hook {getattr(hook, '__qualname__', repr(hook))} returned it for bucket "
                f"{index}; return the future of an asynchronous collective, as "
                "dist.all_reduce(..., async_op=True).get_future().)"
            )
        return future

    return launch
