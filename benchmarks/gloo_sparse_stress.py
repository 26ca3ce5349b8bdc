"""How often gloo's sparse allreduce corrupts a rank's heap: a DDP over a model with two sparse
embeddings (tests/support/sparse_models.py's SparseNet) trained on 2 gloo ranks for ``--steps``
steps, ``--runs`` times, each run in fresh forked processes; prints each run that died (SIGSEGV,
or SIGABRT after "malloc(): unaligned tcache chunk detected") and the count.

    python benchmarks/gloo_sparse_stress.py --ddp torch --threads 2 --runs 5
    python benchmarks/gloo_sparse_stress.py --ddp torch --threads 1 --runs 5
    python benchmarks/gloo_sparse_stress.py --ddp leanddp --runs 5

torch's DDP lets a sparse bucket's allreduce run beside other collectives of its group; gloo runs
a group's collectives on ``--threads`` worker threads (2 is torch's default), so with one thread
they run one at a time. leanddp runs a sparse reduction alone on its group (reducer_sparse.cpp).
Results: benchmarks/results/gloo_sparse.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from _ranks import free_port  # noqa: E402
from sparse_models import BATCH, DIM, VOCAB, SparseNet, gloo_group  # noqa: E402 (the tests')

import leanddp  # noqa: E402


def rank_main(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.manual_seed(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    ddp_class = (torch.nn.parallel.DistributedDataParallel if args.ddp == "torch"
                 else leanddp.DistributedDataParallel)  # fmt: skip
    ddp = ddp_class(SparseNet(), process_group=gloo_group(args.threads))
    for _ in range(args.steps):
        idx, x = torch.randint(0, VOCAB, (BATCH, 3)), torch.randn(BATCH, DIM)
        ddp(idx, x).square().mean().backward()
        for p in ddp.parameters():
            p.grad = None
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ddp", choices=["torch", "leanddp"], default="torch")
    p.add_argument("--threads", type=int, default=2, help="gloo worker threads of the group")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    died = 0
    for run in range(args.runs):
        try:
            mp.start_processes(rank_main, args=(free_port(), args), nprocs=2, start_method="fork")
            print(f"[gloo_sparse_stress] run {run + 1}/{args.runs}: finished", flush=True)
        except mp.ProcessExitedException as e:
            died += 1
            print(f"[gloo_sparse_stress] run {run + 1}/{args.runs}: {e}", flush=True)
    print(f"{args.ddp}'s DDP, gloo threads {args.threads}, {args.steps} steps: {died} of "
          f"{args.runs} runs died (torch {torch.__version__})")  # fmt: skip


if __name__ == "__main__":
    main()
