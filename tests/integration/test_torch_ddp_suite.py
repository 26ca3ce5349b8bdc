"""torch's own DistributedDataParallel tests, from the installed wheel, with leanddp's class.

tests/scripts/torch_ddp_suite.py runs the DDP tests of torch's distributed_test.py on gloo in
two ranks, once with torch's class (the baseline) and once with leanddp's swapped in. Every test
that passes with torch's class must pass with leanddp's, unless docs/ddp.md lists it, with the
reason, between its ``torch-ddp-tests`` markers. The runner failing in itself (nothing selected,
nothing passing with torch's class, a test that fails with torch's class, a shard that died, a
test that built torch's class where leanddp's should have been swapped in) fails here too.

To save CI time, leanddp's run imports torch while the baseline runs, and then runs only the
tests that passed in the baseline (one that skips there skips here as well).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch_suite

SUITE = Path(__file__).parents[1] / "scripts" / "torch_ddp_suite.py"
DOC = Path(__file__).parents[2] / "docs" / "ddp.md"
BEGIN, END = "<!-- torch-ddp-tests:begin -->", "<!-- torch-ddp-tests:end -->"
TORCH_CLASS = "torch.nn.parallel.distributed.DistributedDataParallel"
LEANDDP_CLASS = "leanddp.ddp.DistributedDataParallel"
# torch 2.13's distributed_test.py has 12 DDP tests that run on CPU with gloo; fewer passing
# means the runner, not leanddp, is broken.
MIN_PASSING = 8
MIN_SELECTED = 50  # of 103 DDP tests in torch 2.13's file
TIMEOUT_S = 600


def documented_differences(text: str) -> dict[str, str]:
    """The table between the markers of docs/ddp.md: test name -> the difference behind it."""
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"docs/ddp.md needs {BEGIN} ... {END}"
    table = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.strip() or set(cells[0]) <= set("-: ") or cells[0] == "test":
            continue
        match = re.fullmatch(r"`(test_\w+)`", cells[0])
        assert match and len(cells) == 2 and cells[1], f"docs/ddp.md: malformed row {line!r}"
        rows[match.group(1)] = cells[1]
    return rows


def _cause(detail: str) -> str:
    """The lines of a failure that say what went wrong: each exception's own message."""
    lines = [
        ln
        for ln in detail.splitlines()
        if re.match(r"^\w[\w.]*(Error|Exception): ", ln)
        and not re.match(r"^RuntimeError: Process \d+ exited with error code", ln)
    ]
    return " | ".join(dict.fromkeys(lines))[:800] or detail[-800:]


def _run(impl: str, out: Path, *extra: str, stdin=None) -> subprocess.Popen:
    command = [sys.executable, str(SUITE), "--impl", impl, "--out", str(out), *extra]
    return subprocess.Popen(
        command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_torch_ddp_tests_pass_with_leanddp(tmp_path: Path) -> None:
    assert importlib.util.find_spec("expecttest"), (
        "torch's distributed tests need expecttest: pip install expecttest"
    )
    differences = documented_differences(DOC.read_text())
    base_json, lean_json = tmp_path / "torch.json", tmp_path / "leanddp.json"
    lean = _run("leanddp", lean_json, "--stdin", stdin=subprocess.PIPE)
    try:
        base = _run("torch", base_json)
        base_log, _ = base.communicate(timeout=TIMEOUT_S)
        assert base.returncode == 0, f"the baseline run failed:\n{base_log[-5000:]}"
        baseline = json.loads(base_json.read_text())["tests"]
        passed = sorted(n for n, r in baseline.items() if r["outcome"] == "passed")
        broken = {n: r for n, r in baseline.items() if r["outcome"] not in ("passed", "skipped")}
        assert not broken, "tests that fail with torch's own class (the runner is broken):\n" + (
            "\n".join(f"{n}: {r['outcome']}: {_cause(r['detail'])}" for n, r in broken.items())
        )
        assert len(baseline) >= MIN_SELECTED, f"only {len(baseline)} DDP tests selected"
        assert len(passed) >= MIN_PASSING, f"only {passed} passed with torch's class:\n{base_log}"
        for name in passed:
            assert set(baseline[name]["constructed"]) <= {TORCH_CLASS}, (name, baseline[name])
        lean_log, _ = lean.communicate("\n".join(passed), timeout=TIMEOUT_S)
        assert lean.returncode == 0, f"leanddp's run failed:\n{lean_log[-5000:]}"
    finally:
        lean.kill()
    ours = json.loads(lean_json.read_text())["tests"]
    assert sorted(ours) == passed, (sorted(ours), passed)
    # The swap happened: where torch's run built torch's class, ours built leanddp's, and only it.
    assert any(ours[n]["constructed"] for n in passed), "no test constructed a DDP"
    for name in passed:
        built = set(ours[name]["constructed"])
        assert built <= {LEANDDP_CLASS}, f"{name} built {built}: the class was not swapped"
        assert bool(built) == bool(baseline[name]["constructed"]), (name, built)

    failing = {n: ours[n] for n in passed if ours[n]["outcome"] != "passed"}
    undocumented = {n: r for n, r in failing.items() if n not in differences}
    assert not sorted(undocumented), (
        "pass with torch's DistributedDataParallel, fail with leanddp's and are not listed in "
        "docs/ddp.md:\n"
        + "\n".join(f"{n}: {r['outcome']}: {_cause(r['detail'])}" for n, r in undocumented.items())
    )
    stale = sorted(n for n in differences if n in ours and ours[n]["outcome"] == "passed")
    assert not stale, f"listed in docs/ddp.md but pass with leanddp now: {stale}"


def test_documented_differences_table() -> None:
    """The doc's table parses; rows name one test in backticks and give a reason."""
    assert isinstance(documented_differences(DOC.read_text()), dict)
    header = "| test | difference |\n|---|---|\n"
    text = f"x\n{BEGIN}\n{header}| `test_a` | why a |\n| `test_b` | why b |\n{END}\n"
    assert documented_differences(text) == {"test_a": "why a", "test_b": "why b"}
    for row in ["| test_a | no backticks |", "| `test_a` |  |", "| `test_a` | a | b |"]:
        with pytest.raises(AssertionError, match="malformed row"):
            documented_differences(f"{BEGIN}\n{header}{row}\n{END}")
    with pytest.raises(AssertionError, match="needs"):
        documented_differences(header)
