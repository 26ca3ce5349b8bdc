"""leanddp under PyTorch Lightning: examples/lightning_leanddp.py run as a script (Lightning's
DDP launcher starts the second rank by running the script again), 2 CPU ranks on gloo,
gradient accumulation 2, 2 epochs of 4 optimizer steps, AdamW with a step LR schedule. The
final parameters are compared with Lightning's stock ``strategy="ddp"`` on the same data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import leanddp

pytest.importorskip("lightning", reason="lightning is not installed (pip install lightning)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_leanddp.py"
MARKER = re.compile(
    r"rank (\d): wrapped by ([\w.]+?DistributedDataParallel), optimizer_in_backward=(True|False)"
)
STEPS = 8  # 2 epochs x (8 micro-batches per rank / accumulation 2)
FINAL_LR = 1e-2 * 0.5 ** (STEPS // 3)  # StepLR(step_size=3, gamma=0.5) stepped every step

Run = Callable[..., tuple[dict[str, Any], str]]


def _clean_env() -> dict[str, str]:
    """The environment for the example: this process's leanddp first on the path, and no
    launcher variables that would make Lightning believe the processes were started for it."""
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"}
    drop |= {"MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    path = [str(Path(leanddp.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return env


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Runs the example with the given arguments; returns what rank 0 saved (when ``out`` is
    given) and the output of both ranks."""
    workdir = tmp_path_factory.mktemp("lightning")

    def _run(*args: str, out: str | None = None) -> tuple[dict[str, Any], str]:
        command = [sys.executable, str(EXAMPLE), *args]
        if out is not None:
            command += ["--out", str(workdir / out)]
        result = subprocess.run(
            command, cwd=workdir, env=_clean_env(), capture_output=True, text=True, timeout=170
        )
        text = result.stdout + result.stderr
        assert result.returncode == 0, text[-4000:]
        saved = torch.load(workdir / out, weights_only=True) if out is not None else {}
        return saved, text

    return _run


@pytest.fixture(scope="module")
def stock_ddp(run: Run) -> dict[str, Any]:
    """Lightning's own DDPStrategy (torch's DistributedDataParallel): the reference."""
    saved, text = run("--strategy", "ddp", out="ddp.pt")
    wrappers = {m[1] for m in MARKER.findall(text)}
    assert wrappers == {"torch.nn.parallel.distributed.DistributedDataParallel"}, text[-4000:]
    assert saved["global_step"] == STEPS
    assert saved["lr"] == pytest.approx(FINAL_LR)
    return saved


def _wrapped_by_leanddp(text: str, in_backward: bool) -> None:
    markers = sorted(MARKER.findall(text))
    expected = [(str(r), "leanddp.ddp.DistributedDataParallel", str(in_backward)) for r in (0, 1)]
    assert markers == expected, text[-4000:]


def _assert_close(result: dict[str, Any], reference: dict[str, Any]) -> None:
    """Same step count and LR as the reference, and parameters within 1e-5 (relative)."""
    assert result["global_step"] == reference["global_step"] == STEPS
    assert result["lr"] == pytest.approx(reference["lr"])
    state, ref = result["state_dict"], reference["state_dict"]
    assert state.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(state[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_strategy_is_bitwise_equal_to_stock_ddp(run: Run, stock_ddp: dict[str, Any]) -> None:
    """LeanDDPStrategy with gradient accumulation: every rank's model is wrapped by leanddp,
    and the final parameters are bitwise those of Lightning's DDP (2 ranks)."""
    saved, text = run("--strategy", "leanddp", out="leanddp.pt")
    _wrapped_by_leanddp(text, in_backward=False)
    _assert_close(saved, stock_ddp)
    for name, value in stock_ddp["state_dict"].items():
        assert torch.equal(saved["state_dict"][name], value), name


def test_optimizer_in_backward(run: Run, stock_ddp: dict[str, Any]) -> None:
    """optimizer_in_backward=True: leanddp steps configure_optimizers' AdamW inside backward,
    Lightning's step and LR schedule still count; parameters match stock DDP within 1e-5."""
    saved, text = run("--optimizer-in-backward", out="in_backward.pt")
    _wrapped_by_leanddp(text, in_backward=True)
    _assert_close(saved, stock_ddp)


def test_offload_checkpoint_resume(run: Run, stock_ddp: dict[str, Any]) -> None:
    """optimizer_in_backward with offload_to_cpu, saved by Lightning after the first epoch and
    resumed for the second: the optimizer state (host side) and the LR schedule come back, so
    the result matches an uninterrupted stock DDP run."""
    checkpoint = "offload_epoch1.ckpt"
    flags = ("--optimizer-in-backward", "--offload-to-cpu")
    _, text = run(*flags, "--epochs", "1", "--save-checkpoint", checkpoint)
    _wrapped_by_leanddp(text, in_backward=True)
    saved, text = run(*flags, "--epochs", "2", "--resume", checkpoint, out="resumed.pt")
    _wrapped_by_leanddp(text, in_backward=True)
    _assert_close(saved, stock_ddp)
