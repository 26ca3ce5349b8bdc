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


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


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
        f"{args['steps']} timed steps after {args['warmup']}; memory of rank 0, in MiB",
        "",
        "| configuration | accum | step (ms) | vs torch DDP | parameters | gradients "
        "| buckets | optimizer state | beside the model, × params | on the host "
        f"| {peak_name} | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        m = r["memory"]
        beside = (m["gradients"] + m["buckets"] + m["optimizer_device"]) / m["parameters"]
        base = anchor.get(r["accum"])
        ratio = f"{r['step_seconds'] / base:.3f}" if base else "—"
        lines.append(
            f"| {r['config']} | {r['accum']} | {r['step_seconds'] * 1e3:.1f} | {ratio} "
            f"| {mib(m['parameters'])} | {mib(m['gradients'])} | {mib(m['buckets'])} "
            f"| {mib(m['optimizer_device'])} | {beside:.2f} "
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
    """Memory by category and step time per run, as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[leanddp.bench] matplotlib is not installed: no PNG written", file=sys.stderr)
        return False
    runs = report["runs"]
    labels = [f"{r['config'].replace(' + ', chr(10) + '+ ')}\naccum {r['accum']}" for r in runs]
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(max(10, 2.2 * len(runs)), 5.5), gridspec_kw={"width_ratios": [3, 1.4]}
    )
    colors = {
        "parameters": "#bbb",
        "gradients": "#e9a",
        "buckets": "#2a7",
        "optimizer_device": "#79c",
        "host": "#fff",
    }
    bottom = [0.0] * len(runs)
    for cat in [*CATEGORIES, "host"]:
        vals = [r["memory"][cat] / 2**20 for r in runs]
        ax1.bar(
            labels,
            vals,
            bottom=bottom,
            color=colors[cat],
            edgecolor="#555" if cat == "host" else None,
            hatch="//" if cat == "host" else None,
            label=LABELS[cat],
        )
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    peak = [r["memory"]["peak_process"] / 2**20 for r in runs]
    gpu = report["args"]["device"] == "cuda"
    ax1.scatter(labels, peak, marker="_", s=900, c="k", zorder=3,
                label="peak allocated" if gpu else "peak RSS growth")  # fmt: skip
    ax1.set_ylabel("MiB (rank 0)")
    ax1.set_title("memory by category")
    ax1.set_ylim(0, 1.35 * max(max(bottom), max(peak)))
    ax1.legend(fontsize=8, loc="upper left", ncol=3)
    ax2.barh(labels, [r["step_seconds"] * 1e3 for r in runs], color="#2a7")
    ax2.invert_yaxis()
    ax2.set_xlabel("step time (ms)")
    ax2.tick_params(axis="y", labelsize=7)
    ax1.tick_params(axis="x", labelsize=7)
    first = runs[0]
    fig.suptitle(
        f"leanddp vs torch DDP — {report['params'] / 1e6:.1f}M parameters, {first['backend']}, "
        f"world size {first['world_size']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
