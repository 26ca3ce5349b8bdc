"""Which half of a long matrix this run takes: the `slow` tests that launch a job per case
(torchrun, a killed rank, an exit) run half their cases per run, the halves swapped by the run's
seed (LEANDDP_TEST_SEED, in the report's header), so that two runs whose seeds differ in parity
cover every case, and a run's choice replays with its seed.

The seed is read at import, in the collecting process: conftest.py sets it in the environment
before any test module loads, in the header's process and in pytest-xdist's workers alike, so
every worker collects the same half."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

#: the run's seed (conftest.py's BASE_SEED)
SEED = int(os.environ["LEANDDP_TEST_SEED"])


def this_runs_half(items: Sequence[T]) -> list[T]:
    """Every other item of ``items``, from the first in runs of even seed and from the second
    in runs of odd seed (the larger half of an odd count goes to even seeds)."""
    return list(items[SEED % 2 :: 2])


def alternate(j: int, options: Sequence[T]) -> T:
    """The option the ``j``-th chosen case takes this run: consecutive cases take different
    options, and each case's option moves on every other run (by ``SEED // 2``), so over four
    seeds every case meets every option of two."""
    return options[(j + SEED // 2) % len(options)]
