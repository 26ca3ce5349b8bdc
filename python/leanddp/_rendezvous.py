"""Leaving the store clean for a restart: gloo's rendezvous keys, forgotten once every rank holds
its connections.

torchrun restarts a failed worker group in new processes that meet through the same TCPStore
as the failed round: the agent's store for static rendezvous (``--master-port``), and the shared
one for the c10d backend (``--standalone``) unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
torch's ``_create_c10d_store`` gives no per-attempt prefix, so a group's keys carry over
between rounds. gloo's ``connectFullMesh`` writes each rank's listening address under the key
``str(rank)`` and reads every other rank's key at once. A rank of the new round that reads
before its peer has written gets the dead process's address. What happens next depends on how
gloo orders the two ports (``Device::isInitiator``):

- it connects to the dead address and fails within seconds ("Connection refused");
- it waits for the peer to connect, and the peer, ordering the two live ports the other way,
  waits too: both hang in ``Pair::waitUntilConnected`` until the group's timeout (gloo's
  default: 30 minutes), inside ``init_process_group``, before any DDP exists;
- or the live peer connects and the round trains.

So a wrapper forgets its group's keys (this rank's) once its construction collectives have
succeeded: they prove that every rank has finished ``connectFullMesh`` (gloo reads every key
before it connects), so no one reads them again, and the next round's ranks wait for each
other's fresh addresses. A round that fails before any wrapper is built still leaves its keys:
docs/troubleshooting.md says what to use for restarts.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

#: gloo's transport devices per group are numbered from 0 (one unless ``GLOO_SOCKET_IFNAME``
#: names several interfaces); keys are looked for at indices up to the first missing one.
_MAX_GLOO_DEVICES = 64


def _lazy_gloo() -> bool:
    """Whether gloo connects pairs on first use (``TORCH_GLOO_LAZY_INIT``): its keys are then
    read after construction, so they must stay."""
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "0").strip().lower() in ("1", "true", "yes")


def gloo_rendezvous_keys(group: dist.ProcessGroup) -> list[tuple[dist.Store, str]]:
    """(store, key) of each gloo rendezvous key this rank of ``group`` wrote that is still in
    the group's store: ``{device type}/`` then ``{gloo device index}`` then ``{group rank}``
    under the group's prefix, as ``_new_process_group_helper`` and ``ProcessGroupGloo`` nest
    their ``PrefixStore``s. Empty where the group has no gloo backend or no store."""
    try:
        store = dist.distributed_c10d._get_process_group_store(group)
        device_types = list(group._device_types)
    except (AttributeError, KeyError, RuntimeError):
        return []  # a group torch does not track (a fake or custom group)
    gloo = getattr(dist, "ProcessGroupGloo", None)  # (None in a torch built without gloo)
    if gloo is None:
        return []
    found: list[tuple[dist.Store, str]] = []
    rank = str(group.rank())
    for device in device_types:
        try:
            backend = group._get_backend(torch.device(device))
        except RuntimeError:
            continue
        if not isinstance(backend, gloo):
            continue
        per_device = dist.PrefixStore(f"{torch.device(device).type}/", store)
        for index in range(_MAX_GLOO_DEVICES):
            keyed = dist.PrefixStore(str(index), per_device)
            if not keyed.check([rank]):
                break
            found.append((keyed, rank))
    return found


def forget_rendezvous_keys(group: dist.ProcessGroup) -> int:
    """Deletes this rank's gloo rendezvous keys of ``group`` from its store (see the module's
    docstring); the number deleted. Call only after a collective on ``group`` has completed on
    this rank, which proves every rank connected. Never raises: a store that cannot delete
    keys only warns, as the group itself works."""
    if _lazy_gloo():
        return 0
    deleted = 0
    try:
        for store, key in gloo_rendezvous_keys(group):
            if store.delete_key(key):
                deleted += 1
    except (RuntimeError, NotImplementedError) as e:  # a store without delete_key (HashStore?)
        warnings.warn(
            "leanddp.DistributedDataParallel: could not delete the process group's gloo "
            f"rendezvous keys from its store ({e}); a torchrun restart that reuses this store "
            "may read this round's addresses (docs/troubleshooting.md, restarts).",
            stacklevel=3,
        )
    return deleted
