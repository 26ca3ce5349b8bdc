"""The wrapper's statistics: what ``memory_stats()`` and ``offload_stats()`` return.

``memory_stats()`` combines the Reducer's counters (``_C.MemoryStats``: buckets, gradients,
accumulate_on_host's sums) with the in-backward optimizer's (``_C.OptimizerMemory``: host master
weights and staging buffers) and the optimizer state's bytes; ``offload_stats()`` reads the host
worker's (``_C.InBackwardOptimizer.stats()``). The keys and their meanings are documented on
``DistributedDataParallel.memory_stats`` and ``offload_stats``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

if TYPE_CHECKING:
    from ._extension import _C
    from .optim import InBackward

#: offload_stats()'s keys, in its order (the host worker's counters of the same names)
OFFLOAD_KEYS = ("iterations", "buckets", "step_seconds", "wait_seconds", "grad_norm")


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (empty ones aside). A tensor subclass
    that wraps others (torchao's low-bit optimizer state: its codes and scales) has no storage of
    its own: the tensors it wraps are counted, recursively."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        for plain in _plain_tensors(tensor):
            if plain.numel() > 0:
                storage = plain.untyped_storage()
                seen[(str(plain.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def _plain_tensors(tensor: Tensor) -> Iterator[Tensor]:
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            yield from _plain_tensors(getattr(tensor, name))
    else:
        yield tensor


def memory_stats(
    reducer: _C.Reducer,
    params: Sequence[nn.Parameter],
    in_backward: InBackward | None,
    core: _C.InBackwardOptimizer | None,
    offload: bool,
) -> dict[str, Any]:
    """``DistributedDataParallel.memory_stats()``: bytes held now by the Reducer over
    ``params`` (the trainable parameters) and, with optimizer_in_backward, by its optimizer
    (``in_backward``, its C++ side ``core``; ``offload``: offload_to_cpu)."""
    s = reducer.memory_stats()
    numel = max(1, sum(p.numel() for p in params))
    state = in_backward.state_bytes() if in_backward else 0
    opt = core.memory_stats() if core is not None else None
    masters = opt.host_master_bytes if opt else 0
    staging = opt.host_buffer_bytes if opt else 0
    pinned = s.host_pinned_bytes + (opt.host_pinned_bytes if opt else 0)
    host = {
        "optimizer_state": state if offload else 0,
        # float32 masters are the copy-back staging buffer: counted as masters only
        "master_weights": masters,
        "staging": staging,
        "accumulation": s.host_accumulation_bytes,
        "pinned": pinned,
    }
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "bucket_bytes": s.bucket_bytes,
        "grad_bytes": s.grad_bytes,
        "optimizer_state_bytes": state,
        "host_master_bytes": masters,
        "host_buffer_bytes": staging,
        "host_pinned_bytes": pinned,
        "host_accumulation_bytes": s.host_accumulation_bytes,
        "grads_as_views": s.grads_as_views,
        "grads_outside": s.grads_outside,
        "num_buckets": s.num_buckets,
        "peak_bucket_bytes": s.peak_bucket_bytes,
        "max_buckets_in_flight": s.max_buckets_in_flight,
        "recycled_bucket_bytes": s.recycled_bucket_bytes,
        "host_bytes_per_param": {k: v / numel for k, v in host.items()},
    }


def offload_stats(core: _C.InBackwardOptimizer | None) -> dict[str, float]:
    """``DistributedDataParallel.offload_stats()``: the host worker's counters of ``core``
    (the C++ optimizer; None without optimizer_in_backward: zeros, and -1 for ``grad_norm``)."""
    if core is None:
        return {key: -1.0 if key == "grad_norm" else 0 for key in OFFLOAD_KEYS}
    s = core.stats()
    return {key: getattr(s, key) for key in OFFLOAD_KEYS}
