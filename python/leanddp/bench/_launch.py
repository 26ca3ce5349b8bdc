"""The launcher of ``python -m leanddp.bench``: one torchrun per configuration, then the report."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from leanddp.bench._env import environment
from leanddp.bench._model import DATA, SIZES, TinyGPT
from leanddp.bench._report import plot, table
from leanddp.bench._worker import (
    CONFIGS,
    DEVICE_ACCUMULATION,
    DTYPES,
    LOWBIT_CONFIGS,
    SHARDED,
    SHARDED_OFFLOAD,
)

DEFAULT_CONFIGS = [
    "torch DDP",
    "leanddp",
    "leanddp + optimizer_in_backward",
    "leanddp + offload_to_cpu",
    SHARDED,
    SHARDED_OFFLOAD,
    DEVICE_ACCUMULATION,
]
#: Configurations that differ from another only with accumulation: run at --accum > 1 only.
ACCUMULATION_ONLY = [DEVICE_ACCUMULATION]
#: The configurations also run at every ``--world-sizes`` value: the sharded one and its
#: unsharded counterpart (the others hold the same bytes per parameter at any world size).
SERIES_CONFIGS = ["leanddp + optimizer_in_backward", SHARDED]
#: ``--world-sizes`` on the CPU when not given: ranks share the cores, as in the main runs.
CPU_WORLD_SIZES = [2, 3, 4]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m leanddp.bench",
        description=(
            "Train a small GPT-style model on synthetic tokens once per configuration, each under "
            "its own torchrun (torch's DDP + AdamW(fused=True); leanddp with gradient views; "
            "+ optimizer_in_backward; + offload_to_cpu; optimizer_in_backward with "
            "shard_optimizer_state), with and without gradient accumulation, then the in-backward "
            "configurations, sharded and not, at each of --world-sizes (first --accum only). "
            "Prints a table of memory by category, step time and final loss, a table of bytes per "
            "parameter against world size, checks that the losses agree, and writes bench.md, "
            "bench.json and bench.png into --out. On CPU it runs 2 gloo processes; with GPUs, one "
            "NCCL process per GPU."
        ),
    )
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="ranks (default: GPUs, or 2 on CPU)"
    )
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda if any"
    )
    p.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=DEFAULT_CONFIGS,
        metavar="NAME",
        help=f"configurations to run, of {list(CONFIGS)} (default: all but torch DDP + views)",
    )
    p.add_argument(
        "--lowbit",
        action="store_true",
        help=f"also run {LOWBIT_CONFIGS} (torchao's AdamW8bit: the lowbit extra); the 8-bit "
        "configurations' step time is measured against torch's DDP + AdamW8bit",
    )
    p.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help=(
            f"world sizes at which {SERIES_CONFIGS} (those of them in --configs) run too, at the "
            "first --accum, for bytes per parameter against world size (default: "
            f"{' '.join(map(str, CPU_WORLD_SIZES))} on CPU, where ranks share the cores; "
            "--nproc-per-node with GPUs, one GPU per rank)"
        ),
    )
    p.add_argument(
        "--accum",
        type=int,
        nargs="+",
        default=[1, 4],
        help="micro-batches per step; each is run for every configuration (default: 1 4)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (default: 2)")
    p.add_argument(
        "--host-steps",
        type=int,
        default=100,
        help="offload_to_cpu: steps after the timed ones over which the share of the host step "
        "hidden is measured (default: 100)",
    )
    p.add_argument("--model", choices=list(SIZES), default="tiny", help="default: tiny")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="default: fp32")
    p.add_argument("--bucket-cap-mb", type=float, default=2.0, help="every configuration's cap")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--data",
        choices=list(DATA),
        default="repeat",
        help="; ".join(f"{name}: {text}" for name, text in DATA.items()) + ". Default: repeat",
    )
    p.add_argument(
        "--out", type=Path, default=Path("leanddp-bench"), help="default: ./leanddp-bench"
    )
    return p


def check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Bad arguments end here, before anything is launched."""
    size = SIZES[args.model]
    for name, value in (
        ("--steps", args.steps),
        ("--host-steps", args.host_steps),
        ("--nproc-per-node", args.nproc_per_node),
    ):
        if value is not None and value < 1:
            p.error(f"{name} must be at least 1, got {value}")
    if args.warmup < 1:
        p.error(
            f"--warmup must be at least 1 (the first step builds the buckets), got {args.warmup}"
        )
    for a in args.accum:
        if a < 1 or size.batch % a:
            p.error(f"--accum {a} must divide the batch of {size.batch} sequences")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no GPU")
    if args.lowbit:
        try:
            import torchao.optim  # noqa: F401  (the 8-bit configurations' optimizer)
        except ImportError:
            p.error("--lowbit needs torchao: pip install 'leanddp[lowbit]'")
        args.configs = [*args.configs, *(n for n in LOWBIT_CONFIGS if n not in args.configs)]
    for n in args.world_sizes or []:
        if n < 1:
            p.error(f"--world-sizes: every world size must be at least 1, got {n}")
        if args.device == "cuda" and n > torch.cuda.device_count():
            p.error(
                f"--world-sizes {n}: one GPU per rank, and torch sees {torch.cuda.device_count()}"
            )


def plan(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(configuration, accumulation, world size) of every run, in order: each configuration at
    each accumulation at ``--nproc-per-node`` ranks, then the series configurations at the first
    accumulation at the other ``--world-sizes``, smallest first."""
    runs = [
        (n, a, args.nproc_per_node)
        for a in args.accum
        for n in args.configs
        if a > 1 or n not in ACCUMULATION_ONLY
    ]
    series = [n for n in args.configs if n in SERIES_CONFIGS]
    for world in sorted(set(args.world_sizes) - {args.nproc_per_node}):
        runs += [(n, args.accum[0], world) for n in series]
    return runs


def launch(
    args: argparse.Namespace, name: str, accum: int, world: int, result: Path
) -> dict[str, Any]:
    """Runs one configuration under torchrun with ``world`` ranks; raises if any rank fails."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}", "--module", "leanddp.bench._worker",
        "--config", name, "--accum", str(accum), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--host-steps", str(args.host_steps),
        "--model", args.model, "--dtype", args.dtype,
        "--bucket-cap-mb", str(args.bucket_cap_mb), "--lr", str(args.lr), "--data", args.data,
        "--device", args.device, "--result", str(result),
    ]  # fmt: skip
    env = dict(os.environ)
    if args.device == "cpu":  # the cores shared out between the ranks, as torchrun users set it
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // world))
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        raise SystemExit(
            f"[leanddp.bench] {name} (accum {accum}, world size {world}) failed: "
            f"rc {done.returncode}"
        )
    outcome: dict[str, Any] = json.loads(result.read_text())
    return outcome


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m leanddp.bench``."""
    p = parser()
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.nproc_per_node is None:
        args.nproc_per_node = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.world_sizes is None:
        args.world_sizes = CPU_WORLD_SIZES if args.device == "cpu" else [args.nproc_per_node]
    check(args, p)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = plan(args)
    params = sum(p.numel() for p in TinyGPT(SIZES[args.model]).parameters())
    others = sorted(set(args.world_sizes) - {args.nproc_per_node})
    series = [n for n in args.configs if n in SERIES_CONFIGS]
    print(
        f"[leanddp.bench] {len(runs)} runs: {params / 1e6:.2f}M-parameter model, {args.dtype}, "
        f"{args.nproc_per_node} × {args.device} ({'nccl' if args.device == 'cuda' else 'gloo'})"
        + (
            f"; {' and '.join(series)} also at world size {', '.join(map(str, others))}"
            if others and series
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )
    results, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, accum, world) in enumerate(runs):
            print(
                f"[leanddp.bench] [{k + 1}/{len(runs)}] {name}, accumulation {accum}, "
                f"world size {world} ({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            results.append(launch(args, name, accum, world, Path(tmp) / f"{k}.json"))
    report = {
        "env": environment(
            "python -m leanddp.bench " + " ".join(sys.argv[1:] if argv is None else argv)
        ),
        "args": {k: str(v) for k, v in vars(args).items()},
        "params": params,
        "runs": results,
    }
    (args.out / "bench.json").write_text(json.dumps(report, indent=2))  # (first: what was run)
    text, agree = table(report)
    print(text)
    (args.out / "bench.md").write_text(text + "\n")
    if plot(report, args.out / "bench.png"):
        print(f"[leanddp.bench] wrote {args.out / 'bench.png'}", file=sys.stderr)
    print(
        f"[leanddp.bench] wrote {args.out / 'bench.md'} and bench.json "
        f"({time.perf_counter() - start:.0f} s)",
        file=sys.stderr,
    )
    if not agree:
        raise SystemExit("[leanddp.bench] the final losses differ between configurations")
