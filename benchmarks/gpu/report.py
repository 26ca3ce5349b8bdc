"""The GPU suite's report: ``report.md`` from the JSON files the suite wrote into a directory.

    python benchmarks/gpu/report.py [DIR]   # default: $OUT, else benchmarks/out/gpu

Reads memory_timeline.json, step_time.json and bench_ops.json (``benchmarks/bench_ops.py --out
DIR``), each if present, and run.sh's steps.tsv (the build, test and sanitizer steps) if present;
writes DIR/report.md: the environment, each benchmark's table and verdict lines, links to the
PNGs. Prints every verdict line again at the end, one per target. Exit status: 1 when a verdict
failed (the performance verdicts of a CPU smoke run are not targets and never fail it), 2 when
DIR holds none of the JSON files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import _common as c
import memory_timeline
import step_time

from leanddp.bench._env import environment

HERE = Path(__file__).resolve().parent
BENCH_OPS = HERE.parent / "bench_ops.py"
SOURCES = ["memory_timeline", "step_time", "bench_ops"]
TITLES = {
    "memory_timeline": "Memory through one step (`benchmarks/gpu/memory_timeline.py`)",
    "step_time": "Step time, interleaved (`benchmarks/gpu/step_time.py`)",
    "bench_ops": "Kernels against torch's own (`benchmarks/bench_ops.py`)",
}


def load_bench_ops():
    """benchmarks/bench_ops.py as a module: its table and its TARGETS are reused as they are."""
    spec = importlib.util.spec_from_file_location("bench_ops", BENCH_OPS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ops_verdicts(bench_ops, rows: list[dict], smoke: bool) -> list[dict]:
    """bench_ops.py's targets as verdict lines: the best leanddp implementation of each case."""
    out = []
    for device, case, metric, threshold, value in bench_ops.target_values(rows):
        subject = f"ops {device} {case} {value:.2f} {bench_ops.UNITS[metric]}"
        out.append(c.verdict(subject, f"target ≥ {threshold:g}", value >= threshold, smoke))
    return out


def fenced(lines) -> list[str]:
    """Lines as a markdown text block (one verdict per line, as printed), after a blank line."""
    return ["", "```text", *lines, "```"]


def steps_table(path: Path) -> list[str]:
    """run.sh's steps (name, status, seconds, note) as a markdown table."""
    lines = ["| step | status | seconds | note |", "|---|---|---:|---|"]
    for row in path.read_text().splitlines():
        name, status, seconds, note = (row.split("\t") + ["", "", ""])[:4]
        lines.append(f"| {name} | {status} | {seconds} | {note} |")
    return lines


def build(directory: Path) -> tuple[str, list[dict]]:
    """report.md's text and every verdict, from what ``directory`` holds."""
    reports = {}
    for name in SOURCES:
        path = directory / f"{name}.json"
        if path.exists():
            reports[name] = json.loads(path.read_text())
    if not reports:
        raise FileNotFoundError(
            f"{directory} holds none of {', '.join(s + '.json' for s in SOURCES)}"
        )
    smoke = any(r.get("smoke", False) for r in reports.values())
    env = environment("python " + " ".join(sys.argv))
    lines = ["# leanddp GPU suite", ""]
    if smoke:
        lines += [
            "**CPU smoke run**: tiny model, few steps; its performance numbers are not "
            "targets, only a check that the suite runs.",
            "",
        ]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    verdicts: list[dict] = []
    for name, rep in reports.items():
        lines += ["", f"## {TITLES[name]}", "", f"`{rep['env']['command']}`", ""]
        if rep.get("complete") is False:
            lines += ["**Incomplete**: the run stopped before its last measurement.", ""]
        if name == "bench_ops":
            bench_ops = load_bench_ops()
            found = ops_verdicts(bench_ops, rep["rows"], smoke)
            lines.append(bench_ops.markdown(rep["rows"], {}))
            pngs = sorted(p.name for p in directory.glob("bench_ops_*.png"))
        else:
            module = memory_timeline if name == "memory_timeline" else step_time
            found = rep["verdicts"]
            lines.append(module.markdown(rep))
            pngs = [f"{name}.png"] if (directory / f"{name}.png").exists() else []
        lines += fenced(v["line"] for v in found)
        lines += [line for png in pngs for line in ("", f"![{png}]({png})")]
        verdicts += found
    missing = [s for s in SOURCES if s not in reports]
    if missing:
        lines += ["", f"Not in this directory: {', '.join(s + '.json' for s in missing)}."]
    if (directory / "steps.tsv").exists():
        lines += ["", "## Suite steps (`benchmarks/gpu/run.sh`)", ""]
        lines += steps_table(directory / "steps.tsv")
    lines += ["", "## Verdicts", *fenced(v["line"] for v in verdicts)]
    return "\n".join(lines) + "\n", verdicts


def main(argv: list[str]) -> int:
    """Writes DIR/report.md and prints the verdicts; the exit status the docstring above says."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", type=Path, default=c.DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a directory")
    try:
        text, verdicts = build(args.directory)
    except FileNotFoundError as e:
        parser.error(str(e))
    (args.directory / "report.md").write_text(text)
    c.log("report", f"wrote {args.directory / 'report.md'}")
    print("\n".join(v["line"] for v in verdicts))
    failed = [v for v in verdicts if not v["passed"] and not v["smoke"]]
    if failed:
        c.log("report", f"{len(failed)} of {len(verdicts)} verdicts FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
