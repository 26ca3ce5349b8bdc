"""benchmarks/long_run.py, the long-run reliability check: a short run of every configuration
passes and reports parity, resident memory and flat memory_stats(), events and threads (with
host ordering, events created: the pools stop growing); a rank past the deadline is dumped and
killed; the verdict fails what grows after warm-up."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "long_run.py"
CONFIGS = ["everything", "device", "views", "unused", "nan-strict", "sharded-clip",
           "sharded-clip-offload"]  # fmt: skip
#: The configurations whose steps are clipped (leanddp's norm is compared with torch's).
CLIPPED = ["everything", "sharded-clip", "sharded-clip-offload"]


def long_run(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs the script for 30 steps (checkpoints every 10, warm-up 10), ranks forked (they
    start in a second, not the ten a spawned rank takes to import torch)."""
    cmd = [sys.executable, str(SCRIPT), "--steps", "30", "--checkpoint-every", "10",
           "--warmup-steps", "10", "--start-method", "fork"]  # fmt: skip
    return subprocess.run(
        [*cmd, "--out", str(out), *args], capture_output=True, text=True, timeout=timeout
    )


def test_every_configuration_keeps_parity_and_stays_flat(tmp_path: Path) -> None:
    done = long_run(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "long_run.json").read_text())
    assert report["env"]["torch"] and report["params"] > 0
    runs = {r["config"]: r for r in report["runs"]}
    assert sorted(runs) == sorted(CONFIGS)
    for name, r in runs.items():
        assert r["failures"] == [] and r["flat_changed"] == [], name
        assert [c["step"] for c in r["checkpoints"]] == [10, 20, 30], name
        assert r["baseline_step"] == 20, name  # the first window after the warm-up
        drawn = {int(k): v for k, v in r["micro_batches"].items()}
        assert sum(drawn.values()) == 30 and set(drawn) == {1, 2, 3, 4}, name
        for c in r["checkpoints"]:
            assert 0.0 <= c["max_rel"] <= r["tolerance"] or c["bitwise"], name
            assert c["ranks_differ_ours"] == 0.0, name
            assert len(c["rss"]) == 2 and all(x > 0 for x in c["rss"]), name
            assert c["memory_stats"][0]["num_buckets"] > 1, name  # tiny buckets
            for f in c["flat"]:
                assert f["os_threads"] >= f["py_threads"] >= 1, name
                assert f["peak_bucket_bytes"] > 0 and f["max_buckets_in_flight"] >= 1, name
        first, last = r["checkpoints"][1]["flat"], r["checkpoints"][-1]["flat"]
        assert first == last, name  # flat after warm-up, on both ranks
        assert last[0]["events_created"] == 0, name  # no event on the CPU
        assert len(r["rss_growth"]) == 2, name
    assert runs["views"]["checkpoints"][-1]["bitwise"]  # plain views: bitwise torch's
    assert runs["views"]["tolerance"] == 0.0
    for name in CLIPPED:  # leanddp's norm vs clip_grad_norm_'s, every step
        assert runs[name]["grad_norm"]["max_rel_diff"] < 1e-5, name
        assert runs[name]["grad_norm"]["steps_clipped"] > 0, name
    offload = runs["everything"]
    assert offload["offload_stats"]["iterations"] == 30
    assert offload["checkpoints"][-1]["flat"][1]["host_bytes"] > 0
    # the steps that wait for the end of backward hold every bucket until then
    for name in ["unused", "nan-strict", "sharded-clip"]:
        s = runs[name]["checkpoints"][-1]
        assert s["flat"][0]["max_buckets_in_flight"] >= s["memory_stats"][0]["num_buckets"] - 1
    md = (tmp_path / "long_run.md").read_text()
    for name in CONFIGS:
        assert f"| {name} |" in md and f"### {name}:" in md
    assert "all passed" in done.stderr
    assert "everything step 10/30" in done.stderr  # progress lines


def test_event_pools_stop_growing_under_host_ordering(tmp_path: Path) -> None:
    # host ordering: CPU tensors ordered as on a GPU, so leanddp creates (pooled) events. Not
    # with offload_to_cpu here: how many of its events are out at once depends on the host
    # worker's pace, so its pool may still grow after 10 steps (the 2000-step run: by step 100)
    configs = ["device", "unused", "nan-strict", "sharded-clip"]
    done = long_run(tmp_path, "--host-ordering", "--configs", *configs)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "long_run.json").read_text())
    for r in report["runs"]:
        assert r["failures"] == [] and r["flat_changed"] == [], r["config"]
        events = [[f["events_created"] for f in c["flat"]] for c in r["checkpoints"]]
        assert events[0][0] > 0 and events[1] == events[2], (r["config"], events)


def test_a_run_past_its_deadline_is_dumped_killed_and_failed(tmp_path: Path) -> None:
    done = long_run(tmp_path, "--configs", "views", "--steps", "1000000", "--deadline-s", "6")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "still running after the deadline of 6 s" in done.stderr
    assert "in train_step" in done.stderr or "in worker" in done.stderr  # faulthandler's stacks
    report = json.loads((tmp_path / "long_run.json").read_text())
    assert "deadline" in report["runs"][0]["failures"][0]
    assert "FAILED" in (tmp_path / "long_run.md").read_text()


def point(step: int, rss: int, events: int, threads: int = 11) -> dict:
    """A checkpoint of a run that passed parity, with these flatness figures on both ranks."""
    flat = dict(bucket_bytes=0, peak_bucket_bytes=1000, max_buckets_in_flight=2,
                recycled_bucket_bytes=0, grad_bytes=0, host_bytes=0, events_created=events,
                py_threads=1, os_threads=threads)  # fmt: skip
    return dict(step=step, max_rel=1e-7, bitwise=False, worst="w", ranks_differ_ours=0.0,
                rss=[rss, rss], flat=[flat, dict(flat)])  # fmt: skip


def test_the_verdict_fails_what_grows_after_warm_up() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from _long_run_report import MIB, verdict
    finally:
        sys.path.remove(str(BENCHMARKS))
    args = argparse.Namespace(warmup_steps=100, max_rss_growth_mb=8.0)
    # the first window (steps 1-100: bucket rebuild, first events) may differ
    ok = dict(tolerance=1e-5, checkpoints=[point(100, 0, 9), point(200, 0, 14), point(300, 0, 14)])
    assert verdict(ok, args) == [] and ok["baseline_step"] == 200
    grows = dict(tolerance=1e-5, checkpoints=[point(100, 0, 14), point(200, 0, 14),
                                              point(300, 9 * MIB, 15, threads=12)])  # fmt: skip
    fails = verdict(grows, args)
    assert sorted(set(grows["flat_changed"])) == ["events_created", "os_threads"]
    assert any("RSS grew 9.0 MiB from step 200 to 300" in f for f in fails), fails
    assert any("events_created went from 14 (step 200) to 15 (step 300)" in f for f in fails)
