"""benchmarks/long_run.py's verdict on a configuration's run and its markdown report."""

from __future__ import annotations

import argparse

MIB = 1024 * 1024
#: What must stay flat after warm-up (each checkpoint holds, per rank, the largest value since
#: the previous one): memory_stats()'s counts, host bytes, events created, threads.
FLAT_KEYS = ("bucket_bytes", "peak_bucket_bytes", "max_buckets_in_flight",
             "recycled_bucket_bytes", "grad_bytes", "host_bytes", "events_created",
             "py_threads", "os_threads")  # fmt: skip
#: FLAT_KEYS' column headings in the report.
FLAT_HEADINGS = ("bucket B", "peak bucket B", "in flight", "recycled B", "grad B", "host B",
                 "events", "py threads", "OS threads")  # fmt: skip


def mib(x: float) -> str:
    """Bytes as MiB with one decimal."""
    return f"{x / MIB:.1f}"


def baseline(r: dict, args: argparse.Namespace) -> dict:
    """The first checkpoint whose window (the steps after the previous checkpoint) lies after
    ``--warmup-steps`` (else the last): the first step's bucket rebuild, and with a static graph
    its first iteration, hold more buckets at once than any later step."""
    previous = 0
    for c in r["checkpoints"]:
        if previous >= args.warmup_steps:
            return c
        previous = c["step"]
    return r["checkpoints"][-1]


def verdict(r: dict, args: argparse.Namespace) -> list[str]:
    """Why this configuration failed (empty: it passed). Also sets ``r["rss_growth"]``,
    ``r["baseline_step"]`` and ``r["flat_changed"]`` (what changed after warm-up)."""
    fails, last = [], r["checkpoints"][-1]
    first = baseline(r, args)
    tol = r["tolerance"]
    for c in r["checkpoints"]:
        if (not c["bitwise"]) if tol == 0.0 else not c["max_rel"] <= tol:  # NaN fails too
            want = "bitwise equality" if tol == 0.0 else f"tolerance {tol:.0e}"
            fails.append(f"step {c['step']}: max rel diff {c['max_rel']:.3e} ({c['worst']}) "
                         f"breaks {want}")  # fmt: skip
            break
    for c in r["checkpoints"]:
        if c["ranks_differ_ours"] > 0:
            fails.append(f"step {c['step']}: leanddp's ranks hold different parameters "
                         f"(max diff {c['ranks_differ_ours']:.3e})")  # fmt: skip
            break
    r["baseline_step"] = first["step"]
    r["rss_growth"] = [b - a for a, b in zip(first["rss"], last["rss"], strict=True)]
    for rank, g in enumerate(r["rss_growth"]):
        if not g <= args.max_rss_growth_mb * MIB:
            fails.append(f"rank {rank}: RSS grew {g / MIB:.1f} MiB from step {first['step']} to "
                         f"{last['step']} (limit {args.max_rss_growth_mb} MiB)")  # fmt: skip
    r["flat_changed"] = []
    for rank, (a, b) in enumerate(zip(first["flat"], last["flat"], strict=True)):
        for key in FLAT_KEYS:
            if a[key] != b[key]:
                r["flat_changed"].append(key)
                fails.append(f"rank {rank}: {key} went from {a[key]} (step {first['step']}) to "
                             f"{b[key]} (step {last['step']})")  # fmt: skip
    return fails


def pair(values: list) -> str:
    """Both ranks' values as ``r0/r1``, or one value where they agree."""
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def summary(report: dict) -> list[str]:
    """The header and the table of every configuration."""
    env, args, lines = report["env"], report["args"], []
    lines += [
        f"`{env['command']}`",
        "",
        f"{env['cpu']} ({env['cpus']} CPUs), python {env['python']}, torch {env['torch']}, "
        f"leanddp {env['leanddp']}; 2 gloo ranks, 1 thread each; {report['params']} parameters, "
        f"bucket_cap_mb={args['bucket_cap_mb']}, 1-{args['max_accum']} micro-batches per step "
        f"(seed {args['seed']}), --unused-pattern {args['unused_pattern']}, host ordering "
        f"{'on' if args['host_ordering'] == 'True' else 'off'}",
        "",
        "| config | check_for_nan_in_grad | steps | max rel diff (end) | max rel diff (any "
        "checkpoint) | tolerance | RSS MiB @warm r0/r1 | RSS MiB @end r0/r1 | growth MiB r0/r1 "
        "| flat after warm-up | time s | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        if "checkpoints" not in r:
            lines.append(f"| {r['config']} | | | | | | | | | | | FAILED: {r['error']} |")
            continue
        last = r["checkpoints"][-1]
        first = next(c for c in r["checkpoints"] if c["step"] == r["baseline_step"])
        worst = max(c["max_rel"] for c in r["checkpoints"])
        tol = "bitwise" if r["tolerance"] == 0.0 else f"{r['tolerance']:.0e}"
        end = "bitwise equal" if last["bitwise"] else f"{last['max_rel']:.2e}"
        flat = (
            "changed: " + ", ".join(sorted(set(r["flat_changed"]))) if r["flat_changed"] else "yes"
        )
        lines.append(
            f"| {r['config']} | {r['nan_check'].split(' (')[0]} | {last['step']} | {end} | "
            f"{worst:.2e} | {tol} | {'/'.join(map(mib, first['rss']))} (step {first['step']}) | "
            f"{'/'.join(map(mib, last['rss']))} | {'/'.join(map(mib, r['rss_growth']))} | "
            f"{flat} | {r['seconds']:.0f} | {'; '.join(r['failures']) or 'pass'} |"
        )
    lines += ["", f"Fails if RSS grows more than {args['max_rss_growth_mb']} MiB on a rank, or "
              f"any of {', '.join(FLAT_KEYS)} (each the largest since the previous checkpoint) "
              f"changes on a rank, from the first checkpoint whose window starts after "
              f"step {args['warmup_steps']} to the end; if leanddp's ranks hold different "
              f"parameters; or beyond the tolerance: {report['tolerance_note']}."]  # fmt: skip
    return lines


def render(report: dict) -> str:
    """The markdown report: the summary, then per configuration its parity and flatness."""
    lines = summary(report)
    for r in report["runs"]:
        if "checkpoints" not in r:
            continue
        drawn = ", ".join(f"{k}: {v}" for k, v in r["micro_batches"].items())
        lines += ["", f"### {r['config']}: {r['about']}", "",
                  f"check_for_nan_in_grad: {r['nan_check']}; steps by micro-batches: {drawn}",
                  ""]  # fmt: skip
        if r.get("grad_norm"):
            g = r["grad_norm"]
            lines += [f"max_grad_norm: {g['steps_clipped']} steps clipped; leanddp's grad_norm "
                      f"vs clip_grad_norm_: max rel diff {g['max_rel_diff']:.2e}", ""]  # fmt: skip
        lines += [
            "| step | max rel diff | max abs diff | worst tensor | ranks equal | RSS MiB r0/r1 | "
            + " | ".join(FLAT_HEADINGS)
            + " | loss torch/leanddp |",
            "|---|---|---|---|---|---|" + "---|" * len(FLAT_KEYS) + "---|",
        ]
        for c in r["checkpoints"]:
            flat = " | ".join(pair([f[k] for f in c["flat"]]) for k in FLAT_KEYS)
            lines.append(
                f"| {c['step']} | {c['max_rel']:.2e} | {c['max_abs']:.2e} | {c['worst'] or '-'} | "
                f"{'yes' if c['ranks_differ_ours'] == 0 else c['ranks_differ_ours']} | "
                f"{'/'.join(map(mib, c['rss']))} | {flat} | "
                f"{c['loss_ref']:.5f}/{c['loss_ours']:.5f} |"
            )
    return "\n".join(lines)
