"""Launched by tests/integration/test_torchrun.py with torchrun: trains leanddp and torch's DDP
side by side on the environment torchrun sets up and checks they agree bitwise; rank 0 prints
PARITY OK."""

import os
import sys

import torch
import torch.distributed as dist

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "support"))
from ddp_models import Case, LockStep, Net, assert_same  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    run = LockStep(Net(rank=rank), Case(optimizer="adamw", accum=2))
    for step in range(5):
        run.backward([torch.randn(6, 12) for _ in range(2)])
        run.step()
        for name, a, b in run.pairs():
            assert_same(a, b, f"step {step} {name}", exact=True)
    dist.barrier()
    # what torchrun told this process: its node (GROUP_RANK) and its place on it
    print(f"rank {rank} of {dist.get_world_size()} on node {os.environ['GROUP_RANK']}", flush=True)
    if rank == 0:
        print("PARITY OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
