"""Where each memory-saving mode's step time goes, against torch's DDP, phase by phase.

    torchrun --standalone --nproc-per-node=2 benchmarks/mode_phases.py [--steps N] [--accum N]

On CPU with gloo (OMP_NUM_THREADS=1 per rank on a 2-core machine), the benchmark's tiny GPT
(python -m leanddp.bench's model, bucket_cap_mb=2): for each mode, its steps alternate with
torch's DDP + AdamW(fused=True) in the same processes, and each step is cut into forward (all
micro-batches), backward (all; the synchronized one separately: the reductions and the
in-backward steps happen there), the optimizer step of the loop (torch's side; leanddp's modes
step inside backward) and ``ddp.synchronize()`` (what the host step left to wait for). Then the
collectives the modes rely on, alone, over the model's bytes in its buckets: allreduce (every
mode), all-gather (shard_optimizer_state's gather of the updated shards) and reduce-scatter.
Rank 0 prints a markdown table of medians in ms.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist

import leanddp
from leanddp.bench._model import SIZES, TinyGPT, batches, loss_of
from leanddp.bench._worker import build

MODES = [
    "leanddp + optimizer_in_backward",
    "leanddp + offload_to_cpu",
    "leanddp in-backward sharded",
    "leanddp offload sharded",
]
PHASES = ["forward", "backward", "synced backward", "loop step", "synchronize", "step"]


def step_phases(ddp, opt, batch: torch.Tensor, accum: int) -> dict[str, float]:
    """One training step's phases, in seconds."""
    out = dict.fromkeys(PHASES, 0.0)
    start = time.perf_counter()
    for i, micro in enumerate(batch.chunk(accum)):
        with contextlib.nullcontext() if i == accum - 1 else ddp.no_sync():
            a = time.perf_counter()
            loss = loss_of(ddp, micro) / accum
            b = time.perf_counter()
            loss.backward()
            c = time.perf_counter()
        out["forward"] += b - a
        out["backward"] += c - b
        out["synced backward"] = c - b
    a = time.perf_counter()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    b = time.perf_counter()
    if isinstance(ddp, leanddp.DistributedDataParallel):
        ddp.synchronize()
    c = time.perf_counter()
    out["loop step"], out["synchronize"], out["step"] = b - a, c - b, c - start
    return out


def collectives(numel: int, bucket: int, rounds: int) -> dict[str, float]:
    """Median seconds of each collective over ``numel`` floats in buckets of ``bucket``."""
    flats = [torch.randn(bucket) for _ in range(max(1, numel // bucket))]
    world = dist.get_world_size()
    outs = [torch.empty(f.numel() // world) for f in flats]

    def run(make) -> float:
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            for work in [make(f, o) for f, o in zip(flats, outs, strict=True)]:
                work.wait()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    return {
        "allreduce": run(lambda f, o: dist.all_reduce(f, async_op=True)),
        "all-gather": run(lambda f, o: dist.all_gather_into_tensor(f, o, async_op=True)),
        "reduce-scatter": run(lambda f, o: dist.reduce_scatter_tensor(o, f, async_op=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16, help="timed steps of each side")
    parser.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank0 = dist.get_rank() == 0
    size = SIZES["tiny"]
    data = batches(size, dist.get_rank(), 4, torch.device("cpu"))
    opts = argparse.Namespace(lr=1e-3, bucket_cap_mb=2.0, model="tiny", dtype="fp32")
    rows = []
    for mode in MODES:
        for accum in args.accum:
            sides = []
            for name in (mode, "torch DDP"):
                torch.manual_seed(0)
                sides.append(build(name, TinyGPT(size), opts, torch.device("cpu")))
            times: list[list[dict[str, float]]] = [[], []]
            for i in range(2 + args.steps):  # two warm-up rounds
                for k in (0, 1) if i % 2 == 0 else (1, 0):
                    phases = step_phases(*sides[k], data[i % len(data)], accum)
                    if i >= 2:
                        times[k].append(phases)
            med = [{p: statistics.median(t[p] for t in side) for p in PHASES} for side in times]
            rows.append((mode, accum, med))
            if rank0:
                print(f"[mode_phases] {mode}, accumulation {accum}: done", flush=True)
            del sides
    numel = sum(p.numel() for p in TinyGPT(size).parameters())
    comm = collectives(numel, int(2.0 * 2**20) // 4, rounds=12)
    if not rank0:
        dist.destroy_process_group()
        return
    ms = 1e3
    print(
        "\n| mode | accum | "
        + " | ".join(f"{p} (ms, ours / torch's)" for p in PHASES)
        + " | step vs torch DDP |"
    )
    print("|---|---:|" + "---:|" * (len(PHASES) + 1))
    for mode, accum, (ours, ref) in rows:
        cells = " | ".join(f"{ours[p] * ms:.1f} / {ref[p] * ms:.1f}" for p in PHASES)
        print(f"| {mode} | {accum} | {cells} | {ours['step'] / ref['step']:.3f} |")
    print(
        f"\nCollectives alone over the model's {numel * 4 / 1e6:.1f} MB in 2 MiB buckets, "
        f"{dist.get_world_size()} gloo ranks (ms): "
        + ", ".join(f"{k} {v * ms:.1f}" for k, v in comm.items())
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
