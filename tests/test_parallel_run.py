"""The README's test command runs the suite in two pytest-xdist workers (``-n 2``): every worker
draws from the seed the report's header names, so ``LEANDDP_TEST_SEED=<seed>`` replays a failed
run whichever worker ran the test (tests/conftest.py passes the seed on in the environment)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from seed_probe import CASES, PROBE

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parent.parent
PROBE_FILE = Path(__file__).resolve().parent / "support" / "seed_probe.py"


def test_every_worker_draws_from_the_seed_the_header_names(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    env = dict(os.environ, **{PROBE: str(tmp_path)})
    env.pop("LEANDDP_TEST_SEED", None)  # a fresh seed, drawn by the run
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "load", "-p", "no:cacheprovider",
         str(PROBE_FILE.relative_to(ROOT))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    header = re.search(r"LEANDDP_TEST_SEED=(\d+)", done.stdout)
    assert header, done.stdout[-3000:]
    seed = int(header.group(1))
    found = {int(f.stem): json.loads(f.read_text()) for f in tmp_path.glob("*.json")}
    assert sorted(found) == list(range(CASES)), found
    assert {x["worker"] for x in found.values()} == {"gw0", "gw1"}, found  # both workers ran
    for case, x in found.items():
        node = f"{PROBE_FILE.relative_to(ROOT)}::test_write_the_seeds[{case}]"
        assert x["run"] == seed, (case, x, seed)
        assert x["test"] == (seed + zlib.crc32(node.encode())) % 2**31, (case, x)
