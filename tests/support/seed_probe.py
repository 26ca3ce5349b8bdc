"""Run only by tests/test_parallel_run.py, in a pytest of its own with pytest-xdist workers:
each case writes, to a file of the folder LEANDDP_TEST_SEED_PROBE names, the run's seed and the
torch seed its test drew, as the worker that ran it saw them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

PROBE = "LEANDDP_TEST_SEED_PROBE"
CASES = 4


@pytest.mark.parametrize("case", range(CASES))
def test_write_the_seeds(case: int, run_seed: int, worker_id: str) -> None:
    seeds = {"run": run_seed, "test": torch.initial_seed(), "worker": worker_id}
    Path(os.environ[PROBE], f"{case}.json").write_text(json.dumps(seeds))
