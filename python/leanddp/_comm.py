"""Communication hooks: torch's ``register_comm_hook`` contract on top of leanddp's Reducer.

The Reducer calls :func:`make_launcher`'s function once per bucket, on the autograd thread, with
the bucket's flat buffer; the user's hook receives a :class:`GradBucket` offering what torch's
``dist.GradBucket`` offers, so torch's own hooks (allreduce, fp16/bf16 compression, PowerSGD)
work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


class GradBucket:
    """One bucket of gradients, as a communication hook sees it (mirrors ``dist.GradBucket``).

    The buffer holds this rank's gradients, not yet divided by the world size: the hook
    averages, as torch's hooks do. Its future's value (a tensor, or a list holding one) is
    copied back into the buffer, whose slices are the parameters' gradients.

    A parameter with sparse gradients (``nn.Embedding(sparse=True)``) has a bucket of its own
    whose buffer is its sparse gradient, as in torch: the future must hold a sparse tensor of the
    parameter's shape (``allreduce_hook`` does on gloo), and :meth:`gradients` is empty.
    """

    def __init__(
        self, index: int, buffer: Tensor, is_last: bool, params: Sequence[torch.nn.Parameter]
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._is_last = is_last
        self._params = list(params)

    def index(self) -> int:
        """The bucket's index; bucket 0 holds the gradients that become ready first."""
        return self._index

    def buffer(self) -> Tensor:
        """The flat 1-D buffer holding the bucket's gradients."""
        return self._buffer

    def gradients(self) -> list[Tensor]:
        """The buffer's slices, one per parameter, shaped like the parameters (none for a
        sparse bucket, as torch's)."""
        if self._buffer.is_sparse:
            return []
        out, offset = [], 0
        for p in self._params:
            out.append(self._buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    def parameters(self) -> list[torch.nn.Parameter]:
        """The bucket's parameters, in buffer order."""
        return list(self._params)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the iteration to be reduced."""
        return self._is_last

    def set_buffer(self, buffer: Tensor) -> None:
        """Copies ``buffer`` into the bucket's buffer (the storage stays the Reducer's)."""
        self._buffer.copy_(buffer if self._buffer.is_sparse else buffer.reshape(-1))


def make_launcher(
    hook: Callable[[Any, GradBucket], torch.futures.Future],
    state: Any,
    params: Sequence[torch.nn.Parameter],
    names: Sequence[str],
) -> Callable[[int, Tensor, bool, list[int]], torch.futures.Future]:
    """The function the Reducer calls per bucket (with the indices into ``params`` of the
    bucket's parameters; ``names`` names them): builds the GradBucket and runs the hook."""

    def launch(index: int, buffer: Tensor, is_last: bool, members: list[int]) -> Any:
        bucket = GradBucket(index, buffer, is_last, [params[i] for i in members])
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
            raise TypeError(
                "leanddp.DistributedDataParallel: a communication hook must return a "
                f"torch.futures.Future, got {type(future).__name__}"
            )
        return future

    return launch
