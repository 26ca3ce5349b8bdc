"""The speed guard CI runs: leanddp against torch's own, as ratios measured in one run, failing
only on a regression far outside noise.

    python benchmarks/speed_guard.py [--steps N] [--json PATH]

What it measures (each anchor in the same process as its contenders, alternating round by
round, medians; a ratio above 1 means leanddp is faster, except for the modes):
  adamw      adamw_step_ over 8M float32 parameters, one flat tensor and GPT-shaped tensors,
             against torch.optim.AdamW(fused=True) on the same data, at 1 and 2 threads
  flatten    flatten_into of the GPT-shaped list against torch.cat(out=)
  unflatten  unflatten_from back into it against torch._foreach_copy_
  modes      python -m leanddp.bench on 2 gloo ranks (the tiny GPT, accumulation 1): each
             memory-saving mode's step time over torch's DDP + AdamW(fused=True), their steps
             alternating in the same processes (above 1 means slower)
It exits 1 when a figure crosses its limit (LIMITS): limits far from what the code achieves
(for example AdamW at 1.0-1.1x torch's fused step, the modes near 1.0x torch's DDP), so noise
on a shared 2-core runner does not fail it, a kernel that stops vectorizing (0.15-0.2x) or a
mode that gains a per-bucket synchronization does. Prints every figure; takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_host_step import shapes_for
from bench_ops import Timer, adamw_case, flatten_case, log, run_case, unflatten_case

from leanddp.bench._env import environment

NUMEL = 8 << 20
ROUNDS = 15
MODES = [
    "leanddp + optimizer_in_backward",
    "leanddp + offload_to_cpu",
    "leanddp in-backward sharded",
    "leanddp offload sharded",
]
#: figure -> (limit, "min" or "max"): the run fails when a figure is below a min or above a max.
LIMITS = {
    "adamw": (0.6, "min"),
    "flatten": (0.5, "min"),
    "unflatten": (0.5, "min"),
    "mode": (1.3, "max"),
}


def kernel_figures() -> list[tuple[str, str, float]]:
    """(figure kind, what, ratio to torch's anchor) of the CPU ops."""
    rows = []
    timer = Timer("cpu")
    shaped = [torch.randn(s) for s in shapes_for(NUMEL, "tensors", 512)]
    for p in shaped:
        p.grad = torch.randn_like(p)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for layout, params in (("flat", [torch.randn(NUMEL)]), ("GPT-shaped", shaped)):
            for p in params:
                p.grad = torch.randn_like(p) if p.grad is None else p.grad
            _, anchor, _, contenders = adamw_case(params)
            pick = {k: contenders[k] for k in (anchor, "leanddp adamw_step_ (list)")}
            t = run_case(timer, pick, ROUNDS)
            what = f"adamw_step_ {layout}, {threads} thread{'s' * (threads > 1)}"
            rows.append(("adamw", what, t[anchor] / t["leanddp adamw_step_ (list)"]))
            log(f"[speed_guard] {what}: {rows[-1][2]:.2f}x torch's fused AdamW")
    for kind, case, ours in (
        ("flatten", flatten_case("flatten", shaped), "leanddp flatten_into"),
        ("unflatten", unflatten_case(shaped), "leanddp unflatten_from"),
    ):
        _, anchor, _, contenders = case
        t = run_case(timer, {k: contenders[k] for k in (anchor, ours)}, ROUNDS)
        rows.append((kind, f"{ours} vs {anchor}, 2 threads", t[anchor] / t[ours]))
        log(f"[speed_guard] {rows[-1][1]}: {rows[-1][2]:.2f}x")
    return rows


def mode_figures(steps: int) -> list[tuple[str, str, float]]:
    """(figure kind, what, step time over torch's DDP) of each mode, from leanddp.bench."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable, "-m", "leanddp.bench", "--configs", *MODES, "--accum", "1",
            "--world-sizes", "2", "--steps", str(steps), "--warmup", "1", "--out", out,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        runs = json.loads((Path(out) / "bench.json").read_text())["runs"]
    rows = []
    for r in runs:
        v = r["interleaved"]
        rows.append(("mode", f"{r['config']}, accumulation {r['accum']}", v["ratio"]))
        ours, theirs = (statistics.median(v[k]) * 1e3 for k in ("ours", "torch"))
        log(
            f"[speed_guard] {rows[-1][1]}: {v['ratio']:.3f}x torch DDP's step (medians "
            f"{ours:.1f} and {theirs:.1f} ms)"
        )
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="interleaved steps per mode")
    parser.add_argument("--json", type=Path, help="write the figures and environment here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = kernel_figures() + mode_figures(args.steps)
    failed = []
    print("| figure | ratio | limit | |\n|---|---:|---:|---|")
    for kind, what, ratio in rows:
        limit, side = LIMITS[kind]
        ok = ratio >= limit if side == "min" else ratio <= limit
        failed += [] if ok else [what]
        bound = f"≥ {limit}" if side == "min" else f"≤ {limit}"
        print(f"| {what} | {ratio:.3f} | {bound} | {'ok' if ok else 'REGRESSION'} |")
    env = environment("python benchmarks/speed_guard.py " + " ".join(argv))
    print(f"\n{env['cpu']}, {env['cpus']} CPUs, torch {env['torch']}, leanddp {env['leanddp']}")
    print(f"{time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    if failed:
        print(f"speed guard: {len(failed)} regression(s): {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
