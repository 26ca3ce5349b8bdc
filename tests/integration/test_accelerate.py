"""Hugging Face Accelerate with leanddp: examples/accelerate_leanddp.py under torchrun (2 CPU
processes, gloo), trained with gradient accumulation by Accelerate's own torch DDP and by
leanddp's wrapper (plain, and with optimizer_in_backward + offload_to_cpu), from the same seeds
and data. The final parameters, the clipped gradient norms and the checkpoints written by
``accelerator.save_state`` must agree, and the accumulation micro-batches must run inside the
wrapper's ``no_sync()`` with no allreduce (counted by the profiler)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

import leanddp  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_leanddp.py"
MARKER = "ACCELERATE_LEANDDP_RESULT"
MICRO_BATCHES = 16  # 2 epochs of 64 samples, 2 processes, batch 4, accumulation over 2
RUNS = {
    "torch": ["--wrapper", "torch"],
    "leanddp": ["--wrapper", "leanddp"],
    "in_backward": ["--wrapper", "leanddp", "--optimizer-in-backward", "--offload-to-cpu"],
}


def _run_example(name: str, args: list[str], tmp: Path) -> dict[str, Any]:
    """Runs the example under torchrun with 2 processes; returns rank 0's report, with the
    final unwrapped state_dict and the save_state() directory."""
    out, state_dir = tmp / f"{name}.pt", tmp / f"{name}_state"
    env = dict(os.environ)
    # the subprocesses import the leanddp this test imported
    package_root = str(Path(leanddp.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLE),
        *args,
        "--seed=1234",
        "--count-allreduces",
        f"--check-state={state_dir}",
        f"--out={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER + " ")]
    assert len(lines) == 1, log
    report = json.loads(lines[0][len(MARKER) + 1 :])
    report["params"] = torch.load(out)
    report["state_dir"] = state_dir
    return report


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The three trainings, run once for every test of this module."""
    tmp = tmp_path_factory.mktemp("accelerate")
    return {name: _run_example(name, args, tmp) for name, args in RUNS.items()}


def test_accelerate_wraps_with_leanddp(runs: dict[str, dict[str, Any]]) -> None:
    for name in ("leanddp", "in_backward"):
        report = runs[name]
        assert report["wrapper_type"] == "leanddp.ddp.DistributedDataParallel", report
        assert report["is_leanddp"] and report["is_torch_ddp"]
        assert report["unwrapped_type"] == "Sequential"  # accelerator.unwrap_model
        assert report["distributed_type"] == "DistributedType.MULTI_CPU"
        assert report["num_processes"] == 2
    assert not runs["torch"]["is_leanddp"] and runs["torch"]["is_torch_ddp"]


@pytest.mark.parametrize("name", list(RUNS))
def test_accumulation_skips_allreduce(runs: dict[str, dict[str, Any]], name: str) -> None:
    micro = runs[name]["micro_batches"]
    assert len(micro) == MICRO_BATCHES
    assert [m["sync_gradients"] for m in micro] == [False, True] * (MICRO_BATCHES // 2)
    for m in micro:
        if m["sync_gradients"]:
            assert m["require_backward_grad_sync"]
            assert m["allreduces"] >= 1, micro
        else:  # accelerator.accumulate() entered the wrapper's no_sync()
            assert not m["require_backward_grad_sync"]
            assert m["allreduces"] == 0, micro
    reference = runs["torch"]["micro_batches"]
    assert [m["allreduces"] for m in micro] == [m["allreduces"] for m in reference]


def test_leanddp_matches_torch_bitwise(runs: dict[str, dict[str, Any]]) -> None:
    ours, ref = runs["leanddp"], runs["torch"]
    assert ours["params"].keys() == ref["params"].keys()
    for key, value in ref["params"].items():
        assert torch.equal(ours["params"][key], value), key
    assert [m["loss"] for m in ours["micro_batches"]] == [m["loss"] for m in ref["micro_batches"]]
    norms = [m.get("grad_norm") for m in ref["micro_batches"]]
    assert [m.get("grad_norm") for m in ours["micro_batches"]] == norms
    assert max(n for n in norms if n is not None) > 0.3  # clipping was active


def test_optimizer_in_backward_matches_torch(runs: dict[str, dict[str, Any]]) -> None:
    ours, ref = runs["in_backward"], runs["torch"]
    assert ours["params"].keys() == ref["params"].keys()
    for key, value in ref["params"].items():
        torch.testing.assert_close(ours["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    for m, r in zip(ours["micro_batches"], ref["micro_batches"], strict=True):
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-5)
        if r["sync_gradients"]:  # max_grad_norm on the host equals accelerator.clip_grad_norm_
            assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)


def test_save_state_roundtrip_and_checkpoint_format(runs: dict[str, dict[str, Any]]) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    for name, report in runs.items():
        assert report["state_roundtrip"], name  # load_state() restored model and optimizer
    ref_dir = runs["torch"]["state_dir"]
    ref_model = safetensors.load_file(ref_dir / "model.safetensors")
    ref_opt = torch.load(ref_dir / "optimizer.bin")
    for name in ("leanddp", "in_backward"):
        state_dir = runs[name]["state_dir"]
        model = safetensors.load_file(state_dir / "model.safetensors")
        assert model.keys() == ref_model.keys(), name  # no "module." prefix, as with torch
        opt = torch.load(state_dir / "optimizer.bin")
        assert opt["state"].keys() == ref_opt["state"].keys(), name
        for pid, state in ref_opt["state"].items():
            assert opt["state"][pid].keys() == state.keys(), name
        assert opt["param_groups"][0]["lr"] == ref_opt["param_groups"][0]["lr"]
    model = safetensors.load_file(runs["leanddp"]["state_dir"] / "model.safetensors")
    for key, value in ref_model.items():
        assert torch.equal(model[key], value), key
