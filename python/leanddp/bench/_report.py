"""The table and the chart of ``python -m leanddp.bench``."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from leanddp import _memory
from leanddp.bench import _accumulation

if TYPE_CHECKING:
    from matplotlib.axes import Axes

#: The torch configuration shares torch's AdamW; leanddp's fused AdamW rounds differently (a few
#: ulp per step) and accumulation sums micro-batch gradients in another order. AdamW turns
#: noise-level gradients (attention key biases, whose exact gradient is zero) into full-size
#: steps, so losses drift apart by up to ~1e-3 relative over tens of steps. The parity tests hold
#: the strict bound (1e-5, several steps).
LOSS_TOLERANCE = 1e-2
ANCHOR = "torch DDP"
#: the 8-bit configurations' anchor (torch's DDP + torchao's AdamW8bit)
LOWBIT_ANCHOR = next(iter(_memory.LOWBIT_CONFIGS))
#: shard_optimizer_state's configuration and the unsharded in-backward one it is compared with
#: (names of _worker.CONFIGS, repeated here so that the report needs no torch)
SHARDED = "leanddp in-backward sharded"
UNSHARDED = "leanddp + optimizer_in_backward"
#: the buckets in flight allowed on top of the sharded run's target (fp32 AdamW at world size
#: N: a 4-byte parameter and 8/N bytes of state, from the memory model, leanddp._memory):
#: launched, reducing or being stepped at once (the in-backward step window), counted as this
#: many of the largest bucket
BUCKETS_IN_FLIGHT = _memory.BUCKETS_IN_FLIGHT
#: the sharded step against the unsharded in-backward one: at most this ratio on the CPU (gloo)
#: at world size 2, and at most STEP_TARGET_NCCL against torch's DDP on NCCL
STEP_TARGET_GLOO = 1.05
STEP_TARGET_GLOO_WORLD = 2
STEP_TARGET_NCCL = 1.00
DPI = 110  # the PNG's resolution
CATEGORIES = ["parameters", "gradients", "buckets", "optimizer_device"]
LABELS = {
    "parameters": "parameters",
    "gradients": "gradients outside buckets",
    "buckets": "buckets",
    "optimizer_device": "optimizer state",
    "host": "on the host (state, masters, staging)",
}


#: The memory column of the table and the chart's main panel: bytes per parameter that a rank
#: holds on the training device for the parameters, their gradients outside the buckets, the
#: buckets and the optimizer state (activations aside). The README's and docs/memory.md's
#: "bytes per parameter on the device" is the same sum; what offload_to_cpu keeps on the host is
#: reported separately.
DEVICE_CATEGORIES = CATEGORIES


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def device_bytes_per_param(run: dict[str, Any], params: int) -> float:
    """Bytes per parameter on the device: parameters + gradients + buckets + optimizer state."""
    held: float = sum(run["memory"][c] for c in DEVICE_CATEGORIES)
    return held / params


def versus_torch(run: dict[str, Any]) -> str:
    """The run's step time against torch's DDP measured interleaved in its processes (the
    anchor itself: 1), as a table cell."""
    if run["config"] in (ANCHOR, LOWBIT_ANCHOR):
        return "1.000"
    versus = run.get("interleaved")
    return f"{versus['ratio']:.3f}" if versus else "—"


def step_ms(run: dict[str, Any]) -> tuple[float, float, float]:
    """Median, fastest and slowest step in ms (one sample when no per-step times were kept)."""
    times = run.get("step_times") or [run["step_seconds"]]
    return run["step_seconds"] * 1e3, min(times) * 1e3, max(times) * 1e3


def main_world(runs: list[dict[str, Any]]) -> int:
    """The world size of the main runs: the first run's (the launcher runs them first)."""
    world: int = runs[0]["world_size"]
    return world


def series_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The world-size series: the in-backward runs, unsharded and sharded, at the accumulation
    the series ran at (the first run's), by configuration, then world size."""
    accum = runs[0]["accum"]
    rows = [r for r in runs if r["config"] in (UNSHARDED, SHARDED) and r["accum"] == accum]
    return sorted(rows, key=lambda r: (r["config"] == SHARDED, r["world_size"]))


def shard_target(run: dict[str, Any], params: int, dtype: str) -> tuple[float, float] | None:
    """The sharded run's target in bytes per parameter on the device, as (4 + 8/N, allowance
    for the buckets in flight: BUCKETS_IN_FLIGHT times its largest bucket); None where the
    target does not apply: another configuration, another dtype than fp32 (AdamW's state is
    then not 8 bytes per parameter), or with accumulation (every bucket must then live across
    the micro-batches), or a run that did not record its largest bucket."""
    largest = run["memory"].get("largest_bucket")
    if run["config"] != SHARDED or dtype != "fp32" or run["accum"] != 1 or largest is None:
        return None
    return shard_fixed(run["world_size"]), BUCKETS_IN_FLIGHT * largest / params


def shard_fixed(world: float) -> float:
    """The sharded run's target before the buckets in flight, fp32 AdamW at ``world`` ranks:
    4 + 8/N bytes per parameter (the memory model's, leanddp._memory)."""
    # (typed int there: a fractional ``world`` evaluates the formula between the runs' sizes,
    # which holds for per_parameter's model without buckets)
    return _memory.per_parameter(_memory.mode(SHARDED), 4, "adamw", cast(int, world))[0]


def counterpart(
    run: dict[str, Any], runs: list[dict[str, Any]], name: str
) -> dict[str, Any] | None:
    """The run of configuration ``name`` at ``run``'s world size and accumulation, if any."""
    for r in runs:
        if (r["config"], r["world_size"], r["accum"]) == (name, run["world_size"], run["accum"]):
            return r
    return None


def lowbit(run: dict[str, Any]) -> bool:
    """Whether the run trains with torchao's AdamW8bit (8-bit state)."""
    return run["config"] in _memory.LOWBIT_CONFIGS


def losses_agree(runs: list[dict[str, Any]]) -> tuple[list[str], bool]:
    """One line per world size on whether the final losses agree (runs at different world
    sizes train on different global batches: they are compared within a world size)."""
    groups: dict[tuple[int, bool], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["world_size"], lowbit(r)), []).append(r)
    worlds = {world for world, _ in groups}
    lines, agree = [], True
    for (world, low), group in groups.items():
        ref = group[0]
        final = ref["losses"][-1]
        spread = max(abs(r["losses"][-1] - final) for r in group) / abs(final)
        ok = spread <= LOSS_TOLERANCE
        agree = agree and ok
        where = f" at world size {world}" if len(worlds) > 1 else ""
        which = " 8-bit (AdamW8bit)" if low else (" AdamW" if len(groups) > len(worlds) else "")
        lines.append(
            f"- final losses {'agree' if ok else 'DIFFER'} across all {len(group)}{which} runs"
            f"{where}: "
            f"the largest difference from {ref['config']} (accumulation {ref['accum']}) is "
            f"{spread:.1e} relative (tolerance {LOSS_TOLERANCE:.0e}); every run"
            f"{where and ' there'} takes the same global batch per step."
        )
    return lines, agree


def main_table(report: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """The table of every configuration at the main world size, and the offload lines."""
    env, args = report["env"], report["args"]
    on_gpu = args["device"] == "cuda"
    where = f"{env.get('gpu', '')} CUDA {env['cuda']}" if on_gpu else env["cpu"]
    first = runs[0]
    peak_name = "peak allocated (MiB)" if on_gpu else "peak RSS growth (MiB)"
    lines = [
        f"`{env['command']}` — leanddp {env['leanddp']}, torch {env['torch']}, Python "
        f"{env['python']}, {where}, {env['cpus']} CPUs",
        "",
        f"{report['params'] / 1e6:.2f}M parameters, {args['dtype']}, {first['backend']}, "
        f"world size {first['world_size']}, bucket_cap_mb={args['bucket_cap_mb']}, "
        f"{args['steps']} timed steps after {args['warmup']}"
        + (", a new batch each step from a Markov chain" if args.get("data") == "markov" else "")
        + " (step time: median, and the "
        "fastest–slowest step); vs torch DDP: the median step against torch's DDP + "
        "AdamW(fused=True) on the same model and data (8-bit rows: + torchao's AdamW8bit), "
        "alternating step by step in the same processes (host steps and device work included "
        "in both); memory of rank 0, in MiB; "
        "bytes per parameter on the device = (parameters + gradients + buckets + optimizer "
        "state) / parameter count",
        "",
        "| configuration | accum | step (ms) | fastest–slowest (ms) | vs torch DDP | parameters "
        "| gradients | buckets | optimizer state | bytes per parameter on the device "
        f"| on the host | {peak_name} | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        m = r["memory"]
        per_param = device_bytes_per_param(r, report["params"])
        ratio = versus_torch(r)
        median, fastest, slowest = step_ms(r)
        lines.append(
            f"| {r['config']} | {r['accum']} | {median:.1f} | {fastest:.1f}–{slowest:.1f} "
            f"| {ratio} | {mib(m['parameters'])} | {mib(m['gradients'])} | {mib(m['buckets'])} "
            f"| {mib(m['optimizer_device'])} | {per_param:.1f} "
            f"| {mib(m['host']) if m['host'] else '—'} | {mib(m['peak_process'])} "
            f"| {r['losses'][-1]:.5f} |"
        )
    lines.append("")
    for r in runs:
        h = r.get("host_step")
        if h and h["step_seconds"] > 0:
            hidden = 1 - h["wait_seconds"] / h["step_seconds"]
            lines.append(
                f"- {r['config']}, accumulation {r['accum']}: over {h['steps']} steps after the "
                f"timed ones the host worker was busy {h['step_seconds']:.3f} s "
                f"({h['buckets']} bucket steps) and the loop waited {h['wait_seconds']:.3f} s: "
                f"{hidden:.0%} of the host step hidden."
            )
    return lines


def world_table(report: dict[str, Any], series: list[dict[str, Any]]) -> list[str]:
    """Bytes per parameter on the device by category against world size, with the target."""
    params, dtype = report["params"], report["args"]["dtype"]
    cpus = report["env"].get("cpus") if report["args"]["device"] == "cpu" else None
    lines = [
        f"Bytes per parameter on the device against world size, accumulation "
        f"{series[0]['accum']}: {UNSHARDED} and {SHARDED} (shard_optimizer_state); every "
        "column but the step time and the loss in bytes per parameter (rank 0); target, for "
        f"fp32 AdamW without accumulation: 4 + 8/N, plus {BUCKETS_IN_FLIGHT} of the largest "
        "bucket in flight; optimizer state as a share of the unsharded run's at the same world "
        "size (1/N is the aim)"
        + (f"; with more ranks than the {cpus} CPUs, ranks share cores" if cpus else ""),
        "",
        "| configuration | world size | step (ms) | step vs unsharded | parameters | gradients "
        "| buckets | optimizer state | optimizer state vs unsharded | bytes per parameter on the "
        "device | target: 4 + 8/N + buckets in flight | met | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in series:
        m = r["memory"]
        per = {c: m[c] / params for c in DEVICE_CATEGORIES}
        total = device_bytes_per_param(r, params)
        other = counterpart(r, series, UNSHARDED) if r["config"] == SHARDED else None
        step = state = target = met = "—"
        if other is not None:
            step = f"{r['step_seconds'] / other['step_seconds']:.3f}"
            unsharded_state = other["memory"]["optimizer_device"]
            if unsharded_state:
                state = f"{m['optimizer_device'] / unsharded_state:.3f} (1/N = "
                state += f"{1 / r['world_size']:.3f})"
        bound = shard_target(r, params, dtype)
        if bound is not None:
            fixed, allowance = bound
            target = f"{fixed:.2f} + {allowance:.2f} = {fixed + allowance:.2f}"
            met = "yes" if total <= fixed + allowance else "**no**"
        lines.append(
            f"| {r['config']} | {r['world_size']} | {r['step_seconds'] * 1e3:.1f} | {step} "
            f"| {per['parameters']:.2f} | {per['gradients']:.2f} | {per['buckets']:.2f} "
            f"| {per['optimizer_device']:.2f} | {state} | {total:.2f} | {target} | {met} "
            f"| {r['losses'][-1]:.5f} |"
        )
    return lines


def target_lines(report: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """shard_optimizer_state's targets, met or not, in words: bytes per parameter at each world
    size, and the sharded step time against its anchor (the unsharded in-backward run on gloo,
    torch's DDP on NCCL) at the same world size and accumulation."""
    params, dtype = report["params"], report["args"]["dtype"]
    lines = []
    for r in runs:
        bound = shard_target(r, params, dtype)
        if bound is None:
            continue
        fixed, allowance = bound
        total = device_bytes_per_param(r, params)
        m = r["memory"]
        kept = (m["parameters"] + m["optimizer_device"]) / params
        lines.append(
            f"- target, {SHARDED}, world size {r['world_size']}: {total:.2f} bytes per parameter "
            f"on the device against 4 + 8/{r['world_size']} = {fixed:.2f}, + {allowance:.2f} for "
            f"{BUCKETS_IN_FLIGHT} buckets in flight (largest bucket "
            f"{mib(m['largest_bucket'])} MiB) = {fixed + allowance:.2f}: "
            + ("met" if total <= fixed + allowance else "MISSED")
            + f" (parameters + optimizer state {kept:.2f}, buckets "
            f"{m['buckets'] / params:.2f}, gradients outside the buckets "
            f"{m['gradients'] / params:.2f})."
        )
    for r in runs:
        if r["config"] != SHARDED:
            continue
        nccl = r["backend"] == "nccl"
        other = counterpart(r, runs, ANCHOR if nccl else UNSHARDED)
        if other is None:
            continue
        ratio = r["step_seconds"] / other["step_seconds"]
        line = (
            f"- step time, {SHARDED} against {other['config']}, world size {r['world_size']}, "
            f"accumulation {r['accum']}: {ratio:.3f} (medians {r['step_seconds'] * 1e3:.1f} and "
            f"{other['step_seconds'] * 1e3:.1f} ms, separate launches)"
        )
        if nccl:
            met = ratio <= STEP_TARGET_NCCL
            line += f"; target ≤ {STEP_TARGET_NCCL:.2f} on NCCL: {'met' if met else 'MISSED'}."
        elif r["world_size"] == STEP_TARGET_GLOO_WORLD:
            met = ratio <= STEP_TARGET_GLOO
            line += (
                f"; target ≤ {STEP_TARGET_GLOO:.2f} on gloo at world size "
                f"{STEP_TARGET_GLOO_WORLD}: {'met' if met else 'MISSED'}."
            )
        else:
            line += f"; no target at world size {r['world_size']}."
        lines.append(line)
    return lines


def table(report: dict[str, Any]) -> tuple[str, bool]:
    """Markdown for the runs in ``report``, and whether the final losses agree.

    The main table holds the runs at the main world size; the runs of the world-size series,
    when there are any, get a table of their own with shard_optimizer_state's targets."""
    runs = report["runs"]
    world = main_world(runs)
    main = [r for r in runs if r["world_size"] == world]
    lines = main_table(report, main)
    accumulation = _accumulation.lines(report, main, device_bytes_per_param)
    if accumulation:
        lines += ["", *accumulation]
    agreement, agree = losses_agree(runs)
    lines += agreement
    series = series_runs(runs)
    if series and (
        any(r["config"] == SHARDED for r in series) or len({r["world_size"] for r in runs}) > 1
    ):
        lines += ["", *world_table(report, series), "", *target_lines(report, runs)]
    return "\n".join(lines).rstrip(), agree


def label(run: dict[str, Any]) -> str:
    """A run's name on the chart's x axis, wrapped to fit under its bar: each added mode on a
    line of its own ("+ offload_to_cpu"), every line at most 16 characters where words allow."""
    head, *added = run["config"].split(" + ")
    parts = [head] + [f"+\u00a0{mode}" for mode in added]  # (no break after the "+")
    lines = [textwrap.fill(p, 16, break_on_hyphens=False, break_long_words=False) for p in parts]
    return "\n".join(lines + [f"accum {run['accum']}"])


def plot(report: dict[str, Any], path: Path) -> bool:
    """The saving per configuration, the process's peak and step time, as a PNG.

    Three panels over the runs at the main world size: bytes per parameter on the device by
    category (the saving, with its percentage against torch's DDP), the process's peak memory
    (on CPU the "host" of offload_to_cpu is the same RAM, which the caption says), and step
    time as the median with every timed step shown. With a world-size series, a fourth panel:
    bytes per parameter on the device against world size (:func:`world_panel`). False without
    matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[leanddp.bench] matplotlib is not installed: no PNG written", file=sys.stderr)
        return False
    fig = figure(report)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def figure(report: dict[str, Any]) -> Any:
    """:func:`plot`'s matplotlib figure (laid out, not saved; the caller closes it)."""
    import matplotlib.pyplot as plt

    params = report["params"]
    runs = [r for r in report["runs"] if r["world_size"] == main_world(report["runs"])]
    series = series_runs(report["runs"])
    with_world = len({r["world_size"] for r in series}) > 1
    gpu = report["args"]["device"] == "cuda"
    labels = [label(r) for r in runs]
    xs = list(range(len(runs)))
    ratios = [2.4, 1, 1.2] + ([2.2] if with_world else [])
    fig = plt.figure(figsize=(max(10, 1.55 * len(runs)), 10.5 + (5 if with_world else 0)))
    grid = fig.add_gridspec(len(ratios), 1, height_ratios=ratios)
    ax1 = fig.add_subplot(grid[0])
    ax2 = fig.add_subplot(grid[1], sharex=ax1)
    ax3 = fig.add_subplot(grid[2], sharex=ax1)
    for ax in (ax1, ax2):
        ax.tick_params(labelbottom=False)
    colors = {
        "parameters": "#bbb",
        "gradients": "#e9a",
        "buckets": "#2a7",
        "optimizer_device": "#79c",
    }
    bottom = [0.0] * len(runs)
    for cat in DEVICE_CATEGORIES:
        vals = [r["memory"][cat] / params for r in runs]
        ax1.bar(xs, vals, bottom=bottom, color=colors[cat], label=LABELS[cat], width=0.7)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    anchor = {r["accum"]: t for r, t in zip(runs, bottom, strict=True) if r["config"] == ANCHOR}
    for x, r, total in zip(xs, runs, bottom, strict=True):
        base = anchor.get(r["accum"])
        text = f"{total:.1f} B"
        if base and r["config"] != ANCHOR:
            text += f"\n{(total - base) / base:+.0%}"
        if r["memory"]["host"]:
            text += f"\n(+{r['memory']['host'] / params:.0f} B on the host)"
        ax1.text(x, total, text, ha="center", va="bottom", fontsize=9, fontweight="bold")
    ax1.set_ylim(0, 1.45 * max(bottom))
    ax1.set_ylabel("bytes per parameter")
    ax1.set_title(
        "memory on the device per parameter: parameters + gradients + buckets + optimizer "
        "state (lower is better)",
        fontsize=10,
    )
    ax1.legend(fontsize=8, loc="upper right", ncol=2)

    peak = [r["memory"]["peak_process"] / 2**20 for r in runs]
    offload = [bool(r["memory"]["host"]) for r in runs]
    ax2.bar(xs, peak, width=0.7, color=["#d95" if o else "#999" for o in offload])
    for x, v in zip(xs, peak, strict=True):
        ax2.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax2.set_ylim(0, 1.3 * max(peak))
    ax2.set_ylabel("MiB (rank 0)")
    if gpu:
        ax2.set_title("peak allocated on the GPU (torch.cuda.max_memory_allocated)", fontsize=10)
    else:
        ax2.set_title(
            "peak RSS growth of the process; on CPU the host is the same RAM, so offload_to_cpu's "
            "host state (orange) counts here too",
            fontsize=10,
        )

    for x, r in zip(xs, runs, strict=True):
        times = [t * 1e3 for t in r.get("step_times") or [r["step_seconds"]]]
        ax3.scatter([x] * len(times), times, s=12, color="#555", alpha=0.5, zorder=3)
        median = r["step_seconds"] * 1e3
        ax3.hlines(median, x - 0.3, x + 0.3, color="#2a7", linewidth=3, zorder=4)
        ratio = versus_torch(r)
        note = f"{median:.0f}" + ("" if ratio in ("1.000", "—") else f"\n{ratio}×")
        ax3.text(x + 0.33, median, note, va="center", fontsize=8)
    steps = report["args"]["steps"]
    ax3.set_title(
        f"step time: median (green) and each of the {steps} timed steps; × torch DDP's, "
        "interleaved in the same processes",
        fontsize=10,
    )
    ax3.set_ylabel("ms")
    ax3.set_ylim(0, 1.15 * max(max(r.get("step_times") or [r["step_seconds"]]) for r in runs) * 1e3)
    ax3.set_xticks(xs, labels, fontsize=8)
    if with_world:
        world_panel(fig.add_subplot(grid[3]), report, series)
    first = runs[0]
    fig.suptitle(
        f"leanddp vs torch DDP — {params / 1e6:.1f}M parameters, {report['args']['dtype']}, "
        f"{first['backend']}, world size {first['world_size']}"
    )
    fig.tight_layout()
    return fig


def world_panel(ax: Axes, report: dict[str, Any], series: list[dict[str, Any]]) -> None:
    """Bytes per parameter on the device against world size: the series' configurations where
    they were measured (one marker per run), the other configurations at the main world size
    only, and, for fp32 without accumulation, the target 4 + 8/N (a formula, dashed) with the
    sharded runs' allowance for buckets in flight on top (dotted, at the measured sizes)."""
    params, dtype = report["params"], report["args"]["dtype"]
    accum = series[0]["accum"]
    worlds = sorted({r["world_size"] for r in series})
    style = {UNSHARDED: ("#79c", "s"), SHARDED: ("#2a7", "o")}
    for name, (color, marker) in style.items():
        points = [(r["world_size"], device_bytes_per_param(r, params)) for r in series]
        points = [p for p, r in zip(points, series, strict=True) if r["config"] == name]
        if not points:
            continue
        xs, ys = [x for x, _ in points], [y for _, y in points]
        ax.plot(xs, ys, color=color, marker=marker, linewidth=2, label=name)
        for x, y in points:
            ax.annotate(
                f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center",
                fontsize=8, color=color, fontweight="bold",
            )  # fmt: skip
    world = main_world(report["runs"])
    others = [
        r
        for r in report["runs"]
        if r["world_size"] == world and r["accum"] == accum and r["config"] not in style
    ]
    for r, marker in zip(others, "D^vP*X", strict=False):
        y = device_bytes_per_param(r, params)
        ax.scatter([world], [y], marker=marker, color="#555", zorder=3, label=r["config"])
        ax.annotate(f"{y:.1f}", (world, y), textcoords="offset points", xytext=(8, -3), fontsize=8)
    targets = [(r["world_size"], shard_target(r, params, dtype)) for r in series]
    bounds = [(n, b) for n, b in targets if b is not None]
    if bounds and dtype == "fp32" and accum == 1:
        lo, hi = worlds[0], worlds[-1]
        ns = [lo + (hi - lo) * k / 100 for k in range(101)]
        ax.plot(
            ns, [shard_fixed(n) for n in ns], "--", color="k",
            linewidth=1, label="target 4 + 8/N (fp32 AdamW)",
        )  # fmt: skip
        ax.plot(
            [n for n, _ in bounds], [sum(b) for _, b in bounds], ":", color="k", marker="_",
            markersize=12, linewidth=1,
            label=f"target + {BUCKETS_IN_FLIGHT} of the largest bucket in flight",
        )  # fmt: skip
    ax.set_xticks(worlds, [str(n) for n in worlds])
    ax.set_xlim(worlds[0] - 0.5, worlds[-1] + 0.5)
    ax.set_ylim(0, 1.15 * max(line.get_ydata().max() for line in ax.get_lines()))  # type: ignore[union-attr]  # matplotlib types it ArrayLike; plot() keeps an ndarray
    if others:  # the other configurations are single markers (collections), not lines
        top = max(device_bytes_per_param(r, params) for r in others)
        ax.set_ylim(0, max(ax.get_ylim()[1], 1.15 * top))
    ax.set_xlabel("world size N (ranks)")
    ax.set_ylabel("bytes per parameter")
    ax.set_title(
        f"bytes per parameter on the device against world size, accumulation {accum}: "
        f"measured at each marker (others at world size {world} only)",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper right", ncol=2)
