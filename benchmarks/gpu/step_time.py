"""Step time of leanddp's configurations against torch's DDP, interleaved in one process.

    python benchmarks/gpu/step_time.py [--dtype bf16,fp32] [--accum 1,4] [--out DIR]   # on a GPU
    python benchmarks/gpu/step_time.py --smoke --out DIR   # CPU, tiny model: checks the script

One process, world size 1 (NCCL on the GPU, gloo on the CPU). For every dtype and accumulation,
all six wrappers are built up front on copies of the same model (as `python -m leanddp.bench`
builds them): torch's DDP + AdamW(fused=True) with and without gradient_as_bucket_view, leanddp
with the same optimizer, leanddp + optimizer_in_backward, leanddp + offload_to_cpu and leanddp
in-backward sharded (optimizer_in_backward with shard_optimizer_state; the same AdamW factory).
At world size 1 a rank's shard is the whole bucket: the sharded run measures what the sharded
path costs (its padded buckets, the reduce-scatter and the all-gather of the stepped weights), not
its memory saving, which `python -m leanddp.bench` measures at several world sizes. After warm-up
steps, every round runs each configuration K steps back to back (the
order rotates from round to round), timed around the block: torch.cuda.synchronize() +
perf_counter on a GPU, perf_counter on the CPU; offload_to_cpu's block ends with
ddp.synchronize(), so its host work stays inside it. A step is ``accum`` micro-batches of one
global batch, the first accum - 1 under no_sync(). Reported: the median step time over rounds
and its ratio to torch's DDP measured in the same rounds; for offload_to_cpu the share of the
host step hidden behind backward, 1 - wait_seconds / step_seconds from offload_stats() over the
timed steps; the sharded run against torch's DDP (its target) and against the unsharded
in-backward run; after the timed steps, the largest difference of any parameter from torch's DDP's,
relative to the largest parameter magnitude (every configuration saw the same batches and
steps). Writes step_time.json into --out after every (dtype, accumulation); progress on stderr;
a markdown table and the VERDICT lines last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time

import _common as c
import torch
import torch.distributed as dist

from leanddp.bench._model import SIZES, loss_of

NAME = "step_time"
log = functools.partial(c.log, NAME)  # a progress line on stderr
ANCHOR = "torch DDP"
VIEWS_ANCHOR = "torch DDP + views"
SHARDED = c.SHARDED
#: (contender, anchor): the comparisons reported
PAIRS = [
    ("leanddp", ANCHOR),
    ("leanddp", VIEWS_ANCHOR),
    ("leanddp + optimizer_in_backward", ANCHOR),
    ("leanddp + offload_to_cpu", ANCHOR),
    (SHARDED, ANCHOR),
    (SHARDED, "leanddp + optimizer_in_backward"),
    # offload_to_cpu accumulating on the host (its default) against on the device
    ("leanddp + offload_to_cpu", c.DEVICE_ACCUMULATION),
]
OFFLOAD = "leanddp + offload_to_cpu"
#: leanddp (views) against torch's DDP with views: at most this step-time ratio
MAX_RATIO = 1.00
#: leanddp in-backward sharded against torch's DDP (NCCL): at most this step-time ratio
SHARD_MAX_RATIO = 1.00
#: offload_to_cpu: at least this share of the host optimizer step hidden behind backward
MIN_HIDDEN = 0.80
#: parameters after the timed steps against torch's DDP: largest difference over the largest
#: magnitude. In-backward and offloaded steps round differently from torch's AdamW.
PARAM_TOLERANCE = {"bf16": 1e-2, "fp32": 1e-4}


def train_step(ddp, opt, batch: torch.Tensor, accum: int) -> torch.Tensor:
    """One optimizer step over ``accum`` micro-batches; the mean loss, as a tensor (no sync)."""
    total = torch.zeros((), device=batch.device)
    for i, micro in enumerate(batch.chunk(accum)):
        with contextlib.nullcontext() if i == accum - 1 else ddp.no_sync():
            loss = loss_of(ddp, micro) / accum
            loss.backward()
        total += loss.detach()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return total


class Run:
    """One configuration: its wrapper, its optimizer, how many steps it took, its last loss."""

    def __init__(self, name: str, master, args, dtype: str) -> None:
        model = c.fresh_copy(master, args.device, c.DTYPES[dtype])
        self.name, self.steps, self.loss = name, 0, None
        self.ddp, self.opt = c.build(name, model, args, args.device)
        self.cuda = args.device.type == "cuda"

    def block(self, k: int, data: list[torch.Tensor], accum: int) -> float:
        """Seconds per step of ``k`` steps back to back (the host work of offload included)."""
        c.sync(self.cuda)
        start = time.perf_counter()
        for _ in range(k):
            self.loss = train_step(self.ddp, self.opt, data[self.steps % len(data)], accum)
            self.steps += 1
        if self.name == OFFLOAD:
            self.ddp.synchronize()
        c.sync(self.cuda)
        return (time.perf_counter() - start) / k


def param_difference(run: Run, ref: Run) -> float:
    """max |p - p_ref| over all parameters, over max |p_ref| (float32 arithmetic)."""
    diff = scale = 0.0
    with torch.no_grad():
        pairs = zip(run.ddp.module.parameters(), ref.ddp.module.parameters(), strict=True)
        for p, q in pairs:
            diff = max(diff, (p.float() - q.float()).abs().max().item())
            scale = max(scale, q.float().abs().max().item())
    return diff / scale


def measure(master, data, args, dtype: str, accum: int) -> dict:
    """Every configuration interleaved for one (dtype, accumulation)."""
    c.free(args.device)
    runs = {name: Run(name, master, args, dtype) for name in c.CONFIGS}
    for run in runs.values():
        run.block(args.warmup, data, accum)
    before = runs[OFFLOAD].ddp.offload_stats()
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(runs[name].block(args.steps, data, accum))
        log(
            f"{dtype} accum {accum} round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms" for n in names)
        )
    after = runs[OFFLOAD].ddp.offload_stats()
    host = {k: after[k] - before[k] for k in ("step_seconds", "wait_seconds", "buckets")}
    host["hidden"] = 1 - host["wait_seconds"] / host["step_seconds"] if host["step_seconds"] else 0
    configs = {}
    for name, run in runs.items():
        median = statistics.median(times[name])
        configs[name] = dict(
            step_seconds=median,
            times=times[name],
            steps=run.steps,
            final_loss=float(run.loss),
            param_rel_diff=param_difference(run, runs[ANCHOR]),
        )
    ratios = []
    for contender, anchor in PAIRS:
        per_round = [a / b for a, b in zip(times[contender], times[anchor], strict=True)]
        ratio = configs[contender]["step_seconds"] / configs[anchor]["step_seconds"]
        ratios.append(
            dict(
                contender=contender,
                anchor=anchor,
                ratio=ratio,
                median_round_ratio=statistics.median(per_round),
            )
        )
    del runs
    return dict(
        dtype=dtype,
        accum=accum,
        configs=configs,
        ratios=ratios,
        host_step=host,
        param_tolerance=PARAM_TOLERANCE[dtype],
    )


def verdicts(results: list[dict], smoke: bool) -> list[dict]:
    """Per (dtype, accum): leanddp vs torch's DDP with views, leanddp in-backward sharded vs
    torch's DDP, the hidden host step, and the parameter agreement of every leanddp
    configuration (checked on the CPU too)."""
    out = []
    for res in results:
        where = f"{res['dtype']} accum {res['accum']}"
        pair = next(
            r for r in res["ratios"] if (r["contender"], r["anchor"]) == ("leanddp", VIEWS_ANCHOR)
        )
        out.append(
            c.verdict(
                f"{where} step time leanddp vs {VIEWS_ANCHOR} {pair['ratio']:.3f}x",
                f"target ≤ {MAX_RATIO:.2f}",
                pair["ratio"] <= MAX_RATIO,
                smoke,
            )
        )
        pair = next(r for r in res["ratios"] if (r["contender"], r["anchor"]) == (SHARDED, ANCHOR))
        out.append(
            c.verdict(
                f"{where} step time {SHARDED} vs {ANCHOR} {pair['ratio']:.3f}x",
                f"target ≤ {SHARD_MAX_RATIO:.2f}",
                pair["ratio"] <= SHARD_MAX_RATIO,
                smoke,
            )
        )
        hidden = res["host_step"]["hidden"]
        out.append(
            c.verdict(
                f"{where} host step hidden {OFFLOAD} {hidden:.0%}",
                f"target ≥ {MIN_HIDDEN:.0%}",
                hidden >= MIN_HIDDEN,
                smoke,
            )
        )
        tol = res["param_tolerance"]
        for name, cfg in res["configs"].items():
            if name.startswith("leanddp"):
                d = cfg["param_rel_diff"]
                out.append(
                    c.verdict(
                        f"{where} parameters {name} vs {ANCHOR} {d:.1e} relative",
                        f"tolerance {tol:.0e}",
                        d <= tol,
                        False,
                        "agree" if d <= tol else "DIFFER",
                    )
                )
    return out


def markdown(report: dict) -> str:
    """One row per (dtype, accumulation, configuration)."""
    a = report["args"]
    lines = [
        f"{report['numel'] / 1e6:.2f}M parameters, {a['model']}, batch {a['batch']} x seq "
        f"{SIZES[a['model']].seq}, bucket_cap_mb={a['bucket_cap_mb']:g}; {a['rounds']} rounds of "
        f"{a['steps']} steps per configuration after {a['warmup']} warm-up steps; medians",
        "",
        f"| dtype | accum | configuration | step (ms) | vs {ANCHOR} | vs {VIEWS_ANCHOR} "
        f"| parameters vs {ANCHOR} (relative) | final loss | host step hidden |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in report["results"]:
        cfg = res["configs"]
        for name, r in cfg.items():
            hidden = f"{res['host_step']['hidden']:.0%}" if name == OFFLOAD else "—"
            lines.append(
                f"| {res['dtype']} | {res['accum']} | {name} | {r['step_seconds'] * 1e3:.1f} "
                f"| {r['step_seconds'] / cfg[ANCHOR]['step_seconds']:.3f} "
                f"| {r['step_seconds'] / cfg[VIEWS_ANCHOR]['step_seconds']:.3f} "
                f"| {r['param_rel_diff']:.1e} | {r['final_loss']:.5f} | {hidden} |"
            )
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked: a usage error exits with code 2 before any work."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.common_arguments(p)
    p.add_argument("--dtype", help="comma-separated: bf16, fp32 (default; fp32 with --smoke)")
    p.add_argument("--accum", default="1,4", help="micro-batches per step, comma-separated")
    p.add_argument("--model", choices=list(SIZES), help="default: gpt2 (tiny with --smoke)")
    p.add_argument("--batch", type=int, help="global batch; default: the model's (4 with --smoke)")
    p.add_argument("--rounds", type=int, help="default: 7 (2 with --smoke)")
    p.add_argument("--steps", type=int, help="steps per block, K; default: 3 (1 with --smoke)")
    p.add_argument("--warmup", type=int, help="steps before timing; default: 2 (1 with --smoke)")
    args = p.parse_args(argv)
    args.device = c.finish_arguments(p, args)
    default = "fp32" if args.smoke else "bf16,fp32"  # bf16 is slow on CPUs without AMX
    args.dtype = c.parse_list(p, args.dtype or default, "--dtype", list(c.DTYPES))
    args.accum = c.parse_positive_ints(p, args.accum, "--accum")
    args.model = args.model or ("tiny" if args.smoke else "gpt2")
    for opt, smoke, gpu in (
        ("batch", 4, SIZES[args.model].batch),
        ("rounds", 2, 7),
        ("steps", 1, 3),
        ("warmup", 1, 2),
    ):
        if getattr(args, opt) is None:
            setattr(args, opt, smoke if args.smoke else gpu)
    for opt in ("batch", "rounds", "steps", "warmup"):
        if getattr(args, opt) < 1:
            p.error(f"--{opt} must be at least 1")
    bad = [k for k in args.accum if args.batch % k]
    if bad:
        p.error(f"--accum {bad} does not divide --batch {args.batch}")
    return args


def main(argv: list[str]) -> int:
    """Runs the benchmark; writes its JSON (and chart) into --out, prints its table."""
    args = parse(argv)
    began = time.perf_counter()
    size, master, gen = c.start(args)  # the same weights and batches for every configuration
    shape = (args.batch, size.seq + 1)
    data = [torch.randint(0, size.vocab, shape, generator=gen).to(args.device) for _ in range(4)]
    numel = sum(p.numel() for p in master.parameters())
    log(
        f"{args.model} on {args.device}, dtypes {','.join(args.dtype)}, accum "
        f"{','.join(map(str, args.accum))}, batch {args.batch}{' (smoke)' if args.smoke else ''}"
    )
    results: list[dict] = []
    for dtype in args.dtype:
        for accum in args.accum:
            results.append(measure(master, data, args, dtype, accum))
            pair = results[-1]["ratios"][1]
            log(
                f"{dtype} accum {accum}: leanddp vs {VIEWS_ANCHOR} {pair['ratio']:.3f}x, "
                f"host step hidden {results[-1]['host_step']['hidden']:.0%}"
            )
            # written after every measurement: a run cut short still leaves what it measured
            done = len(results) == len(args.dtype) * len(args.accum)
            fields = dict(numel=numel, complete=done, results=results)
            report = c.report(argv, args, began, verdicts=verdicts(results, args.smoke), **fields)
            path = c.write_json(args.out, NAME, report)
    c.free(args.device)
    dist.destroy_process_group()
    log(f"wrote {path} in {report['seconds']:.1f} s")
    print(markdown(report), "", *(v["line"] for v in report["verdicts"]), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
