"""Construction- and forward-time collectives: verifying and broadcasting module state.

Tensors are packed per (device, dtype) into flat buffers with leanddp's flatten/unflatten ops,
so a broadcast of hundreds of parameters is a handful of collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops

#: Tensors are broadcast in flat chunks of at most this many bytes (torch's DDP uses 250 MiB).
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def _chunks(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    """Groups tensors by (device, dtype), then cuts each group into chunks of bounded bytes."""
    groups: dict[tuple[torch.device, torch.dtype], list[list[Tensor]]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    for t in tensors:
        key = (t.device, t.dtype)
        chunks = groups.setdefault(key, [[]])
        nbytes = t.numel() * t.element_size()
        if chunks[-1] and sizes.get(key, 0) + nbytes > BROADCAST_CHUNK_BYTES:
            chunks.append([])
            sizes[key] = 0
        chunks[-1].append(t)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [chunk for chunks in groups.values() for chunk in chunks if chunk]


@torch.no_grad()
def broadcast_from_rank0(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> None:
    """Overwrites ``tensors`` in place, on every rank of ``group``, with the group's rank 0's."""
    tensors = [t.detach() for t in tensors if t.numel() > 0]
    for chunk in _chunks(tensors):
        flat = torch.empty(
            sum(t.numel() for t in chunk), dtype=chunk[0].dtype, device=chunk[0].device
        )
        ops.flatten_into(chunk, flat)
        dist.broadcast(flat, group=group, group_src=0)
        ops.unflatten_from(flat, chunk)


def verify_same_parameters(named: Sequence[tuple[str, Tensor]], group: dist.ProcessGroup) -> None:
    """Raises ValueError on every rank, naming the first parameter whose name, shape or dtype
    differs from rank 0's (or the count, if the ranks hold different numbers of parameters)."""
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in named]
    everyone: list[list[tuple[str, tuple[int, ...], str]] | None] = [None] * group.size()
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    assert reference is not None
    for rank, theirs in enumerate(everyone[1:], start=1):
        assert theirs is not None
        for i, (ref, other) in enumerate(zip(reference, theirs, strict=False)):
            if ref != other:
                raise ValueError(
                    "leanddp.DistributedDataParallel: the model differs across ranks: "
                    f"parameter #{i} is {ref[0]!r} {list(ref[1])} {ref[2]} on rank 0 but "
                    f"{other[0]!r} {list(other[1])} {other[2]} on rank {rank}. Wrap the same "
                    "model on every rank."
                )
        if len(reference) != len(theirs):
            raise ValueError(
                "leanddp.DistributedDataParallel: the model differs across ranks: rank 0 has "
                f"{len(reference)} trainable parameters, rank {rank} has {len(theirs)}. Wrap "
                "the same model on every rank."
            )
