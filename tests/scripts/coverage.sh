#!/usr/bin/env bash
# Builds leanddp's C++ extension with gcov coverage (LEANDDP_COVERAGE=1, see setup.py), runs the
# CPU test suite on it and lists, per csrc/ file, every function, line range and branch that the
# tests never executed (tests/scripts/coverage_report.py). docs/gpu-only-code.md is that list,
# classified: what only a GPU runs, what the CPU suite misses, error paths.
#
#   tests/scripts/coverage.sh                                   # the default selection (below)
#   tests/scripts/coverage.sh tests/offload/test_offload.py -x  # arguments replace it (pytest's)
#   PYTHON=/path/to/venv/bin/python MAX_JOBS=2 tests/scripts/coverage.sh
#   tests/scripts/coverage.sh --report-only                     # the last run's counts again
#
# The checkout is left alone: the script snapshots it (tracked files and untracked, not ignored
# ones) into $LEANDDP_COVERAGE_DIR/src (default /tmp/leanddp-coverage-$USER/src), builds the
# instrumented leanddp._C there in place, and runs that snapshot's tests with PYTHONPATH pointing
# at it, so python/leanddp/_C*.so of the checkout is neither rebuilt nor imported and no virtual
# environment is touched. Object files (and gcov's .gcno notes) are kept in
# $LEANDDP_COVERAGE_DIR/build-temp: a second run only recompiles what changed. The counts
# (.gcda) of the previous run are deleted before the tests start. The snapshot takes the
# working tree as it is, with anyone's unsaved-to-git edits.
#
# The list goes to stdout and to $LEANDDP_COVERAGE_DIR/report.md (or $LEANDDP_COVERAGE_OUT);
# everything else (build, pytest's output) to stderr.
# The exit status is pytest's: a failing test still leaves its counts, and the list is written
# either way.
#
# Environment:
#   PYTHON                Python with torch and pytest installed. Default: python3.
#   MAX_JOBS              Parallel compile jobs. Default: the number of cores.
#   CXX                   C++ compiler (GCC: the counts are gcov's), as torch's build uses it.
#                         Default: c++.
#   GCOV                  gcov of that GCC. Default: gcov-<major> if present, else gcov.
#   LEANDDP_COVERAGE_DIR  Work directory (snapshot, objects and counts, report).
#   LEANDDP_COVERAGE_OUT  Where to write the list. Default: $LEANDDP_COVERAGE_DIR/report.md.
#
# How the counts are collected:
# - Every process that loads the instrumented extension adds its counts to the .gcda files when
#   it exits normally (libgcov merges them under a file lock, so ranks exiting together are
#   safe): pytest itself, torch.multiprocessing ranks, torchrun workers, `python -c`
#   subprocesses. PYTHONPATH is exported, so they all import the snapshot's build.
# - A process that leaves by os._exit (the fault tests' ranks do, tests/support/fault_harness.py)
#   skips that: a sitecustomize.py put first on PYTHONPATH wraps os._exit to call the extension's
#   __gcov_dump first (setup.py keeps that symbol in coverage builds). A process killed by a
#   signal loses its counts: the tests kill only ranks that hang or whose peer failed.
# - CUDA_VISIBLE_DEVICES is emptied: the build is CPU-only, so the tests' `cuda` cases are
#   skipped; what they would run is what the list calls GPU-only.
set -euo pipefail

say() { printf '\n[coverage] %s\n' "$*" >&2; }
die() {
  printf '\n[coverage] ERROR: %s\n' "$*" >&2
  exit 1
}

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
PYTHON=${PYTHON:-python3}
CXX_BIN=${CXX:-c++}
WORK=${LEANDDP_COVERAGE_DIR:-${TMPDIR:-/tmp}/leanddp-coverage-$(id -un)}
SRC=$WORK/src
BUILD_TEMP=$WORK/build-temp
PLUGIN_DIR=$WORK/pytest-plugin
OUT=${LEANDDP_COVERAGE_OUT:-$WORK/report.md}
START=$SECONDS

# The default selection: every test file except the slow ones that add no C++ coverage (they
# run configurations the other files run already, at length or through other launchers).
DEFAULT_TESTS=(
  tests
  --ignore=tests/tools/test_bench.py                  # the benchmark CLI: timing, the same loop
  --ignore=tests/integration/test_torch_ddp_suite.py  # torch's own DDP tests: minutes, same paths
  --ignore=tests/integration/test_lightning.py        # integrations: the same wrapper under
  --ignore=tests/integration/test_accelerate.py       #   Lightning, Accelerate
  --ignore=tests/reliability/test_long_run.py         # many steps of what parity tests run
  --ignore=tests/ddp/test_properties.py               # randomized models over the same code paths
)

report_only=0
if [[ ${1:-} == --report-only ]]; then
  report_only=1
  shift
fi

# ---------------------------------------------------------------------------------------------
say "checking the toolchain"
command -v "$PYTHON" >/dev/null || die "PYTHON=$PYTHON not found"
PYTHON=$(command -v "$PYTHON")
command -v "$CXX_BIN" >/dev/null || die "C++ compiler CXX=$CXX_BIN not found"
command -v git >/dev/null || die "git not found (needed to list the files to snapshot)"
"$CXX_BIN" --version | head -n1 | grep -qiE 'gcc|g\+\+' ||
  "$CXX_BIN" -v 2>&1 | grep -q '^gcc version' || die "CXX=$CXX_BIN is not GCC (the counts are gcov's)"
major=$("$CXX_BIN" -dumpversion | cut -d. -f1)
if [[ -z ${GCOV:-} ]]; then
  GCOV=gcov
  if command -v "gcov-$major" >/dev/null; then GCOV=gcov-$major; fi
fi
command -v "$GCOV" >/dev/null || die "GCOV=$GCOV not found"
gcov_major=$("$GCOV" --version | head -n1 | grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' | tail -n1 | cut -d. -f1)
[[ $gcov_major == "$major" ]] || die "$GCOV is version $gcov_major, $CXX_BIN is GCC $major: set GCOV"
"$PYTHON" -c 'import torch, pytest' || die "$PYTHON lacks torch or pytest"
{
  echo "python:   $PYTHON ($("$PYTHON" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))"
  echo "compiler: $CXX_BIN ($("$CXX_BIN" --version | head -n1)), $GCOV"
  echo "work dir: $WORK"
} >&2

mkdir -p "$WORK"
exec 9>"$WORK/lock"
flock -n 9 || die "another coverage.sh run holds $WORK/lock"

commit=$(cd "$REPO" && git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [[ -n $(cd "$REPO" && git status --porcelain --untracked-files=no 2>/dev/null) ]]; then
  commit="$commit + uncommitted edits"
fi

report() {
  local tests=$1 pytest_note=$2 when=$3
  say "listing what never ran: $OUT"
  "$PYTHON" "$REPO/tests/scripts/coverage_report.py" --build-temp "$BUILD_TEMP" --src "$SRC" \
    --gcov "$GCOV" --output "$OUT" \
    --note "tree: $commit (snapshot $SRC); GCC $("$CXX_BIN" -dumpversion), CPU-only build, -O0" \
    --note "tests: pytest $tests ($pytest_note)" \
    --note "made by tests/scripts/coverage.sh; tests run $when"
}

if ((report_only)); then
  [[ -f $WORK/tests-run.txt ]] || die "no earlier run in $WORK"
  commit="$(sed -n 1p "$WORK/tests-run.txt")"
  report "$(sed -n 2p "$WORK/tests-run.txt")" "$(sed -n 3p "$WORK/tests-run.txt")" \
    "$(sed -n 4p "$WORK/tests-run.txt")"
  exit 0
fi

# ---------------------------------------------------------------------------------------------
say "snapshotting $REPO into $SRC"
rm -rf "$SRC"
mkdir -p "$SRC"
# tracked + untracked-but-not-ignored files that exist; cp -p keeps mtimes, so ninja recompiles
# only the sources that changed since the last run.
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard) |
  (cd "$REPO" && while IFS= read -r -d '' f; do if [[ -f $f ]]; then printf '%s\0' "$f"; fi; done) |
  (cd "$REPO" && xargs -0 -r cp -p --parents -t "$SRC")
[[ -f $SRC/setup.py && -d $SRC/tests ]] || die "snapshot incomplete: $SRC"

# ---------------------------------------------------------------------------------------------
say "building the instrumented extension (LEANDDP_COVERAGE=1, MAX_JOBS=${MAX_JOBS:-$(nproc)}), log in $WORK/build.log"
build_start=$SECONDS
if ! (
  cd "$SRC"
  LEANDDP_COVERAGE=1 LEANDDP_SANITIZE=0 LEANDDP_CPU_ONLY=0 LEANDDP_FORCE_CUDA=0 FORCE_CUDA=0 \
    MAX_JOBS=${MAX_JOBS:-$(nproc)} CXX=$CXX_BIN \
    "$PYTHON" setup.py build_ext --inplace --build-temp "$BUILD_TEMP"
) >"$WORK/build.log" 2>&1; then
  grep -E -B2 -A6 'error|Error' "$WORK/build.log" | tail -n 60 >&2 || tail -n 60 "$WORK/build.log" >&2
  die "coverage build failed (full log: $WORK/build.log)"
fi
shopt -s nullglob
sos=("$SRC"/python/leanddp/_C*.so)
shopt -u nullglob
((${#sos[@]} == 1)) || die "expected one $SRC/python/leanddp/_C*.so, found ${#sos[@]}"
SO=${sos[0]}
echo "built $SO in $((SECONDS - build_start)) s" >&2
nm -D --defined-only "$SO" | grep -qw __gcov_dump || die "$SO exports no __gcov_dump: not a coverage build"
# objects of files that left the tree would add stale entries
find "$BUILD_TEMP" -name '*.gcno' | while read -r gcno; do
  rel=${gcno#"$BUILD_TEMP"/}
  [[ -f $SRC/${rel%.gcno}.cpp ]] || rm -f "$gcno" "${gcno%.gcno}.o"
done
find "$BUILD_TEMP" -name '*.gcda' -delete

# ---------------------------------------------------------------------------------------------
rm -rf "$PLUGIN_DIR"
mkdir -p "$PLUGIN_DIR"
export PYTHONPATH="$PLUGIN_DIR:$SRC/python${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_VISIBLE_DEVICES=""
export LEANDDP_COVERAGE_EXPECT_SO="$SO"
export PYTHONFAULTHANDLER=1
echo "PYTHONPATH=$PYTHONPATH" >&2

[[ -z $(cd / && "$PYTHON" -c 'import importlib.util as u; print(u.find_spec("sitecustomize") or "")') ]] ||
  die "$PYTHON already has a sitecustomize module, which this script's would shadow"
cat >"$PLUGIN_DIR/sitecustomize.py" <<'EOF'
# Written by tests/scripts/coverage.sh: a process that leaves by os._exit writes its gcov counts
# first (normal exits write them from libgcov's destructor).
import os
import sys

_os_exit = os._exit


def _exit_after_gcov_dump(status):
    module = sys.modules.get("leanddp._C")
    if module is not None:
        try:
            import ctypes

            lib = ctypes.CDLL(module.__file__, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            lib.__gcov_dump()
        except (OSError, AttributeError):
            pass
    _os_exit(status)


os._exit = _exit_after_gcov_dump
EOF

# A pytest plugin (outside the tree: tests/ is not edited) that refuses to run unless the
# session imports the instrumented extension, and shows it in the header.
cat >"$PLUGIN_DIR/leanddp_coverage_check.py" <<'EOF'
import os

import pytest


def _check() -> str:
    import leanddp._C

    got = os.path.realpath(leanddp._C.__file__)
    want = os.path.realpath(os.environ["LEANDDP_COVERAGE_EXPECT_SO"])
    if got != want:
        raise pytest.UsageError(f"leanddp._C is {got}, not the coverage build {want}")
    return got


def pytest_sessionstart(session):
    session.config._leanddp_coverage_so = _check()


def pytest_report_header(config):
    so = getattr(config, "_leanddp_coverage_so", None) or _check()
    return f"leanddp coverage: leanddp._C.__file__={so} (gcov counts on exit)"
EOF

say "self-test: os._exit writes the counts"
"$PYTHON" -c 'import os, leanddp; leanddp.build_info(); os._exit(0)' >&2
[[ -n $(find "$BUILD_TEMP" -name 'bindings.gcda') ]] || die "a process that left by os._exit wrote no counts"
find "$BUILD_TEMP" -name '*.gcda' -delete
"$PYTHON" -c '
import os, leanddp, leanddp._C
assert os.path.realpath(leanddp._C.__file__) == os.path.realpath(os.environ["LEANDDP_COVERAGE_EXPECT_SO"])
assert not leanddp.build_info()["cuda"]
print("ok: leanddp._C.__file__ =", leanddp._C.__file__)
' >&2 || die "the snapshot's instrumented leanddp._C is not what Python imports"
find "$BUILD_TEMP" -name '*.gcda' -delete

# ---------------------------------------------------------------------------------------------
# Extra arguments: paths into the checkout ($REPO/tests/x.py, or relative to the current
# directory) are mapped onto the snapshot; pytest runs from the snapshot's root.
args=()
for a in "$@"; do
  path=${a%%::*}
  rest=${a#"$path"}
  if [[ $a != -* && -e $path ]]; then
    abs=$(realpath "$path")
    if [[ $abs == "$REPO" || $abs == "$REPO"/* ]]; then
      rel=${abs#"$REPO"}
      rel=${rel#/}
      a="${rel:-.}$rest"
    fi
  fi
  args+=("$a")
done
((${#args[@]})) || args=("${DEFAULT_TESTS[@]}")

say "running pytest on the instrumented build: pytest ${args[*]}"
test_start=$SECONDS
set +e
(cd "$SRC" && "$PYTHON" -m pytest -p leanddp_coverage_check -p no:cacheprovider "${args[@]}") >&2
pytest_rc=$?
set -e
test_s=$((SECONDS - test_start))
echo "pytest exit status $pytest_rc after $test_s s" >&2

when=$(date -u '+%Y-%m-%d %H:%M UTC')
printf '%s\n' "$commit" "${args[*]}" "exit status $pytest_rc, $test_s s" "$when" >"$WORK/tests-run.txt"
report "${args[*]}" "exit status $pytest_rc, $test_s s" "$when"
say "done in $((SECONDS - START)) s; the list: $OUT"
exit "$pytest_rc"
