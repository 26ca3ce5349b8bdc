"""Shared test setup: fresh random data every run (seed in the report header, and after a
failure at the end, replayable with LEANDDP_TEST_SEED=<seed>), the `device` parameter: cpu,
and cuda unless no GPU is visible, and every folder of tests/ on sys.path (see below)."""

from __future__ import annotations

import collections
import os
import random
import sys
import zlib
from pathlib import Path

import pytest

# Before torch is imported, here and in every process the tests start (they inherit it): inductor
# compiles in the process that asks, not in a pool of worker interpreters that each import torch
# again. The tests compile small graphs (torchao's 8-bit step, a compiled submodule) in many
# short-lived ranks, where starting that pool cost more than it saved.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

import leanddp  # noqa: E402 (fails loudly here, with how to fix it, if the extension is not built)

TESTS = Path(__file__).resolve().parent
#: folders of tests/ whose modules are not imported by name
NOT_ON_PATH = {"scripts", "__pycache__"}


def module_folders() -> list[Path]:
    """tests/ and its folders of test modules and shared helpers (support/), sorted."""
    folders = [p for p in TESTS.iterdir() if p.is_dir() and p.name not in NOT_ON_PATH]
    return [TESTS, *sorted(p for p in folders if not p.name.startswith("."))]


def duplicate_module_names(folders: list[Path]) -> dict[str, list[Path]]:
    """Module names that more than one of `folders` holds, with the files."""
    files = collections.defaultdict(list)
    for folder in folders:
        for path in sorted(folder.glob("*.py")):
            files[path.stem].append(path)
    return {name: paths for name, paths in files.items() if len(paths) > 1}


# Every folder first on sys.path, as one flat folder would be: a module imports a helper of
# support/ by its plain name wherever it lives (never another test module: test_conventions.py),
# and so do the rank processes the tests spawn, which start with this sys.path and unpickle
# their functions by module name. pytest imports test files the same way (its default "prepend"
# mode, no __init__.py), so module names must be unique across the folders: checked below.
for _folder in reversed(module_folders()):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def pytest_configure(config):
    duplicates = duplicate_module_names(module_folders())
    if duplicates:
        raise pytest.UsageError(f"module names must be unique under tests/: {duplicates}")


BASE_SEED = int(os.environ.get("LEANDDP_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
# In the environment, so that pytest-xdist's workers (the README's `-n 2`), which start after this
# module loaded in the process that prints the header, draw from the seed the header names.
os.environ["LEANDDP_TEST_SEED"] = str(BASE_SEED)

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


@pytest.fixture
def run_seed() -> int:
    """The run's seed (LEANDDP_TEST_SEED), the same for every test of a run, inside a test (a
    choice made at collection, such as which half of a matrix a run takes, reads it through
    support/rotation.py)."""
    return BASE_SEED


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)
