"""Memory through one training step: torch's DDP against leanddp's configurations.

    python benchmarks/gpu/memory_timeline.py [--dtypes fp32,bf16] [--out DIR]   # on a GPU
    python benchmarks/gpu/memory_timeline.py --smoke --out DIR   # CPU, tiny model: a check

One process, world size 1 (NCCL on the GPU, gloo on the CPU). For every dtype (parameters in it)
and configuration a fresh copy of the same model is wrapped, trained 2 warm-up steps with AdamW,
then one measured step:
- timeline: a post-accumulate-grad hook on every parameter samples memory as gradients arrive
  (x: hook index in firing order): the caching allocator's active bytes on a GPU (allocated
  blocks, and freed ones that a stream they were recorded on has not passed yet: a bucket released
  onto the side stream counts until its step ran, which torch.cuda.memory_allocated() would not
  show); on the CPU, bytes held
  by account (parameters, device optimizer state, buckets, gradients outside them: leanddp's
  memory_stats(), torch's param.grad storages and logged bucket sizes; no activations).
- peak: the allocator's peak active bytes over the measured step (CPU: the largest sample).
- baseline A per dtype: the peak of a forward+backward of the plain model, its gradients dropped
  in the hook, minus its parameter bytes (activations, autograd's transients; 0 on the CPU).
  bytes/param = (peak - A) / numel.
- peak gradient memory in backward: max over the timeline of (sample - sample at the start of
  backward), also with the plain model's freed activations at that hook index added back; the
  larger, in largest buckets.
leanddp in-backward sharded (optimizer_in_backward with shard_optimizer_state) has the target
4 + 8/N bytes per parameter at world size N: 12 at this world size 1, where a rank's shard is the
whole bucket (`python -m leanddp.bench` measures it at several world sizes).
Writes memory_timeline.json and .png into --out; progress on stderr; a markdown table and one
VERDICT line per target last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time

import _common as c
import torch
import torch.distributed as dist

from leanddp import _memory, plan
from leanddp.bench._model import SIZES, loss_of

NAME = "memory_timeline"
log = functools.partial(c.log, NAME)  # a progress line on stderr
CONFIGS = [
    "torch DDP",
    "leanddp",
    "leanddp + optimizer_in_backward",
    "leanddp + offload_to_cpu",
    c.SHARDED,
    c.SHARDED_OFFLOAD,
]
IN_BACKWARD = CONFIGS[2:]
#: offload_to_cpu through one step of ACCUM micro-batches (the first dtype only), accumulating
#: on the host (its default: target, at most ACCUM_SLACK bytes per parameter over its step
#: without accumulation) and on the device (every bucket kept across the micro-batches)
ACCUM = 4
ACCUMULATED = ["leanddp + offload_to_cpu", c.DEVICE_ACCUMULATION]
ACCUM_SLACK = 0.5
#: fp32 AdamW, bytes per parameter: parameters + gradients + buckets + device optimizer state,
#: from the memory model (leanddp._memory: torch's DDP 20, leanddp 16, in-backward 12, offload
#: 4, sharded 4 + 8/N)
TORCH_DDP_TOLERANCE = 1.0
#: over the model's figure for the unsharded leanddp configurations (gradients that autograd
#: allocates after zero_grad(set_to_none=True), until their bucket is complete)
SLACK = 0.5
#: over the planner's device bytes (python -m leanddp.plan): the caching allocator rounds every
#: block up (512 B) and a few small tensors are outside the model
PLAN_SLACK = 0.01
#: buckets allowed on top of a target: launched, reducing or being stepped at once
BUCKETS_IN_FLIGHT = _memory.BUCKETS_IN_FLIGHT
#: peak gradient memory during backward with optimizer_in_backward, in largest buckets
MAX_GRAD_BUCKETS = 2.0


def max_bytes(name: str, world: int) -> float:
    """The fp32 target of configuration ``name`` in bytes per parameter, before the allowance
    for buckets in flight; ``world``: the world size the run had."""
    fixed = _memory.per_parameter(_memory.mode(name), 4, "adamw", world)[0]
    return fixed if name in (c.SHARDED, CONFIGS[0]) else fixed + SLACK


def accounted(name: str, ddp, opt, params: list[torch.Tensor]) -> int:
    """Bytes held by account (the CPU's sample): parameters, device optimizer state, buckets and
    gradients outside them. Offloaded optimizer state lives on the host and is not counted."""
    if ddp is None or name.startswith("torch"):
        grads = [p.grad for p in params if p.grad is not None]
        held = c.storages_bytes(params) + c.storages_bytes(grads)
        return held + (sum(c.torch_bucket_bytes(ddp)) + c.state_bytes(opt) if ddp else 0)
    s = ddp.memory_stats()
    state = c.state_bytes(opt) if opt is not None else 0
    if opt is None and "offload" not in name:
        state = s["optimizer_state_bytes"]
    return s["param_bytes"] + s["bucket_bytes"] + s["grad_bytes"] + state


def active_bytes(which: str) -> int:
    """The caching allocator's active bytes, ``current`` or ``peak``: allocated blocks plus freed
    blocks still awaiting the streams they were recorded on."""
    return int(torch.cuda.memory_stats()[f"active_bytes.all.{which}"])


class Meter:
    """Memory samples of one run: allocator bytes on a GPU, bytes held by account on the CPU."""

    def __init__(self, device: torch.device, account) -> None:
        self.cuda, self.account, self.high = device.type == "cuda", account, 0

    def sample(self) -> int:
        """Bytes now (and the highest seen, for the CPU's peak)."""
        value = active_bytes("current") if self.cuda else self.account()
        self.high = max(self.high, value)
        return value

    def reset_peak(self) -> None:
        """Starts a measured step: the peak so far is forgotten."""
        c.sync(self.cuda)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.high = self.sample()

    def peak(self) -> int:
        """The most bytes allocated (GPU) or sampled (CPU) since reset_peak()."""
        c.sync(self.cuda)
        return active_bytes("peak") if self.cuda else max(self.high, self.sample())


def one_step(ddp, opt, tokens: torch.Tensor, meter: Meter, drop: bool = False, accum: int = 1):
    """Forward, backward (``accum`` times, all but the last under no_sync()), the optimizer step
    if any. Each parameter's hook drops its gradient (``drop``: the plain model) and samples
    ``meter``. Returns (sample at the first backward, timeline)."""
    timeline: list[int] = []

    def on_grad(p: torch.Tensor) -> None:
        if drop:
            p.grad = None
        timeline.append(meter.sample())

    params = [p for p in ddp.parameters() if p.requires_grad]
    handles = [p.register_post_accumulate_grad_hook(on_grad) for p in params]
    try:
        for i in range(accum):
            local = ddp.no_sync() if i < accum - 1 else contextlib.nullcontext()
            with local:
                loss = loss_of(ddp, tokens)
                if i == 0:
                    start = meter.sample()
                loss.backward()
            timeline.append(meter.sample())  # what the step holds at the end of a backward
        if opt is not None:
            opt.step()
            meter.sample()
            opt.zero_grad()
    finally:
        for h in handles:
            h.remove()
    return start, timeline


def measure(
    name: str | None, master, args, dtype: str, tokens, plain: dict | None, accum: int = 1
) -> dict:
    """Builds configuration ``name`` (None: the plain model) on a fresh copy; measures a step
    of ``accum`` micro-batches."""
    device = args.device
    c.free(device)
    base0 = active_bytes("current") if device.type == "cuda" else 0
    model = c.fresh_copy(master, device, c.DTYPES[dtype])
    params = [p for p in model.parameters() if p.requires_grad]
    ddp, opt = model, None
    if name is not None:
        ddp, opt = c.build(name, model, args, device)
    offload = name is not None and "offload" in name
    meter = Meter(
        device, lambda: accounted(name or "plain", None if name is None else ddp, opt, params)
    )
    for _ in range(args.warmup):
        one_step(ddp, opt, tokens, meter, drop=name is None, accum=accum)
    if offload:
        ddp.synchronize()
    meter.reset_peak()
    start, timeline = one_step(ddp, opt, tokens, meter, drop=name is None, accum=accum)
    if offload:
        ddp.synchronize()  # the host step's copies back belong to this step
    numel, param_bytes = sum(p.numel() for p in params), c.storages_bytes(params)
    out = {"config": name or "plain model", "dtype": dtype, "numel": numel, "accum": accum}
    out["world_size"] = dist.get_world_size()
    out.update(param_bytes=param_bytes, peak_bytes=meter.peak() - base0, start_bytes=start - base0)
    out["timeline"] = [s - base0 for s in timeline]
    if name is None:
        out["activation_bytes"] = out["peak_bytes"] - param_bytes
        return out
    if name.startswith("torch"):
        buckets = c.torch_bucket_bytes(ddp)
    else:
        buckets, s = list(ddp.reducer.bucket_bytes()), ddp.memory_stats()
        out.update({k: s[k] for k in ("peak_bucket_bytes", "max_buckets_in_flight")})
    largest = out["largest_bucket_bytes"] = max(buckets)
    out["num_buckets"] = len(buckets)
    out["bytes_per_param"] = (out["peak_bytes"] - plain["activation_bytes"]) / numel
    # what `python -m leanddp.plan` says this configuration holds on the device (an upper bound:
    # the step window's buckets in flight and one bucket of gradients outside them)
    mode = _memory.mode(name)
    shape = plan.shape_of(
        model, bucket_cap_mb=args.bucket_cap_mb, first_layout=mode.keeps_first_layout
    )
    out["planned_bytes"] = _memory.estimate(
        mode,
        shape,
        world_size=out["world_size"],
        accumulation=accum,
    ).device
    out["allowance_per_param"] = BUCKETS_IN_FLIGHT * largest / numel
    raw = [s - out["start_bytes"] for s in out["timeline"]]
    released = [b - plain["start_bytes"] for b in plain["timeline"]]
    fixed = raw  # corrected for the activations freed so far, when the hooks line up
    if len(raw) == len(released):
        fixed = [r - d for r, d in zip(raw, released, strict=True)]
    out["peak_grad_buckets_raw"] = max(raw) / largest
    out["peak_grad_buckets"] = max(max(raw), max(fixed)) / largest
    return out


def verdicts(results: list[dict], smoke: bool) -> list[dict]:
    """fp32 bytes/param of every configuration; each dtype's in-backward peak of gradients."""
    out = []
    for r in results:
        name, dtype, bpp = r["config"], r["dtype"], r["bytes_per_param"]
        subject = f"{dtype} bytes/param {name} {bpp:.2f}"
        if dtype == "fp32" and name == "torch DDP":
            expected = max_bytes(name, 1)
            ok = abs(bpp - expected) <= TORCH_DDP_TOLERANCE
            target = f"target {expected:g} ± {TORCH_DDP_TOLERANCE:g}"
            out.append(c.verdict(subject, target, ok, smoke))
        elif dtype == "fp32":
            limit, allow = max_bytes(name, r.get("world_size", 1)), r["allowance_per_param"]
            target = f"target ≤ {limit:g}, + {allow:.2f} allowed for {BUCKETS_IN_FLIGHT} buckets"
            if name == c.SHARDED:
                target += f" (4 + 8/N, world size {r.get('world_size', 1)})"
            out.append(c.verdict(subject, target, bpp <= limit + allow, smoke))
        measured, planned = bpp * r["numel"], r["planned_bytes"]
        subject = f"{dtype} peak - A {name} {measured / 2**20:.1f} MiB"
        target = (
            f"≤ the planner's {planned / 2**20:.1f} MiB + {PLAN_SLACK:.0%} (allocator rounding)"
        )
        out.append(c.verdict(subject, target, measured <= planned * (1 + PLAN_SLACK), smoke))
        if name in IN_BACKWARD:
            g = r["peak_grad_buckets"]
            subject = f"{dtype} peak gradient memory in backward {name} {g:.2f} buckets"
            target = f"target ≤ {MAX_GRAD_BUCKETS:g}"
            out.append(c.verdict(subject, target, g <= MAX_GRAD_BUCKETS, smoke))
    return out


def accumulated_verdicts(results: list[dict], accumulated: list[dict], smoke: bool) -> list[dict]:
    """offload_to_cpu accumulating on the host: its step of ACCUM micro-batches holds at most
    ACCUM_SLACK bytes per parameter more than its step without accumulation."""
    out = []
    for r in accumulated:
        if r["config"] != ACCUMULATED[0]:
            continue
        one = next(o for o in results if (o["config"], o["dtype"]) == (r["config"], r["dtype"]))
        gap = r["bytes_per_param"] - one["bytes_per_param"]
        subject = (
            f"{r['dtype']} bytes/param {r['config']} accumulation {r['accum']} "
            f"{r['bytes_per_param']:.2f} vs {one['bytes_per_param']:.2f} without ({gap:+.2f})"
        )
        out.append(c.verdict(subject, f"target ≤ +{ACCUM_SLACK:g}", gap <= ACCUM_SLACK, smoke))
    return out


def markdown(report: dict) -> str:
    """The table of every (dtype, configuration)."""
    unit = "GPU: the allocator's active bytes" if not report["smoke"] else "CPU: bytes by account"
    lines = [
        f"{report['numel'] / 1e6:.2f}M parameters, {report['args']['model']}, batch "
        f"{report['args']['batch']} x seq {report['args']['seq']}, bucket_cap_mb="
        f"{report['args']['bucket_cap_mb']:g}; peaks from {unit}",
        "",
        "| dtype | configuration | peak (MiB) | baseline A (MiB) | peak - A (MiB) | planned (MiB) "
        "| bytes/param | allowance/param (2 buckets) | largest bucket (MiB) | peak_bucket_bytes "
        "(MiB) | max buckets in flight | peak gradients in backward (buckets) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    mib = 2.0**20
    for r in [*report["results"], *report.get("accumulated", [])]:
        a = report["baseline"][r["dtype"]]["activation_bytes"]
        pb = r.get("peak_bucket_bytes")
        name = r["config"] + (f", accumulation {r['accum']}" if r["accum"] > 1 else "")
        lines.append(
            f"| {r['dtype']} | {name} | {r['peak_bytes'] / mib:.1f} | {a / mib:.1f} "
            f"| {r['bytes_per_param'] * r['numel'] / mib:.1f} | {r['planned_bytes'] / mib:.1f} "
            f"| {r['bytes_per_param']:.2f} | {r['allowance_per_param']:.2f} "
            f"| {r['largest_bucket_bytes'] / mib:.1f} | {'—' if pb is None else f'{pb / mib:.1f}'} "
            f"| {r.get('max_buckets_in_flight', '—')} | {r['peak_grad_buckets']:.2f} |"
        )
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    """One panel per dtype, one line per configuration (and the plain model, dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(report["baseline"])
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 4.8), squeeze=False)
    scale, unit = (2.0**20, "MiB held by account") if report["smoke"] else (2.0**30, "GiB active")
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        for r in [
            report["baseline"][dtype],
            *(r for r in report["results"] if r["dtype"] == dtype),
        ]:
            style = dict(linestyle="--", color="0.5") if r["config"] == "plain model" else {}
            ax.plot([s / scale for s in r["timeline"]], label=r["config"], **style)
        ax.set_title(f"{dtype} parameters")
        ax.set_xlabel("post-accumulate-grad hook, in firing order (last: end of backward)")
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    fig.suptitle(f"memory during one backward — {report['numel'] / 1e6:.1f}M parameters, AdamW")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked: a usage error exits with code 2 before any work."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    c.common_arguments(p)
    p.add_argument("--dtypes", help="comma-separated: fp32, bf16 (default; fp32 with --smoke)")
    p.add_argument("--model", choices=list(SIZES), help="default: gpt2 (tiny with --smoke)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, help="default: 128 (64 with --smoke)")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    args.device = c.finish_arguments(p, args)
    default = "fp32" if args.smoke else "fp32,bf16"  # bf16 is slow on CPUs without AMX
    args.dtypes = c.parse_list(p, args.dtypes or default, "--dtypes", list(c.DTYPES))
    args.model = args.model or ("tiny" if args.smoke else "gpt2")
    if args.seq is None:
        args.seq = 64 if args.smoke else 128
    if not 1 <= args.seq <= SIZES[args.model].seq:
        p.error(f"--seq must be in 1..{SIZES[args.model].seq} for --model {args.model}")
    if args.batch < 1 or args.warmup < 1:
        p.error("--batch and --warmup must be at least 1")
    return args


def main(argv: list[str]) -> int:
    """Runs the benchmark; writes its JSON (and chart) into --out, prints its table."""
    args = parse(argv)
    began = time.perf_counter()
    size, master, gen = c.start(args)  # every configuration starts from master's weights
    tokens = torch.randint(0, size.vocab, (args.batch, args.seq + 1), generator=gen)
    tokens = tokens.to(args.device)
    log(
        f"{args.model} on {args.device}, dtypes {','.join(args.dtypes)}, batch {args.batch} x "
        f"seq {args.seq}{' (smoke)' if args.smoke else ''}"
    )
    if args.device.type == "cuda":  # lazy workspaces (cuBLAS, per thread) before any measure
        measure(None, master, args, args.dtypes[0], tokens, None)
    baseline, results = {}, []
    for dtype in args.dtypes:
        baseline[dtype] = measure(None, master, args, dtype, tokens, None)
        log(
            f"{dtype} plain model: activations and transients A = "
            f"{baseline[dtype]['activation_bytes'] / 2**20:.1f} MiB"
        )
        for name in CONFIGS:
            t = time.perf_counter()
            r = measure(name, master, args, dtype, tokens, baseline[dtype])
            results.append(r)
            log(
                f"{dtype} {name}: peak {r['peak_bytes'] / 2**20:.1f} MiB, "
                f"{r['bytes_per_param']:.2f} B/param, gradients in backward "
                f"{r['peak_grad_buckets']:.2f} buckets ({time.perf_counter() - t:.1f} s)"
            )
    accumulated = []
    for name in ACCUMULATED:
        dtype = args.dtypes[0]
        t = time.perf_counter()
        r = measure(name, master, args, dtype, tokens, baseline[dtype], accum=ACCUM)
        accumulated.append(r)
        log(
            f"{dtype} {name}, accumulation {ACCUM}: peak {r['peak_bytes'] / 2**20:.1f} MiB, "
            f"{r['bytes_per_param']:.2f} B/param ({time.perf_counter() - t:.1f} s)"
        )
    c.free(args.device)
    dist.destroy_process_group()
    report = c.report(
        argv,
        args,
        began,
        numel=results[0]["numel"],
        baseline=baseline,
        results=results,
        accumulated=accumulated,
        verdicts=verdicts(results, args.smoke)
        + accumulated_verdicts(results, accumulated, args.smoke),
    )
    path = c.write_json(args.out, NAME, report)
    plot(report, args.out / f"{NAME}.png")
    log(f"wrote {path} and {NAME}.png in {report['seconds']:.1f} s")
    print(markdown(report), "", *(v["line"] for v in report["verdicts"]), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
