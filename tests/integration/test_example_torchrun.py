"""examples/torchrun_gpt.py, the loop a user copies, run briefly under torchrun on CPU (2 gloo
ranks): a resumed run ends exactly where a run that never stopped does, in every mode; leanddp
ends where torch's DDP does; ``--plan`` prints the planner's table first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_gpt.py"
FINAL = re.compile(r"final loss (\S+)  parameter checksum (\S+)")


def example(*args: str) -> str:
    """Runs the example on 2 CPU ranks; its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLE), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def final(out: str) -> tuple[float, float]:
    loss, checksum = FINAL.search(out).groups()
    return float(loss), float(checksum)


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--in-backward", "--accum", "2"],
        ["--offload", "--shard", "--accum", "2", "--clip", "1"],
    ],
    ids=["leanddp", "in-backward-accum", "offload-sharded-accum-clip"],
)
def test_resume_continues_exactly(tmp_path: Path, flags: list[str]) -> None:
    straight = example("--steps", "6", "--plan", *flags)
    assert "| leanddp offload sharded |" in straight and "Activations are not included" in straight
    ckpt = str(tmp_path / "ckpt.pt")
    example("--steps", "3", "--checkpoint", ckpt, *flags)
    resumed = example("--steps", "6", "--checkpoint", ckpt, "--resume", *flags)
    assert "resumed from" in resumed and "at step 3" in resumed
    assert final(resumed) == final(straight)


def test_leanddp_ends_where_torch_ddp_does() -> None:
    ours, theirs = final(example("--steps", "4")), final(example("--steps", "4", "--torch-ddp"))
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5)
    assert ours[1] == pytest.approx(theirs[1], rel=1e-6)
