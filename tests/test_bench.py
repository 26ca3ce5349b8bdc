"""``python -m leanddp.bench``, the main job: it runs, reports, and refuses bad arguments."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

from leanddp.bench._report import device_bytes_per_param, table

CONFIGS = ["torch DDP", "leanddp", "leanddp + optimizer_in_backward", "leanddp + offload_to_cpu"]


def bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "leanddp.bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bench_runs_every_configuration_with_accumulation(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = bench("--steps", "1", "--warmup", "1", "--accum", "2", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    runs = {r["config"]: r for r in report["runs"]}
    assert sorted(runs) == sorted(CONFIGS)
    params = runs["torch DDP"]["memory"]["parameters"]
    assert params == 4 * report["params"]  # fp32, rank 0
    for name, r in runs.items():
        m = r["memory"]
        assert r["accum"] == 2 and r["world_size"] == 2 and r["backend"] == "gloo"
        assert len(r["losses"]) == 2 and r["step_seconds"] > 0
        # accumulating in place needs every bucket; torch's buckets always hold one copy
        assert m["buckets"] >= params, name
        assert m["peak_process"] > 0, name
    assert runs["torch DDP"]["memory"]["gradients"] == params  # separate param.grad tensors
    assert runs["leanddp"]["memory"]["gradients"] < params  # views: at most a bucket's worth
    state = runs["torch DDP"]["memory"]["optimizer_device"]
    assert 2 * params <= state < 2 * params + 4096  # AdamW: 2 moments and a step per tensor
    off = runs["leanddp + offload_to_cpu"]
    assert off["memory"]["optimizer_device"] == 0
    assert off["memory"]["host"] >= 3 * params  # moments + masters (+ staging)
    assert off["host_step"]["buckets"] > 0
    assert "final losses agree across all 4 runs" in done.stdout
    assert (out / "bench.md").read_text().strip() == done.stdout.strip()
    # the bytes-per-parameter column is the device categories' sum (parameters included) over
    # the parameter count; torch's DDP holds parameters, gradients, buckets and 2 moments: 20 B
    header = next(line for line in done.stdout.splitlines() if line.startswith("| configuration"))
    column = header.split("|").index(" bytes per parameter on the device ")
    for name, r in runs.items():
        row = next(line for line in done.stdout.splitlines() if line.startswith(f"| {name} |"))
        m = r["memory"]
        total = m["parameters"] + m["gradients"] + m["buckets"] + m["optimizer_device"]
        assert float(row.split("|")[column]) == round(total / report["params"], 1), name
        assert len(r["step_times"]) == 1 and r["step_seconds"] == r["step_times"][0]
    assert 20 <= device_bytes_per_param(runs["torch DDP"], report["params"]) < 20.01
    assert device_bytes_per_param(runs["leanddp + offload_to_cpu"], report["params"]) < 10
    assert (out / "bench.png").stat().st_size > 10_000
    assert "[2/4] leanddp, accumulation 2" in done.stderr  # progress


def test_bench_without_accumulation_frees_gradients_in_backward(tmp_path: Path) -> None:
    done = bench(
        "--steps", "1", "--warmup", "1", "--accum", "1", "--out", str(tmp_path),
        "--configs", "leanddp + optimizer_in_backward",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    memory = report["runs"][0]["memory"]
    assert memory["parameters"] == 4 * report["params"]
    # stepped and released bucket by bucket: never all buckets at once
    assert 0 < memory["buckets"] < memory["parameters"]
    assert "vs torch DDP" in done.stdout  # no torch run to compare with: the ratio is left out


def test_bench_rejects_bad_arguments_before_launching() -> None:
    done = bench("--accum", "3", timeout=60)
    assert done.returncode == 2
    assert "--accum 3 must divide the batch of 8 sequences" in done.stderr
    assert "runs:" not in done.stderr  # nothing launched
    done = bench("--steps", "0", timeout=60)
    assert done.returncode == 2 and "--steps must be at least 1" in done.stderr


def test_report_says_when_final_losses_differ() -> None:
    run = {
        "config": "torch DDP",
        "accum": 1,
        "step_seconds": 0.1,
        "losses": [2.0, 1.0],
        "memory": dict(
            parameters=8, gradients=8, buckets=8, optimizer_device=16, host=0, peak_process=64
        ),
        "host_step": None,
        "world_size": 2,
        "backend": "gloo",
    }
    other = copy.deepcopy(run) | {"config": "leanddp"}
    report = {
        "env": dict(command="c", leanddp="0", torch="t", python="p", cpu="x", cpus="2"),
        "args": dict(device="cpu", dtype="fp32", bucket_cap_mb="2", steps="1", warmup="1"),
        "params": 2,
        "runs": [run, other],
    }
    text, agree = table(report)
    assert agree and "agree across all 2 runs" in text
    # (8 + 8 + 8 + 16) bytes over 2 parameters; one sample: median, fastest and slowest agree
    assert "| torch DDP | 1 | 100.0 | 100.0–100.0 | 1.000 |" in text
    assert "| 20.0 | — | 0.00 | 1.00000 |" in text
    other["losses"] = [2.0, 1.02]
    text, agree = table(report)
    assert not agree and "DIFFER" in text and "2.0e-02 relative" in text
