"""leanddp under torchrun, the launcher users run it with: two ranks on this machine."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_parity.py"


def test_torchrun_two_ranks() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(SCRIPT),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PARITY OK" in result.stdout
