"""examples/torchrun_gpt.py, the loop a user copies, run briefly under torchrun on CPU (2 gloo
ranks): leanddp ends where torch's DDP does; ``--plan`` prints the planner's table first. (Its
checkpoints, killed runs and restarts: tests/reliability/test_restart.py.)"""

from __future__ import annotations

import pytest
from torchrun_example import example, final

pytestmark = pytest.mark.slow


def test_leanddp_ends_where_torch_ddp_does() -> None:
    out = example("--steps", "4", "--plan")
    assert "| leanddp offload sharded |" in out and "Activations are not included" in out
    ours, theirs = final(out), final(example("--steps", "4", "--torch-ddp"))
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5)
    assert ours[1] == pytest.approx(theirs[1], rel=1e-6)
