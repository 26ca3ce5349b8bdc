"""leanddp under torchrun, the launcher users run it with: two ranks on one node, and two
"nodes" (two torchrun agents, one process each) meeting through a c10d rendezvous on 127.0.0.1,
the way a multi-node job starts."""

import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import _free_port

SCRIPT = Path(__file__).parents[1] / "scripts" / "torchrun_parity.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def test_torchrun_two_ranks() -> None:
    result = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PARITY OK" in result.stdout


@pytest.mark.slow
def test_torchrun_two_nodes_c10d_rendezvous() -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [
                *TORCHRUN,
                "--nnodes=2",
                "--nproc_per_node=1",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={endpoint}",
                "--rdzv_id=leanddp-test",
                "--max_restarts=0",
                str(SCRIPT),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for node in nodes:
            out, err = node.communicate(timeout=240)
            outputs.append(out + err)
            assert node.returncode == 0, (out + err)[-3000:]
    finally:
        for node in nodes:
            node.kill()
    text = "\n".join(outputs)
    assert "PARITY OK" in text  # bitwise equal to torch's DDP at every step, across the nodes
    # one process on each node: global ranks 0 and 1 on nodes 0 and 1, in some pairing
    lines = sorted(ln for ln in text.splitlines() if ln.startswith("rank "))
    assert len(lines) == 2, text[-3000:]
    assert {ln.split()[-1] for ln in lines} == {"0", "1"}, lines
    assert [ln.split()[1] for ln in lines] == ["0", "1"], lines
