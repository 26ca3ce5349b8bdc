"""Shared test setup: fresh random data every run (seed in the report header, and after a
failure at the end, replayable with LEANDDP_TEST_SEED=<seed>), and the `device` parameter: cpu,
and cuda unless no GPU is visible."""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

import leanddp  # fails loudly here, with how to fix it, if the extension is not built

BASE_SEED = int(os.environ.get("LEANDDP_TEST_SEED", int.from_bytes(os.urandom(4), "little")))

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no GPU visible")),
]


def pytest_report_header(config):
    return f"leanddp: LEANDDP_TEST_SEED={BASE_SEED} build_info={leanddp.build_info()}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The seed again at the end, where a log cut to its tail still shows it."""
    if exitstatus != 0:
        terminalreporter.write_line(f"replay with LEANDDP_TEST_SEED={BASE_SEED}")


@pytest.fixture(autouse=True)
def _seed(request):
    """Each test draws from its own seed, derived from the run's seed and the test's id."""
    seed = (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**31
    torch.manual_seed(seed)
    random.seed(seed)


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)
