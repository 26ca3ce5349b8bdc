"""A user's training script that ends as users' scripts do: the wrapper still alive at exit, no
``gc.collect()``, no barrier, and (with ``--destroy``) ``dist.destroy_process_group()`` as its
last statement or (without it) nothing at all. Launched under torchrun by
benchmarks/exit_counts.py and tests/reliability/test_exit_torchrun.py, which count how often it
exits cleanly, aborts or hangs in each mode (docs/troubleshooting.md, "Exiting without
cleanup"):

    OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES= python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 tests/scripts/exit_at_end.py --mode offload_sharded --destroy

Each rank prints ``rank R done`` (MARKER) once training is done, before the script ends.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist
from torch import nn

import leanddp

#: the wrappers, by mode: torch's DDP and leanddp plain (both + AdamW after backward), then
#: leanddp's in-backward modes (AdamW stepped inside backward)
MODES = ["torch", "plain", "in_backward", "offload", "sharded", "offload_sharded"]
IN_BACKWARD = {
    "in_backward": {},
    "offload": {"offload_to_cpu": True},
    "sharded": {"shard_optimizer_state": True},
    "offload_sharded": {"offload_to_cpu": True, "shard_optimizer_state": True},
}
MARKER = "rank {rank} done"


def wrap(model: nn.Module, mode: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The DDP wrapper of ``mode`` over ``model``, and the optimizer the loop steps."""
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    if mode == "torch":
        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, adamw(ddp.parameters())
    if mode == "plain":
        ddp = leanddp.DistributedDataParallel(model)
        return ddp, adamw(ddp.parameters())
    ddp = leanddp.DistributedDataParallel(model, optimizer_in_backward=adamw, **IN_BACKWARD[mode])
    return ddp, ddp.optimizer


def parse() -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--destroy", action="store_true", help="end with destroy_process_group()")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps, 2 micro-batches each")
    return p.parse_args()


if __name__ == "__main__":
    # At module level, as a user's script: ddp and optimizer are globals, alive at exit.
    args = parse()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    # about 2 MB of float32 parameters: two buckets at torch's default bucket sizes
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    ddp, optimizer = wrap(model, args.mode)
    for _ in range(args.steps):
        with ddp.no_sync():  # a micro-batch accumulated without a reduction
            ddp(torch.randn(8, 512)).square().mean().backward()
        ddp(torch.randn(8, 512)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    print(MARKER.format(rank=rank), flush=True)
    if args.destroy:
        dist.destroy_process_group()
    # the end: ddp and optimizer still alive, no gc.collect(), no barrier
