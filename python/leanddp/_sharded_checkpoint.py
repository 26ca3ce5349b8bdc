"""shard_optimizer_state checkpoints that stay sharded, for ``torch.distributed.checkpoint``.

Every rank saves and loads its own shard of the optimizer state; nothing is gathered, so a
model whose whole state fits no single host can still be checkpointed. Each parameter's state
tensor (``exp_avg``/``exp_avg_sq`` or ``momentum_buffer``; with offload_to_cpu also the float32
``master_weight`` of a bfloat16/float16 parameter) is a ShardedTensor of the parameter's
``numel`` elements (the parameter seen 1-D in its memory order); torchao's 8-bit state is its
uint8 codes under those keys and their float32 scales under ``exp_avg.scale`` and
``exp_avg_sq.scale``, one per block (the shards cut whole blocks). Its local shard on a rank is
that rank's piece of it: a live view of leanddp's state buffer, so DCP writes straight from the
buffers and loads straight into them. A piece is placed by its position in the parameter, not in
a bucket, so a checkpoint loads at another world size or bucket size (DCP reads what overlaps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

if TYPE_CHECKING:
    from .optim._link import InBackward


def _fail(message: str) -> NoReturn:
    raise ValueError(f"leanddp.DistributedDataParallel: {message}")


def sharded_state_dict(
    group: dist.ProcessGroup,
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    link: InBackward | None,
) -> dict[str, Any]:
    """``{"state": {name: {"step": tensor, key: ShardedTensor}}, "param_groups": (...)}``
    for every trainable parameter (by name), this rank's pieces as live views (module doc).
    ``link`` is the wrapper's in-backward optimizer over ``params`` (named ``names``) on
    ``group`` (its C++ state, its state rule and param groups)."""
    core = link.core if link is not None else None
    if link is None or core is None or not link.sharded:
        _fail("sharded_optimizer_state_dict() needs shard_optimizer_state=True")
    ranks = dist.get_process_group_ranks(group)
    placement = core.shard_placement()
    steps = core.steps()
    local = {(p, key): view for p, key, view in core.local_state()}
    # Every rank must see every key: a rank without a piece of a parameter learns its keys, and
    # where they live, from the fused optimizer's rule (link.view.spec), as the ranks holding
    # pieces do.
    state: dict[str, dict[str, Any]] = {}
    for p, name in enumerate(names):
        pieces = placement[p]
        if not pieces:  # no elements: no state
            continue
        entry: dict[str, Any] = {"step": torch.tensor(float(steps[p]))}
        rule = link.view.spec(p)
        keys = [key for key in rule.keys if key != "step"]  # (the count is not sharded)
        if rule.quantized:  # 8-bit codes, then their scales: one per block, cut with them
            keys += [f"{key}.scale" for key in rule.buffers]
        for key in keys:
            scale = key.endswith(".scale")
            unit = rule.block if scale else 1
            shards = []
            metadata = []
            for rank, offset, numel in pieces:
                where = f"rank:{ranks[rank]}/{rule.device}"
                metadata.append(ShardMetadata([offset // unit], [numel // unit], where))
                if ranks[rank] == dist.get_rank():
                    shards.append(Shard(local[(p, key)], metadata[-1]))
            dtype = torch.float32 if scale or key == "master_weight" else rule.dtype
            global_metadata = ShardedTensorMetadata(
                metadata, torch.Size([params[p].numel() // unit]), TensorProperties(dtype=dtype)
            )
            entry[key] = ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, global_metadata, process_group=group
            )
        state[name] = entry
    # A tuple, which DCP keeps whole as one object: a rank holding no piece of some parameter
    # has no local shard of its ShardedTensors, and DCP's load then falls back to its older
    # flattening, which agrees with the newer one on tuples (not on lists or dicts of groups).
    groups = tuple(
        {k: v for k, v in g.items() if k != "params"} for g in link.optimizer.param_groups
    )
    return {"state": state, "param_groups": groups}


def load_sharded_state_dict(
    names: Sequence[str],
    link: InBackward | None,
    state_dict: dict[str, Any],
) -> None:
    """After ``dcp.load`` filled ``state_dict`` (made by :func:`sharded_state_dict` of the same
    ``link``, whose pieces it loaded in place): sets the step counts and the hyper-parameters
    of ``link``'s param groups. Raises naming the entry if ``state_dict`` is not such a dict."""
    core = link.core if link is not None else None
    if link is None or core is None or not link.sharded:
        _fail("load_sharded_optimizer_state_dict() needs shard_optimizer_state=True")
    state = state_dict.get("state")
    groups = state_dict.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, tuple):
        _fail(
            "the state dict must have 'state' and 'param_groups' as made by "
            "sharded_optimizer_state_dict()"
        )
    param_groups = link.optimizer.param_groups
    if len(groups) != len(param_groups):
        _fail(f"the state dict has {len(groups)} param groups, the optimizer {len(param_groups)}")
    steps = core.steps()
    for p, name in enumerate(names):
        if name not in state:
            continue
        step = state[name].get("step")
        if not isinstance(step, torch.Tensor) or step.numel() != 1:
            _fail(f"state of parameter {name!r}: 'step' must be a one-element tensor")
        steps[p] = int(step.item())
    core.set_steps(steps)
    if link.offload:  # the masters were loaded in place, not rounded
        core.adopt_master_weights()
    for group, saved in zip(param_groups, groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
