"""The table and the chart of ``python -m leanddp.bench``."""

from __future__ import annotations

import sys
from pathlib import Path

#: The torch configuration shares torch's AdamW; leanddp's fused AdamW rounds differently (a few
#: ulp per step) and accumulation sums micro-batch gradients in another order. AdamW turns
#: noise-level gradients (attention key biases, whose exact gradient is zero) into full-size
#: steps, so losses drift apart by up to ~1e-3 relative over tens of steps. The parity tests hold
#: the strict bound (1e-5, several steps).
LOSS_TOLERANCE = 1e-2
ANCHOR = "torch DDP"
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


def device_bytes_per_param(run: dict, params: int) -> float:
    """Bytes per parameter on the device: parameters + gradients + buckets + optimizer state."""
    return sum(run["memory"][c] for c in DEVICE_CATEGORIES) / params


def step_ms(run: dict) -> tuple[float, float, float]:
    """Median, fastest and slowest step in ms (one sample when no per-step times were kept)."""
    times = run.get("step_times") or [run["step_seconds"]]
    return run["step_seconds"] * 1e3, min(times) * 1e3, max(times) * 1e3


def table(report: dict) -> tuple[str, bool]:
    """Markdown for the runs in ``report``, and whether the final losses agree."""
    env, runs, args = report["env"], report["runs"], report["args"]
    on_gpu = args["device"] == "cuda"
    anchor = {r["accum"]: r["step_seconds"] for r in runs if r["config"] == ANCHOR}
    where = f"{env.get('gpu', '')} CUDA {env['cuda']}" if on_gpu else env["cpu"]
    first = runs[0]
    peak_name = "peak allocated (MiB)" if on_gpu else "peak RSS growth (MiB)"
    lines = [
        f"`{env['command']}` — leanddp {env['leanddp']}, torch {env['torch']}, Python "
        f"{env['python']}, {where}, {env['cpus']} CPUs",
        "",
        f"{report['params'] / 1e6:.2f}M parameters, {args['dtype']}, {first['backend']}, "
        f"world size {first['world_size']}, bucket_cap_mb={args['bucket_cap_mb']}, "
        f"{args['steps']} timed steps after {args['warmup']} (step time: median, and the "
        "fastest–slowest step); memory of rank 0, in MiB; bytes per parameter on the device = "
        "(parameters + gradients + buckets + optimizer state) / parameter count",
        "",
        "| configuration | accum | step (ms) | fastest–slowest (ms) | vs torch DDP | parameters "
        "| gradients | buckets | optimizer state | bytes per parameter on the device "
        f"| on the host | {peak_name} | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        m = r["memory"]
        per_param = device_bytes_per_param(r, report["params"])
        base = anchor.get(r["accum"])
        ratio = f"{r['step_seconds'] / base:.3f}" if base else "—"
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
                f"- {r['config']}, accumulation {r['accum']}: the host worker was busy "
                f"{h['step_seconds']:.3f} s over {h['buckets']} bucket steps and the loop waited "
                f"{h['wait_seconds']:.3f} s: {hidden:.0%} of the host step hidden."
            )
    ref = next(r for r in runs if r["accum"] == runs[0]["accum"])
    final = ref["losses"][-1]
    spread = max(abs(r["losses"][-1] - final) for r in runs) / abs(final)
    agree = spread <= LOSS_TOLERANCE
    lines.append(
        f"- final losses {'agree' if agree else 'DIFFER'} across all {len(runs)} runs: the largest "
        f"difference from {ref['config']} (accumulation {ref['accum']}) is {spread:.1e} relative "
        f"(tolerance {LOSS_TOLERANCE:.0e}); every run takes the same global batch per step."
    )
    return "\n".join(lines), agree


def plot(report: dict, path: Path) -> bool:
    """The saving per configuration, the process's peak and step time, as a PNG.

    Three panels over the same runs: bytes per parameter on the device by category (the
    saving, with its percentage against torch's DDP), the process's peak memory (on CPU the
    "host" of offload_to_cpu is the same RAM, which the caption says), and step time as the
    median with every timed step shown. False without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[leanddp.bench] matplotlib is not installed: no PNG written", file=sys.stderr)
        return False
    runs, params = report["runs"], report["params"]
    gpu = report["args"]["device"] == "cuda"
    labels = [f"{r['config'].replace(' + ', chr(10) + '+ ')}\naccum {r['accum']}" for r in runs]
    xs = list(range(len(runs)))
    fig, (ax1, ax2, ax3) = plt.subplots(
        3, 1, sharex=True, figsize=(max(10, 1.55 * len(runs)), 10.5),
        gridspec_kw={"height_ratios": [2.4, 1, 1.2]},
    )  # fmt: skip
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
        ax3.text(x + 0.33, median, f"{median:.0f}", va="center", fontsize=8)
    steps = report["args"]["steps"]
    ax3.set_title(f"step time: median (green) and each of the {steps} timed steps", fontsize=10)
    ax3.set_ylabel("ms")
    ax3.set_ylim(0, 1.15 * max(max(r.get("step_times") or [r["step_seconds"]]) for r in runs) * 1e3)
    ax3.set_xticks(xs, labels, fontsize=8)
    first = runs[0]
    fig.suptitle(
        f"leanddp vs torch DDP — {params / 1e6:.1f}M parameters, {report['args']['dtype']}, "
        f"{first['backend']}, world size {first['world_size']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
