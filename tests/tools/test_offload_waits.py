"""benchmarks/offload_waits.py: a short run reports every offload configuration's waits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "offload_waits.py"


def test_a_short_run_reports_each_configuration() -> None:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*launch, str(SCRIPT), "--steps", "3", "--warmup", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| leanddp")]
    assert [(r.split("|")[1].strip(), r.split("|")[2].strip()) for r in rows] == [
        ("leanddp + offload_to_cpu", "1"),
        ("leanddp + offload_to_cpu", "4"),
        ("leanddp offload sharded", "1"),
        ("leanddp offload sharded", "4"),
    ]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[2].count("waited") == 2, row  # the two warmup iterations, one by one
        assert int(cells[3]) == 3, row
        assert float(cells[8]) > 0, row  # the worker stepped every iteration
        for share in (cells[9], cells[10]):
            assert 0 <= float(share.rstrip("%")) <= 100, row
    sharded = [r for r in rows if "sharded" in r]
    # offload sharded gathers every bucket at the end of backward: nothing pending at a forward
    assert all(float(r.split("|")[5]) == 0 for r in sharded), sharded
