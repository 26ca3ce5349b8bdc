"""check_for_nan_in_grad: a NaN in a reduced gradient raises on every rank, naming the
parameter, and changes no weight (or, with optimizer_in_backward on the device, exactly the
weights the error lists); training then goes on as if the bad step had not happened."""

from __future__ import annotations

import pytest
from dist_harness import run_ranks
from fault_models import nan_step


@pytest.mark.parametrize(
    "config,check,accum",
    [
        ("views", True, 1),
        ("views", True, 2),
        ("in_backward", True, 1),
        ("in_backward", "strict", 2),
        ("offload", True, 2),
    ],
)
def test_nan_raises_on_every_rank_before_any_weight_changes(
    config: str, check: bool | str, accum: int
) -> None:
    run_ranks(2, nan_step, config, check, accum)
