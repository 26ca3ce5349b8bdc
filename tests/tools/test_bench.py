"""``python -m leanddp.bench``, the main job: it runs, reports, and refuses bad arguments."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leanddp import _memory, plan
from leanddp.bench import main
from leanddp.bench._model import SIZES, TinyGPT
from leanddp.bench._report import DPI, device_bytes_per_param, figure, table

pytestmark = pytest.mark.slow

SHARDED = "leanddp in-backward sharded"
UNSHARDED = "leanddp + optimizer_in_backward"
SHARDED_OFFLOAD = "leanddp offload sharded"
OFFLOAD = "leanddp + offload_to_cpu"
DEVICE_ACCUMULATION = "leanddp + offload_to_cpu, accumulating on the device"
CONFIGS = [
    "torch DDP", "leanddp", UNSHARDED, OFFLOAD, SHARDED, SHARDED_OFFLOAD, DEVICE_ACCUMULATION
]  # fmt: skip


def assert_planned(report: dict) -> None:
    """The planner's categories (leanddp.plan, the memory model of docs/memory.md) equal what
    the bench measured for every run, within the buckets-in-flight allowance (the window's
    buckets of the run's largest); parameters exactly."""
    with torch.device("meta"):
        model = TinyGPT(SIZES[report["args"]["model"]])
    cap = float(report["args"]["bucket_cap_mb"])
    for r in report["runs"]:
        mode, optimizer = _memory.mode_and_optimizer(r["config"])
        shape = plan.shape_of(model, bucket_cap_mb=cap, first_layout=mode.keeps_first_layout)
        e = _memory.estimate(
            mode,
            shape,
            optimizer=optimizer,
            world_size=r["world_size"],
            accumulation=r["accum"],
        )
        m = r["memory"]
        allowance = _memory.BUCKETS_IN_FLIGHT * m.get("largest_bucket", shape.largest_bucket)
        what = (r["config"], r["accum"], r["world_size"], m, e.bytes)
        assert m["parameters"] == e.bytes["parameters"], what
        for measured, planned in (
            (m["gradients"], e.bytes["gradients"]),
            (m["buckets"], e.bytes["buckets"]),
            (m["optimizer_device"], e.bytes["optimizer_state"]),
            (m["host"], e.host),
        ):
            assert abs(measured - planned) <= allowance, what


def assert_labels_readable(report: dict) -> None:
    """The chart's x-axis labels do not overlap, at the configurations this run measured and
    at the default run's (each configuration at accumulation 1 and 4: 13 runs), drawn at the
    PNG's resolution."""
    matplotlib = pytest.importorskip("matplotlib", reason="the chart needs matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main_runs = [r for r in report["runs"] if r["world_size"] == 2]
    default = {**report, "runs": [
        {**r, "accum": accum}
        for accum in (1, 4)
        for r in main_runs
        if accum == 4 or r["config"] != DEVICE_ACCUMULATION
    ] + [r for r in report["runs"] if r["world_size"] != 2]}  # fmt: skip
    for what in (report, default):
        fig = figure(what)
        fig.set_dpi(DPI)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        labels = fig.axes[2].get_xticklabels()
        for a, b in zip(labels, labels[1:], strict=False):
            x, y = a.get_window_extent(renderer), b.get_window_extent(renderer)
            assert x.x1 < y.x0, f"{a.get_text()!r} overlaps {b.get_text()!r}"
        plt.close(fig)


def bench(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "leanddp.bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_bench_runs_every_configuration_with_accumulation(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = bench(
        "--steps", "1", "--warmup", "1", "--host-steps", "3", "--accum", "2",
        "--world-sizes", "2", "3", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    runs = {r["config"]: r for r in report["runs"] if r["world_size"] == 2}
    assert sorted(runs) == sorted(CONFIGS)
    # the world-size series: the in-backward configurations, unsharded and sharded, at 3 ranks
    at3 = {r["config"]: r for r in report["runs"] if r["world_size"] == 3}
    assert list(at3) == [UNSHARDED, SHARDED] and len(report["runs"]) == len(CONFIGS) + 2
    params = runs["torch DDP"]["memory"]["parameters"]
    assert params == 4 * report["params"]  # fp32, rank 0
    for name, r in runs.items():
        m = r["memory"]
        assert r["accum"] == 2 and r["backend"] == "gloo"
        assert len(r["losses"]) == 2 and r["step_seconds"] > 0
        # accumulating in place needs every bucket; torch's buckets always hold one copy;
        # offload_to_cpu accumulates on the host: the buckets in flight only
        if name in (OFFLOAD, SHARDED_OFFLOAD):
            assert m["buckets"] < params / 2 and m["host_accumulation"] >= params, name
        else:
            assert m["buckets"] >= params, name
        assert m["peak_process"] > 0, name
    assert runs["torch DDP"]["memory"]["gradients"] == params  # separate param.grad tensors
    assert runs["leanddp"]["memory"]["gradients"] < params  # views: at most a bucket's worth
    state = runs["torch DDP"]["memory"]["optimizer_device"]
    assert 2 * params <= state < 2 * params + 4096  # AdamW: 2 moments and a step per tensor
    off = runs["leanddp + offload_to_cpu"]
    assert off["memory"]["optimizer_device"] == 0
    assert off["memory"]["host"] >= 3 * params  # moments + masters (+ staging)
    # the share hidden is measured over --host-steps more steps: every one stepped every bucket
    host = off["host_step"]
    assert host["steps"] == 3 and host["buckets"] > 0 and host["buckets"] % 3 == 0, host
    assert host["wait_seconds"] >= 0 and host["step_seconds"] > 0, host
    # offload_to_cpu with shard_optimizer_state: each host holds half (2 ranks), within padding,
    # of the state, masters and staging; the sums of the no_sync() micro-batches are whole (one
    # per bucket at accumulation 2: a bucket is cut into shards only when reduced)
    half = runs[SHARDED_OFFLOAD]["memory"]
    summed = off["memory"]["host_accumulation"]
    assert half["host_accumulation"] == summed == params, (summed, params)
    kept = half["host"] - summed
    assert abs(kept - (off["memory"]["host"] - summed) / 2) <= 16 * 64 * 3, half["host"]
    assert half["optimizer_device"] == 0
    # shard_optimizer_state: this rank keeps 1/N of the unsharded AdamW state (rank 0's shard
    # holds no padding: at least the N-th part, at most a few 16-byte units above it); the
    # parameters stay whole and, with accumulation, every bucket too
    for world, series in ((2, runs), (3, at3)):
        sharded, unsharded = series[SHARDED]["memory"], series[UNSHARDED]["memory"]
        share = unsharded["optimizer_device"] / world
        assert share - 4 * 64 <= sharded["optimizer_device"] <= share + 16 * 64, world
        assert sharded["parameters"] == params and sharded["buckets"] >= params, world
        assert sharded["host"] == 0
    per_param = {
        (name, world): device_bytes_per_param(series[name], report["params"])
        for world, series in ((2, runs), (3, at3))
        for name in (UNSHARDED, SHARDED)
    }
    # the series is monotone: the sharded run holds less at 3 ranks than at 2, by about
    # 8/2 - 8/3 bytes per parameter of state; the unsharded one holds the same
    drop = per_param[SHARDED, 2] - per_param[SHARDED, 3]
    assert 8 / 2 - 8 / 3 - 0.05 < drop < 8 / 2 - 8 / 3 + 0.05
    assert abs(per_param[UNSHARDED, 2] - per_param[UNSHARDED, 3]) < 0.05
    assert per_param[SHARDED, 2] < per_param[UNSHARDED, 2] - 3.9
    for world, series in ((2, runs), (3, at3)):
        agreed = f"final losses agree across all {len(series)} runs at world size {world}"
        assert agreed in done.stdout
    assert "Bytes per parameter on the device against world size" in done.stdout
    assert f"| {SHARDED} | 3 |" in done.stdout
    # with accumulation every bucket lives across the micro-batches: no target applies
    assert "target, leanddp in-backward sharded" not in done.stdout
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
        # each leanddp configuration alternated a step with torch's DDP in its own processes
        versus = header.split("|").index(" vs torch DDP ")
        if name == "torch DDP":
            assert r["interleaved"] is None and row.split("|")[versus].strip() == "1.000"
        else:
            v = r["interleaved"]
            assert len(v["ours"]) == len(v["torch"]) == 1 and min(v["ours"] + v["torch"]) > 0
            assert v["ratio"] == v["ours"][0] / v["torch"][0], name
            assert row.split("|")[versus].strip() == f"{v['ratio']:.3f}", name
    assert 20 <= device_bytes_per_param(runs["torch DDP"], report["params"]) < 20.01
    assert device_bytes_per_param(runs["leanddp + offload_to_cpu"], report["params"]) < 10
    assert (out / "bench.png").stat().st_size > 10_000
    assert_labels_readable(report)
    assert_planned(report)
    assert "[2/9] leanddp, accumulation 2, world size 2" in done.stderr  # progress
    assert f"[9/9] {SHARDED}, accumulation 2, world size 3" in done.stderr


def test_offload_accumulating_on_the_host_holds_what_it_holds_without(tmp_path: Path) -> None:
    """offload_to_cpu at accumulation 1 and 4: the accumulated step holds no more on the device
    (the bench's line says the target is met), the sums are on the host, and the line gives the
    PCIe bytes per micro-batch of the memory model."""
    done = bench(
        "--steps", "1", "--warmup", "1", "--host-steps", "3", "--accum", "1", "4",
        "--out", str(tmp_path), "--configs", OFFLOAD, "--world-sizes", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    one, four = report["runs"]
    params = report["params"]
    assert (one["accum"], four["accum"]) == (1, 4)
    gap = device_bytes_per_param(four, params) - device_bytes_per_param(one, params)
    # one step each: how many buckets are in flight at once (one or two) moves with gloo's
    # timing, in either run; keeping every bucket would add 4 bytes per parameter
    jitter = four["memory"]["largest_bucket"] / params
    assert gap <= 0.5 + jitter, (gap, jitter)
    assert four["memory"]["host_accumulation"] == 2 * 4 * params  # the sums and incoming
    line = next(x for x in done.stdout.splitlines() if x.startswith("- accumulation 4, "))
    assert "accumulate_on_host, target ≤ +0.5: " + ("met" if gap <= 0.5 else "MISSED") in line
    mib = 4 * params / 2**20
    assert f"PCIe per no_sync() micro-batch {mib:.1f} MiB to the host" in line, line
    assert f"per synchronized micro-batch {mib:.1f} MiB to the host and {2 * mib:.1f}" in line
    assert_planned(report)


def test_bench_without_accumulation_frees_gradients_in_backward(tmp_path: Path) -> None:
    done = bench(
        "--steps", "1", "--warmup", "1", "--accum", "1", "--out", str(tmp_path),
        "--configs", "leanddp + optimizer_in_backward", "--world-sizes", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    memory = report["runs"][0]["memory"]
    assert memory["parameters"] == 4 * report["params"]
    # stepped and released bucket by bucket: never all buckets at once
    assert 0 < memory["buckets"] < memory["parameters"]
    assert_planned(report)
    # torch's DDP was not a configuration: the ratio comes from the steps interleaved with it
    ratio = report["runs"][0]["interleaved"]["ratio"]
    assert ratio > 0 and f"| {ratio:.3f} |" in done.stdout


def test_bench_8bit_holds_what_the_planner_says(tmp_path: Path) -> None:
    """--lowbit: torchao's AdamW8bit under torch's DDP, in-backward and offloaded; each holds the
    memory model's bytes (8-bit codes and scales, plain moments for small tensors), and the
    8-bit runs' step time is measured against torch's DDP + AdamW8bit. torchao's own step runs
    eagerly here (TORCHDYNAMO_DISABLE): compiling it in each rank of each run took about a third
    of this test's time, and no tensor it holds depends on it."""
    pytest.importorskip("torchao.optim")
    anchor, *ours = _memory.LOWBIT_CONFIGS
    done = bench(
        "--steps", "1", "--warmup", "1", "--host-steps", "2", "--accum", "1", "--lowbit",
        "--configs", anchor, "--out", str(tmp_path), "--world-sizes", "2",
        env=dict(os.environ, TORCHDYNAMO_DISABLE="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    names = [r["config"] for r in report["runs"]]
    assert names == [anchor, *ours], names
    assert_planned(report)
    for r in report["runs"][1:]:
        assert r["interleaved"]["anchor"] == anchor, r["config"]
    # both moments in 8 bits and a scale per block, against 8 bytes per parameter in float32
    for r in report["runs"][:2]:  # torch's DDP + AdamW8bit, leanddp in-backward
        assert r["memory"]["optimizer_device"] < 8 * report["params"] / 3, r["config"]


def test_bench_rejects_bad_arguments_before_launching(capsys: pytest.CaptureFixture) -> None:
    done = bench("--accum", "3", timeout=60)
    assert done.returncode == 2
    assert "--accum 3 must divide the batch of 8 sequences" in done.stderr
    assert "runs:" not in done.stderr  # nothing launched
    for argv, message in (
        (["--steps", "0"], "--steps must be at least 1"),
        (["--host-steps", "0"], "--host-steps must be at least 1"),
        (["--world-sizes", "2", "0"], "every world size must be at least 1, got 0"),
    ):  # the same parser in this process
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "runs:" not in err


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


def test_report_states_the_sharded_targets_met_or_missed() -> None:
    """The world-size table and the target lines, from runs whose numbers are known: 100
    fp32 parameters, buckets of 40 bytes (2 in flight allowed: 0.8 bytes per parameter)."""

    def run(config: str, world: int, seconds: float, state: int, grads: int = 0) -> dict:
        memory = dict(
            parameters=400, gradients=grads, buckets=80, optimizer_device=state, host=0,
            peak_process=4096, largest_bucket=40,
        )  # fmt: skip
        return dict(
            config=config, accum=1, step_seconds=seconds, losses=[2.0, 1.0], memory=memory,
            host_step=None, world_size=world, backend="gloo",
        )  # fmt: skip

    report = {
        "env": dict(command="c", leanddp="0", torch="t", python="p", cpu="x", cpus=2),
        "args": dict(device="cpu", dtype="fp32", bucket_cap_mb="2", steps="1", warmup="1"),
        "params": 100,
        "runs": [
            run(UNSHARDED, 2, 0.100, 800),
            run(SHARDED, 2, 0.104, 400),  # 4 + 0.8 + 4 = 8.8 = 4 + 8/2 + 0.8: met
            run(UNSHARDED, 4, 0.100, 800),
            run(SHARDED, 4, 0.200, 200, grads=100),  # 7.8 > 4 + 8/4 + 0.8 = 6.8
        ],
    }
    text, agree = table(report)
    assert agree
    assert (
        f"| {SHARDED} | 2 | 104.0 | 1.040 | 4.00 | 0.00 | 0.80 | 4.00 | 0.500 (1/N = 0.500) "
        in text
    )
    assert "| 8.80 | 8.00 + 0.80 = 8.80 | yes |" in text
    assert "| 7.80 | 6.00 + 0.80 = 6.80 | **no** |" in text
    assert "world size 2: 8.80 bytes per parameter on the device against 4 + 8/2 = 8.00" in text
    assert "= 6.80: MISSED (parameters + optimizer state 6.00, buckets 0.80, gradients" in text
    assert "world size 2, accumulation 1: 1.040" in text and "at world size 2: met." in text
    assert "world size 4, accumulation 1: 2.000" in text and "no target at world size 4" in text
    # the main table holds the runs at the first run's world size only
    assert text.count(f"| {SHARDED} | 1 |") == 1
    report["args"]["dtype"] = "bf16"  # AdamW's state is not 8 bytes per parameter then
    text = table(report)[0]
    assert "MISSED" not in text and f"- target, {SHARDED}" not in text
