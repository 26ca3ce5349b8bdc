"""Final losses of fp32 AdamW and 8-bit AdamW on the bench's GPT, over nearby learning rates.

The bench's tiny GPT fits its 4 batches of random tokens: after 300 steps the loss is about
0.022, down from 7.67. A final loss that small moves with every rounding difference along the
way, so one run per optimizer cannot tell how far 8-bit state is from float32 state. This runs
``python -m leanddp.bench`` (torch's DDP with ``AdamW(fused=True)``, and with torchao's
``AdamW8bit``; other bench configurations on request) at ``--points`` learning rates spaced
``--jitter`` apart (relative) around ``--lr``, and reports, per learning rate and over them all:

- each configuration's final loss and mean loss over the last 20 steps, and its difference
  from the first configuration's (the fp32 reference) at the same learning rate;
- how much the reference's own final loss moves between neighbouring learning rates: the
  noise floor of one comparison.

Writes convergence.md, convergence.json and convergence.png into ``--out``; a learning rate
whose bench.json is already there with the same arguments is read, not run again.

``--data markov`` trains on the bench's other data instead: a new batch every step from a fixed
Markov chain whose tokens each have 2 successors, so the loss falls towards a floor (ln 2) rather
than towards 0, and the final losses compare how well each optimizer has learnt the chain.

    PYTHONPATH=python python benchmarks/convergence.py [--points 7] [--jitter 5e-4] [--data markov]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from leanddp.bench._model import DATA

REFERENCE = "torch DDP"
LAST = 20  # steps averaged for the mean final loss


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lr", type=float, default=1e-3, help="the central learning rate")
    p.add_argument("--jitter", type=float, default=5e-4, help="relative spacing of the rates")
    p.add_argument("--points", type=int, default=7, help="learning rates (odd: lr in the middle)")
    p.add_argument("--steps", type=int, default=300, help="steps after the first (default 300)")
    p.add_argument(
        "--configs",
        nargs="+",
        default=[REFERENCE, "torch DDP + AdamW8bit"],
        help="bench configurations; the first is the reference (default: torch DDP, with "
        "AdamW(fused=True), and torch DDP + AdamW8bit, torchao's)",
    )
    p.add_argument(
        "--data",
        choices=list(DATA),
        default="repeat",
        help="the bench's data: "
        + "; ".join(f"{name}, {text}" for name, text in DATA.items())
        + ". Default: repeat",
    )
    p.add_argument("--out", type=Path, default=Path("leanddp-convergence"))
    return p


def rates(args: argparse.Namespace) -> list[float]:
    half = (args.points - 1) / 2
    return [float(f"{args.lr * (1 + (k - half) * args.jitter):.9g}") for k in range(args.points)]


def bench_args(args: argparse.Namespace, lr: float, out: Path) -> list[str]:
    return [
        "--configs", *args.configs, "--accum", "1", "--steps", str(args.steps), "--warmup", "1",
        "--host-steps", "1", "--world-sizes", "2", "--nproc-per-node", "2", "--device", "cpu",
        "--lr", repr(lr), "--data", args.data, "--out", str(out),
    ]  # fmt: skip


def same_run(found: dict[str, Any], args: argparse.Namespace, lr: float) -> bool:
    """Whether a bench.json already in place ran these configurations at ``lr``."""
    a = found["args"]
    return (
        a["configs"] == str(args.configs)
        and float(a["lr"]) == lr
        and int(a["steps"]) == args.steps
        and a["accum"] == "[1]"
        and a["model"] == "tiny"
        and a["dtype"] == "fp32"
        and a.get("data", "repeat") == args.data
    )


def read(path: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(path.read_text())
    return found


def run_one(args: argparse.Namespace, lr: float, index: int) -> dict[str, Any]:
    """The bench's results at ``lr``: run now, or read where the same run left them."""
    out = args.out / f"lr{lr!r}"
    path = out / "bench.json"
    tag = f"[convergence] lr {lr!r} ({index + 1}/{args.points})"
    if path.exists() and same_run(found := read(path), args, lr):
        print(f"{tag}: read from {path}", file=sys.stderr, flush=True)
        return found
    print(f"{tag}: running", file=sys.stderr, flush=True)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "leanddp.bench", *bench_args(args, lr, out)]
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
        raise SystemExit(f"{tag}: the bench failed")
    print(f"{tag}: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return read(path)


def finals(found: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Configuration -> (final loss, mean of the last LAST losses)."""
    return {
        r["config"]: (r["losses"][-1], statistics.fmean(r["losses"][-LAST:])) for r in found["runs"]
    }


def relative(a: float, b: float) -> float:
    return (a - b) / b


#: per learning rate: configuration -> (final loss, mean of the last LAST losses)
Table = list[dict[str, tuple[float, float]]]


def report(args: argparse.Namespace, lrs: list[float], table: Table, env: dict[str, Any]) -> str:
    """convergence.md: ``table``'s rows against the reference, then the summary lines."""
    ref, others = args.configs[0], args.configs[1:]
    lines = [
        "# Final losses over nearby learning rates",
        "",
        f"`python benchmarks/convergence.py --lr {args.lr!r} --jitter {args.jitter!r} --points "
        f"{args.points} --steps {args.steps} --data {args.data} --configs "
        f"{' '.join(map(repr, args.configs))}`; "
        f"each row one `python -m leanddp.bench` run (2 "
        f"gloo ranks, the tiny GPT, fp32, 1 + {args.steps} steps); torch {env['torch']}, "
        f"Python {env['python']}, {env['cpu']}. Differences are relative to {ref} at the same "
        f"learning rate; negative is lower. Mean: of the last {LAST} steps' losses. Data: "
        + DATA[args.data]
        + ".",
        "",
        "| lr | "
        + " | ".join(f"{c} final | mean" for c in args.configs)
        + " | "
        + " | ".join(f"{c}: final vs {ref} | mean vs {ref}" for c in others)
        + " |",
        "|---:" * (1 + 2 * len(args.configs) + 2 * len(others)) + "|",
    ]
    for lr, row in zip(lrs, table, strict=True):
        cells = [f"{row[c][0]:.6f} | {row[c][1]:.6f}" for c in args.configs]
        diffs = [
            f"{relative(row[c][0], row[ref][0]):+.2%} | {relative(row[c][1], row[ref][1]):+.2%}"
            for c in others
        ]
        lines.append(f"| {lr!r} | " + " | ".join(cells + diffs) + " |")
    lines.append("")
    ref_final = [row[ref][0] for row in table]
    steps = [abs(relative(b, a)) for a, b in zip(ref_final, ref_final[1:], strict=False)]
    if steps:
        lines.append(
            f"- {ref}'s own final loss between neighbouring learning rates ({args.jitter:.2%} "
            f"apart): mean change {statistics.fmean(steps):.2%}, largest {max(steps):.2%}; "
            f"over all {len(lrs)}: {min(ref_final):.6f} to {max(ref_final):.6f}."
        )
    for c in others:
        for k, what in ((0, "final loss"), (1, f"mean of the last {LAST}")):
            d = [relative(row[c][k], row[ref][k]) for row in table]
            spread = f", standard deviation {statistics.stdev(d):.2%}" if len(d) > 1 else ""
            within = sum(abs(x) <= 0.01 for x in d)
            lines.append(
                f"- {c} against {ref}, {what}: mean {statistics.fmean(d):+.2%}{spread}, "
                f"from {min(d):+.2%} to {max(d):+.2%}; within 1% at {within} of {len(d)} rates."
            )
    return "\n".join(lines) + "\n"


def plot(args: argparse.Namespace, lrs: list[float], table: Table) -> bool:
    """convergence.png: each configuration's final loss against the learning rate; False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[convergence] matplotlib is not installed: no PNG written", file=sys.stderr)
        return False

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in args.configs:
        ax.plot(lrs, [row[c][0] for row in table], marker="o", label=c)
    ax.set_xlabel("learning rate")
    ax.set_ylabel(f"final loss after {1 + args.steps} steps")
    ax.set_title(f"The bench's GPT ({args.data} data): final loss over nearby learning rates")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "convergence.png", dpi=120)
    plt.close(fig)
    return True


def check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Bad arguments end here, before anything is written or launched."""
    from leanddp.bench._worker import CONFIGS

    if args.lr <= 0:
        p.error(f"--lr must be above 0, got {args.lr}")
    if args.points < 1:
        p.error(f"--points must be at least 1, got {args.points}")
    if args.jitter < 0:
        p.error(f"--jitter must be at least 0, got {args.jitter}")
    if args.jitter * (args.points - 1) / 2 >= 1:
        p.error(f"--jitter {args.jitter} with --points {args.points} reaches a rate <= 0")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: no bench configuration {unknown}; the bench has {list(CONFIGS)}")
    if len(args.configs) < 2 or len(set(args.configs)) < len(args.configs):
        p.error(f"--configs: a reference and at least one other, each once, got {args.configs}")


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    check(args, p)
    args.out.mkdir(parents=True, exist_ok=True)
    lrs = rates(args)
    per_lr = [run_one(args, lr, i) for i, lr in enumerate(lrs)]
    table = [finals(f) for f in per_lr]
    md = report(args, lrs, table, per_lr[0]["env"])
    (args.out / "convergence.md").write_text(md)
    summary = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rates": {repr(lr): row for lr, row in zip(lrs, table, strict=True)},
    }
    (args.out / "convergence.json").write_text(json.dumps(summary, indent=1))
    written = "md,json,png" if plot(args, lrs, table) else "md,json"
    print(md)
    print(f"[convergence] wrote {args.out}/convergence.{{{written}}}", file=sys.stderr)


if __name__ == "__main__":
    main()
