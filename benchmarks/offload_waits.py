"""Where the training loop waits for offload_to_cpu's host step, iteration by iteration.

    torchrun --standalone --nproc-per-node=2 benchmarks/offload_waits.py [--steps N] [--warmup N]

On CPU with gloo (OMP_NUM_THREADS=1 per rank on a 2-core machine), the benchmark's tiny GPT
(python -m leanddp.bench's model and loop, bucket_cap_mb=2), offload_to_cpu with and without
shard_optimizer_state, at accumulation 1 and 4. Before each step it reads which buckets' host
steps are still pending (``pending_steps()`` of its optimizer), and after it how long the worker was
busy and the loop waited (``offload_stats()``). Rank 0 prints, per configuration: the waits of
the first iterations (the first allocates the optimizer state, the second rebuilds the buckets
in gradient-ready order, which waits for the worker once), then over the iterations after
--warmup how many waited at all, the median and largest wait, and the share of the host step
hidden, next to that share over every iteration (warmup included).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from leanddp.bench._model import SIZES, TinyGPT, batches
from leanddp.bench._worker import SHARDED_OFFLOAD, build, train_step

CONFIGS = ["leanddp + offload_to_cpu", SHARDED_OFFLOAD]


def hidden(busy: list[float], waited: list[float]) -> float:
    """1 - waited / busy over the given iterations."""
    return 1 - sum(waited) / sum(busy) if sum(busy) else 0.0


def run(config: str, accum: int, args: argparse.Namespace) -> dict:
    """``args.warmup + args.steps`` iterations of one configuration: per iteration the pending
    buckets before it, the worker's busy time and the loop's wait, in seconds."""
    size = SIZES["tiny"]
    torch.manual_seed(0)
    model = TinyGPT(size)
    ns = argparse.Namespace(lr=1e-3, bucket_cap_mb=2.0)
    ddp, opt = build(config, model, ns, torch.device("cpu"))
    data = batches(size, dist.get_rank(), 4, torch.device("cpu"))
    pending, busy, waited = [], [], []
    for i in range(args.warmup + args.steps):
        pending.append(list(ddp._optimizer_core.pending_steps()))
        before = ddp.offload_stats()
        train_step(ddp, opt, data[i % len(data)], accum)
        after = ddp.offload_stats()
        busy.append(after["step_seconds"] - before["step_seconds"])
        waited.append(after["wait_seconds"] - before["wait_seconds"])
    before = ddp.offload_stats()
    ddp.synchronize()  # the last iteration's host step: counted with it
    after = ddp.offload_stats()
    busy[-1] += after["step_seconds"] - before["step_seconds"]
    waited[-1] += after["wait_seconds"] - before["wait_seconds"]
    del ddp, opt
    return dict(pending=pending, busy=busy, waited=waited)


def report(config: str, accum: int, r: dict, warmup: int) -> list[str]:
    """Markdown lines for one configuration."""
    ms = [w * 1e3 for w in r["waited"][warmup:]]
    waits = [w for w in ms if w >= 0.01]
    pending = [len(p) for p in r["pending"][warmup:]]
    first = ", ".join(
        f"{i}: waited {w * 1e3:.2f} of {b * 1e3:.2f} ms"
        for i, (w, b) in enumerate(zip(r["waited"][:warmup], r["busy"][:warmup], strict=True))
    )
    return [
        f"| {config} | {accum} | {first} | {len(ms)} | {statistics.mean(pending):.2f} "
        f"| {len(waits)} | {statistics.median(waits) if waits else 0:.2f} "
        f"| {max(ms):.2f} | {statistics.mean(r['busy'][warmup:]) * 1e3:.2f} "
        f"| {hidden(r['busy'][warmup:], r['waited'][warmup:]):.1%} "
        f"| {hidden(r['busy'], r['waited']):.1%} |"
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="iterations measured after --warmup")
    p.add_argument("--warmup", type=int, default=2, help="first iterations, shown one by one")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lines = [
        f"| configuration | accum | first {args.warmup} iterations | iterations after them "
        "| buckets pending before a step (mean) | iterations that waited | median wait (ms) "
        "| largest wait (ms) | worker busy per iteration (ms) | host step hidden "
        "| hidden, warmup included |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config in CONFIGS:
        for accum in (1, 4):
            r = run(config, accum, args)
            if rank == 0:
                print(f"{config}, accumulation {accum}: done", flush=True)
            lines += report(config, accum, r, args.warmup)
    if rank == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
