"""Run torch's own DistributedDataParallel tests, from the installed wheel, against either class.

``torch/testing/_internal/distributed/distributed_test.py`` ships with torch. This script runs
its DDP tests on gloo (CPU) in two ranks, with ``torch.nn.parallel.DistributedDataParallel``
either left alone (``--impl torch``, the baseline) or replaced by
``leanddp.DistributedDataParallel`` (``--impl leanddp``) before that module is imported, under
every name the tests reach it by: ``torch.nn.parallel.DistributedDataParallel`` (also as
``nn.parallel.DistributedDataParallel``), ``torch.nn.parallel.distributed.DistributedDataParallel``
and the module-level ``DistributedDataParallel`` that distributed_test.py imports. It writes one
JSON record per test: its outcome (passed, failed, skipped), the traceback of a failure, and
the classes of every DDP object the ranks constructed, so the caller can check that the swap
really happened (tests/integration/test_torch_ddp_suite.py does).

Which tests count as DDP tests (chosen from the file itself, so each torch version gets its own
list): every test of ``DistributedTest._DistTestBase`` whose name contains ``ddp`` or
``DistributedDataParallel`` (case-insensitive), plus every other test whose body, or a private
helper it calls (followed transitively), constructs ``DistributedDataParallel(...)`` or
``DDP(...)`` (no_sync accumulation, unused outputs, static graph, post-localSGD,
model-verification tests). Tests that only exercise collectives never see the class and are
left out. Many of the selected tests need GPUs or NCCL and skip on CPU; they count as skipped in
both runs.

The ranks are forked from this process rather than spawned, as torch's own runner does: each
test then costs milliseconds of process start instead of a fresh interpreter importing torch
twice (about 4 s), which is what makes the suite affordable in CI.

Usage: ``python tests/scripts/torch_ddp_suite.py --impl torch|leanddp --out results.json
[--tests name ...]`` (default: the selection above). ``--list`` prints the selection.
"""

from __future__ import annotations

import os
import sys

# Before anything imports distributed_test.py: it binds DistributedDataParallel at import time.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")


def _parse_args(argv: list[str] | None = None):
    import argparse

    parser = argparse.ArgumentParser(description="torch's DDP tests against either class")
    parser.add_argument("--impl", choices=["torch", "leanddp"], required=True)
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--tests", nargs="*", help="test names (default: the DDP tests)")
    parser.add_argument(
        "--stdin", action="store_true", help="read the test names from stdin, once imported"
    )
    parser.add_argument("--jobs", type=int, default=4, help="tests run at the same time")
    parser.add_argument("--list", action="store_true", help="print the selection and exit")
    return parser.parse_args(argv)


# A forked rank re-imports nothing; a spawned one (torch's default) re-runs this module as
# __mp_main__ with the parent's command line, so the swap happens there too.
_IMPL = _parse_args().impl

import inspect  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import unittest  # noqa: E402

import torch  # noqa: E402
import torch.nn.parallel  # noqa: E402
import torch.nn.parallel.distributed  # noqa: E402

import leanddp  # noqa: E402

TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel
LEAN_DDP = leanddp.DistributedDataParallel

if _IMPL == "leanddp":
    torch.nn.parallel.DistributedDataParallel = LEAN_DDP
    torch.nn.parallel.distributed.DistributedDataParallel = LEAN_DDP

# Every DDP object a rank constructs is recorded (class name, one line per object) in
# $LEANDDP_TORCH_SUITE_DIR/<test>.<pid> (the variable carries the folder to spawned ranks);
# torch's and leanddp's __init__ are both wrapped because leanddp's does not call torch's.
_WORK_DIR = os.environ.setdefault(
    "LEANDDP_TORCH_SUITE_DIR", tempfile.mkdtemp(prefix="torch_ddp_suite.")
)
_RECORD_DIR = os.path.join(_WORK_DIR, "constructed")
os.makedirs(_RECORD_DIR, exist_ok=True)
_CURRENT_TEST = {"name": "unknown"}


def _record_constructions(cls: type) -> None:
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        if not getattr(self, "_torch_suite_recorded", False):
            object.__setattr__(self, "_torch_suite_recorded", True)
            kind = type(self)
            name = f"{kind.__module__}.{kind.__qualname__}"
            path = os.path.join(_RECORD_DIR, f"{_CURRENT_TEST['name']}.{os.getpid()}")
            with open(path, "a") as f:
                f.write(name + "\n")
        original(self, *args, **kwargs)

    cls.__init__ = __init__


_record_constructions(TORCH_DDP)
_record_constructions(LEAN_DDP)

from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

_EXPECTED = LEAN_DDP if _IMPL == "leanddp" else TORCH_DDP
for _where, _cls in [
    ("torch.nn.parallel.DistributedDataParallel", torch.nn.parallel.DistributedDataParallel),
    (
        "torch.nn.parallel.distributed.DistributedDataParallel",
        torch.nn.parallel.distributed.DistributedDataParallel,
    ),
    ("distributed_test.DistributedDataParallel", distributed_test.DistributedDataParallel),
    (
        "distributed_test.nn.parallel.DistributedDataParallel",
        distributed_test.nn.parallel.DistributedDataParallel,
    ),
]:
    if _cls is not _EXPECTED:
        raise SystemExit(
            f"torch_ddp_suite: {_where} is {_cls}, expected {_EXPECTED} (--impl {_IMPL})"
        )


class TorchDDPTests(TestDistBackend, DistributedTest._DistTestBase):
    """torch's distributed tests, each run in WORLD_SIZE forked gloo ranks."""

    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        _CURRENT_TEST["name"] = test_name
        super()._run(rank, test_name, file_name, pipe, **kwargs)


_DDP_NAME = re.compile(r"ddp|distributeddataparallel", re.IGNORECASE)
_CONSTRUCTS = re.compile(r"\b(DistributedDataParallel|DDP)\(")
_HELPER_CALL = re.compile(r"self\.(_\w+)\(")


def _source(name: str) -> str:
    try:
        return inspect.getsource(inspect.unwrap(getattr(DistributedTest._DistTestBase, name)))
    except (AttributeError, OSError, TypeError):
        return ""


def _constructs_ddp(name: str, seen: set[str]) -> bool:
    if name in seen:
        return False
    seen.add(name)
    body = _source(name)
    return bool(_CONSTRUCTS.search(body)) or any(
        _constructs_ddp(helper, seen) for helper in _HELPER_CALL.findall(body)
    )


def select_tests() -> list[str]:
    """The DDP tests of this torch version's distributed_test.py (see the module docstring)."""
    names = sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test_"))
    return [n for n in names if _DDP_NAME.search(n) or _constructs_ddp(n, set())]


class _Recorder(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict] = {}

    def _set(self, test, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        self.outcomes[name] = {"outcome": outcome, "detail": detail}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._set(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._set(test, "failed", "".join(traceback.format_exception(*err)))

    def addError(self, test, err):
        super().addError(test, err)
        self._set(test, "failed", "".join(traceback.format_exception(*err)))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._set(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._set(test, "skipped", "expected failure")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._set(test, "passed")


def _constructed(test: str) -> list[str]:
    classes: set[str] = set()
    for entry in os.listdir(_RECORD_DIR):
        if entry.startswith(test + "."):
            with open(os.path.join(_RECORD_DIR, entry)) as f:
                classes.update(line.strip() for line in f if line.strip())
    return sorted(classes)


def _run_shard(names: list[str], out: str) -> None:
    """Runs `names` one after another in this process; writes their outcomes to `out`."""
    # distributed_test's barrier files, one folder per shard
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(dir=_WORK_DIR)
    suite = unittest.TestSuite(TorchDDPTests(n) for n in names)
    with open(os.devnull, "w") as quiet:
        result = unittest.TextTestRunner(resultclass=_Recorder, stream=quiet).run(suite)
    with open(out, "w") as f:
        json.dump(result.outcomes, f)


def run(names: list[str], jobs: int) -> dict[str, dict]:
    """Runs the tests in `jobs` shards forked from this process, at the same time.

    Most of a test's time is spent polling (rank barriers, the parent joining its ranks), so
    shards overlap well even on two cores. A shard that dies leaves its tests "missing".
    """
    outcomes: dict[str, dict] = {}
    shards = [names[i::jobs] for i in range(jobs) if names[i::jobs]]
    tmp = tempfile.mkdtemp(dir=_WORK_DIR)
    children = []
    for index, shard in enumerate(shards):
        out = os.path.join(tmp, f"shard{index}.json")
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _run_shard(shard, out)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        children.append((pid, out))
    for pid, out in children:
        os.waitpid(pid, 0)
        if os.path.exists(out):
            with open(out) as f:
                outcomes.update(json.load(f))
    return {
        n: {
            **outcomes.get(n, {"outcome": "missing", "detail": "its shard died"}),
            "constructed": _constructed(n),
        }
        for n in names
    }


def main() -> None:
    args = _parse_args()
    if args.stdin:
        names = sys.stdin.read().split()
    else:
        names = select_tests() if args.tests is None else args.tests
    if args.list:
        print("\n".join(names))
        return
    start = time.monotonic()
    try:
        tests = run(names, args.jobs) if names else {}
    finally:
        shutil.rmtree(_WORK_DIR, ignore_errors=True)
    seconds = time.monotonic() - start
    for name, record in tests.items():
        print(f"{args.impl}: {name}: {record['outcome']}", file=sys.stderr)
    report = {"impl": args.impl, "torch": torch.__version__, "seconds": seconds, "tests": tests}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
