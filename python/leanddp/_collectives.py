"""Construction- and forward-time collectives: verifying and broadcasting module state.

Tensors are packed per (device, dtype) into flat buffers with leanddp's flatten/unflatten ops,
so a broadcast of hundreds of parameters is a handful of collectives.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops

if TYPE_CHECKING:
    from ._logging import DDPLogger

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


def sync_initial_state(
    named: Sequence[tuple[str, Tensor]],
    state: Sequence[Tensor],
    group: dist.ProcessGroup,
    sparse_names: Collection[str],
) -> None:
    """Construction's collectives (``init_sync``): verifies that every rank of ``group`` holds
    the same trainable parameters ``named`` (:func:`verify_same_parameters`, on their device),
    then overwrites the module's ``state`` with rank 0's."""
    verify_same_parameters(named, group, named[0][1].device, set(sparse_names))
    broadcast_from_rank0(state, group)


def sync_buffers(buffers: Sequence[Tensor], group: dist.ProcessGroup, logger: DDPLogger) -> None:
    """The forward's broadcast of the module's ``buffers`` from rank 0 of ``group``. A failure
    is logged to ``logger`` and raised again (its type) with a message saying what it means."""
    try:
        broadcast_from_rank0(buffers, group)
    except RuntimeError as e:
        message = (
            f"leanddp.DistributedDataParallel: rank {group.rank()}: "
            "broadcasting buffers from rank 0 failed. Another rank has probably died, raised "
            "an exception, or run a different sequence of forwards and backwards; this "
            f"process group cannot be used for training any more. The error: {e}"
        )
        logger.set_error_and_log(f"{type(e)}: {message}")
        raise type(e)(message) from e


def _all_gather_bytes(data: bytes, device: torch.device, group: dist.ProcessGroup) -> list[bytes]:
    """Every rank's ``data``, gathered with tensor collectives on ``device``.

    torch's ``all_gather_object`` stages objects on the *current* CUDA device for NCCL, so
    without ``torch.cuda.set_device`` every rank would use cuda:0; the module's device is the
    one the process group already serves for this model (torch's DDP verifies on it too).
    """
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else None
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(group.size())]
    dist.all_gather(sizes, size, group=group)
    lengths = torch.cat(sizes).tolist()  # construction only: one host sync
    padded = torch.zeros(max(max(lengths), 1), dtype=torch.uint8, device=device)
    if mine is not None:
        padded[: len(data)] = mine
    gathered = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(gathered, padded, group=group)
    return [bytes(t[:n].tolist()) for t, n in zip(gathered, lengths, strict=True)]


def _describe(entry: list[Any]) -> str:
    name, shape, dtype, sparse = entry
    return f"{name!r} {shape} {dtype} with {'sparse' if sparse else 'dense'} gradients"


def verify_same_parameters(
    named: Sequence[tuple[str, Tensor]],
    group: dist.ProcessGroup,
    device: torch.device,
    sparse_names: Collection[str] = (),
) -> None:
    """Raises ValueError on every rank, naming the first parameter whose name, shape, dtype or
    kind of gradient (sparse for those in ``sparse_names``, of modules with ``sparse=True``)
    differs from rank 0's, or the count if the ranks hold different numbers of parameters.
    (torch's DDP does not compare the kind of gradient: its first backward then runs mismatched
    collectives, which abort the process on gloo.) The collectives run on ``device``, the
    module's."""
    mine = [[name, list(p.shape), str(p.dtype), name in sparse_names] for name, p in named]
    gathered = _all_gather_bytes(json.dumps(mine).encode(), device, group)
    everyone = [json.loads(b) for b in gathered]
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for i, (ref, other) in enumerate(zip(reference, theirs, strict=False)):
            if ref != other:
                hint = (
                    "Build the module with the same sparse= on every rank."
                    if ref[:3] == other[:3]
                    else "Wrap the same model on every rank."
                )
                raise ValueError(
                    "leanddp.DistributedDataParallel: the model differs across ranks: "
                    f"parameter #{i} is {_describe(ref)} on rank 0 but {_describe(other)} on "
                    f"rank {rank}. {hint}"
                )
        if len(reference) != len(theirs):
            raise ValueError(
                "leanddp.DistributedDataParallel: the model differs across ranks: rank 0 has "
                f"{len(reference)} trainable parameters, rank {rank} has {len(theirs)}. Wrap "
                "the same model on every rank."
            )
