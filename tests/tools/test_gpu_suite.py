"""The GPU suite (benchmarks/gpu/) in its CPU smoke mode: ``run.sh --smoke`` end to end (the
environment first, the report), the report with a bench_ops.json beside it, the usage errors of
every script, and the tests part's pytest files without a GPU: they collect, and every GPU case
in them is skipped, none fails or errors."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "gpu"
#: the tolerances step_time.py states (largest difference over largest magnitude)
PARAM_TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2}
SHARDED = "leanddp in-backward sharded"
LEANDDP_CONFIGS = [
    "leanddp",
    "leanddp + optimizer_in_backward",
    "leanddp + offload_to_cpu",
    SHARDED,
    "leanddp offload sharded",
]
#: step_time only: offload_to_cpu with accumulate_on_host=False
DEVICE_ACCUMULATION = "leanddp + offload_to_cpu, accumulating on the device"


def suite_module(name: str):
    """A script of benchmarks/gpu, imported (they import each other by plain name)."""
    if str(SUITE) not in sys.path:
        sys.path.insert(0, str(SUITE))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT_DIR of one ``run.sh --smoke`` with this interpreter."""
    out = tmp_path_factory.mktemp("gpu-suite")
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("LEANDDP_GPU_SMOKE", None)
    proc = subprocess.run(
        ["bash", str(SUITE / "run.sh"), "--smoke", "all", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return out


def finite(value: float, positive: bool = True) -> bool:
    """A finite number, and above zero when ``positive``."""
    return isinstance(value, (int, float)) and math.isfinite(value) and (value > 0 or not positive)


def test_environment_comes_first(smoke_dir: Path) -> None:
    """run.log starts with the machine and the toolchain, also in env.txt; a tool this machine
    lacks (nvidia-smi, compute-sanitizer) is noted, not fatal."""
    env = (smoke_dir / "env.txt").read_text()
    for label in ("cpu cores", "gpus", "python", "torch", "nvcc", "compute-sanitizer", "git"):
        assert re.search(rf"^{label}\b", env, re.M), (label, env)
    assert "nccl" in env and "source hash" in env, env
    log = (smoke_dir / "run.log").read_text()
    assert log.index("cpu cores:") < log.index("bench: memory_timeline"), log[:2000]


def test_gpu_cases_skip_cleanly_without_a_gpu() -> None:
    """What run.sh's tests part runs with pytest (the GPU cases of its files), run here with no
    GPU visible: every file collects, and every case is skipped for want of a GPU; none fails,
    errors or passes. (A GPU run meets no import or collection error first; a GPU case that
    forgot its skip mark fails here, not there.)"""
    listed = subprocess.run(
        ["bash", str(SUITE / "run.sh"), "--list-tests"], capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr
    args = listed.stdout.splitlines()
    files = [a for a in args if a.endswith(".py")]
    ddp_files = {"tests/device/test_cuda_ddp_parity.py", "tests/device/test_cuda_ddp_async.py"}
    assert ddp_files <= set(files), args
    assert all((REPO / f).is_file() for f in files), args
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1]  # e.g. "130 skipped, 116 deselected in 1.64s"
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", summary)}
    others = set(counts) - {"skipped", "deselected", "warnings", "warning"}
    assert proc.returncode == 0 and counts.get("skipped") and not others, out[-6000:]
    skips = re.findall(r"^SKIPPED \[(\d+)\] (tests/[\w./]+):\d+: (.*)$", out, re.M)
    assert sum(int(n) for n, _, _ in skips) == counts["skipped"], out[-6000:]
    bad = {reason for _, _, reason in skips if "GPU" not in reason}
    assert not bad, f"skipped for another reason than a missing GPU: {bad}"
    assert {f for _, f, _ in skips} == set(files), "a file has no GPU case left"


def test_memory_timeline_json(smoke_dir: Path) -> None:
    report = json.loads((smoke_dir / "memory_timeline.json").read_text())
    assert report["smoke"] is True and report["device"] == "cpu"
    assert {"env", "args", "baseline", "results", "verdicts", "numel"} <= set(report)
    names = [r["config"] for r in report["results"]]
    assert names == ["torch DDP", *LEANDDP_CONFIGS]
    assert finite(report["baseline"]["fp32"]["activation_bytes"], positive=False)
    for r in report["results"]:
        for key in (
            "peak_bytes",
            "bytes_per_param",
            "allowance_per_param",
            "largest_bucket_bytes",
            "peak_grad_buckets",
            "numel",
            "param_bytes",
        ):
            assert finite(r[key]), (r["config"], key, r[key])
        assert len(r["timeline"]) > 1 and all(finite(s) for s in r["timeline"])
        if r["config"] != "torch DDP":  # buckets in flight: counted with optimizer_in_backward
            in_backward = r["config"] != "leanddp"
            assert finite(r["peak_bucket_bytes"])
            assert finite(r["max_buckets_in_flight"], positive=in_backward)
    # the CPU samples are bytes by account: torch's DDP holds 4 + 4 + 4 + 8 bytes per parameter
    assert report["results"][0]["bytes_per_param"] == pytest.approx(20.0, rel=1e-3)
    # shard_optimizer_state at world size 1: the shard is the whole bucket, so it holds what the
    # unsharded in-backward run holds, up to the padding and the buckets in flight (gloo's
    # timing decides whether one or two are held at once)
    by_name = {r["config"]: r for r in report["results"]}
    sharded, unsharded = by_name[SHARDED], by_name["leanddp + optimizer_in_backward"]
    assert sharded["world_size"] == 1
    gap = sharded["bytes_per_param"] - unsharded["bytes_per_param"]
    assert abs(gap) <= sharded["allowance_per_param"] + 0.01
    assert any(
        f"bytes/param {SHARDED}" in v["line"] and "(4 + 8/N, world size 1)" in v["line"]
        for v in report["verdicts"]
    )
    assert report["verdicts"] and all(
        "(cpu smoke: not a target)" in v["line"] for v in report["verdicts"]
    )
    # offload_to_cpu through a step of 4 micro-batches: accumulating on the host it holds what
    # its step without accumulation holds; on the device every bucket stays (4 B per parameter)
    host, device = report["accumulated"]
    assert (host["config"], device["config"]) == ("leanddp + offload_to_cpu", DEVICE_ACCUMULATION)
    assert host["accum"] == device["accum"] == 4
    one = by_name["leanddp + offload_to_cpu"]["bytes_per_param"]
    assert host["bytes_per_param"] <= one + 0.5
    assert device["bytes_per_param"] >= one + 2
    assert any("accumulation 4" in v["line"] for v in report["verdicts"])
    png = (smoke_dir / "memory_timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_step_time_json_and_parameter_agreement(smoke_dir: Path) -> None:
    report = json.loads((smoke_dir / "step_time.json").read_text())
    assert {"env", "args", "results", "verdicts", "numel"} <= set(report)
    assert [r["accum"] for r in report["results"]] == [1, 4]
    for res in report["results"]:
        assert list(res["configs"]) == [
            "torch DDP", "torch DDP + views", *LEANDDP_CONFIGS, DEVICE_ACCUMULATION
        ]  # fmt: skip
        for cfg in res["configs"].values():
            assert finite(cfg["step_seconds"]) and finite(cfg["final_loss"])
            assert all(finite(t) for t in cfg["times"])
        assert len(res["ratios"]) == 7 and all(finite(r["ratio"]) for r in res["ratios"])
        host = res["host_step"]
        assert finite(host["step_seconds"]) and finite(host["buckets"])
        assert finite(host["hidden"], positive=False) and host["hidden"] <= 1
        tolerance = PARAM_TOLERANCE[res["dtype"]]
        assert res["param_tolerance"] == tolerance
        for name in [*LEANDDP_CONFIGS, DEVICE_ACCUMULATION]:
            diff = res["configs"][name]["param_rel_diff"]
            assert finite(diff, positive=False) and diff <= tolerance, (name, diff)
    shard_steps = [
        v for v in report["verdicts"] if f"step time {SHARDED} vs torch DDP" in v["line"]
    ]
    assert len(shard_steps) == len(report["results"])
    agreement = [v for v in report["verdicts"] if " parameters " in v["line"]]
    assert len(agreement) == (len(LEANDDP_CONFIGS) + 1) * len(report["results"])
    assert all(v["passed"] and " agree PASS" in v["line"] for v in agreement)


def test_report_holds_every_verdict(smoke_dir: Path) -> None:
    text = (smoke_dir / "report.md").read_text()
    for name in ("memory_timeline", "step_time"):
        for v in json.loads((smoke_dir / f"{name}.json").read_text())["verdicts"]:
            assert v["line"] in text
    assert "![memory_timeline.png](memory_timeline.png)" in text
    assert "bench: step_time | PASS" in text  # run.sh's step table
    log = (smoke_dir / "run.log").read_text()
    assert "bench: report: PASS" in log


def test_report_with_bench_ops(smoke_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """bench_ops.py's own JSON (its CPU cases, shrunk) goes into the report with its targets."""
    report = suite_module("report")
    bench_ops = report.load_bench_ops()
    monkeypatch.setattr(bench_ops, "GPT2_SHAPES", [(64, 32), (32,)] * 4)
    bench_ops.main(["bench_ops.py", "--device", "cpu", "--rounds", "1", "--out", str(tmp_path)])
    for name in ("memory_timeline.json", "step_time.json"):
        shutil.copy(smoke_dir / name, tmp_path / name)
    assert report.main([str(tmp_path)]) == 0  # a smoke run's performance verdicts never fail
    text = (tmp_path / "report.md").read_text()
    rows = json.loads((tmp_path / "bench_ops.json").read_text())["rows"]
    found = report.ops_verdicts(bench_ops, rows, smoke=True)
    assert found and all(v["line"] in text for v in found)
    assert "![bench_ops_cpu.png](bench_ops_cpu.png)" in text


@pytest.mark.parametrize(
    "script, argv",
    [
        ("memory_timeline", ["--smoke", "--dtypes", "fp16"]),
        ("memory_timeline", ["--smoke", "--seq", "100000"]),
        ("memory_timeline", ["--smoke", "--bucket-cap-mb", "-1"]),
        ("step_time", ["--smoke", "--accum", "3"]),
        ("step_time", ["--smoke", "--accum", "1,x"]),
        ("step_time", ["--smoke", "--rounds", "0"]),
        ("step_time", ["--smoke", "--dtype", "fp32,"]),
    ],
)
def test_bad_arguments_exit_2(script: str, argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as e:
        suite_module(script).parse(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_bad_usage_of_run_sh_and_report(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(SUITE / "run.sh"), "bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown part 'bogus'" in proc.stderr
    with pytest.raises(SystemExit) as e:
        suite_module("report").main([str(tmp_path)])
    assert e.value.code == 2


def test_restart_resumes_bit_for_bit(smoke_dir: Path) -> None:
    """restart.py (the bench part's last run): the example killed under torchrun
    --max-restarts 1 resumed in torchrun's next round and ended as the straight run did."""
    report = json.loads((smoke_dir / "restart.json").read_text())
    assert report["smoke"] and [v["mode"] for v in report["modes"]] == ["plain"], report
    for verdict in report["modes"]:
        assert verdict["ok"], verdict
        assert 0 < verdict["resumed_at"] <= verdict["last_step_before_kill"], verdict
