#!/usr/bin/env bash
# leanddp's GPU suite in one command: build for this GPU, the CUDA tests under compute-sanitizer,
# the GPU benchmarks and their report.
#
#   benchmarks/gpu/run.sh [--smoke] [all|build|tests|bench] [OUT_DIR]
#   benchmarks/gpu/run.sh --list-tests   (the tests part's pytest arguments, one per line)
#
#   all     (default) build, tests, bench
#   tests   build (when needed), then the tests; meant to fit one 10-minute device command
#   bench   build (when needed), then the benchmarks; fits one 10-minute device command
#   build   pip install for the local GPU's architecture (TORCH_CUDA_ARCH_LIST from
#           torch.cuda.get_device_capability()); skipped when leanddp imports with its CUDA
#           kernels and build/gpu-suite.stamp matches the hash of csrc/, python/, setup.py and
#           pyproject.toml, the GPU's architecture and the torch version
#   the tests part: pytest with the GPU visible, over the cases that need one (-k "cuda or gpu":
#           their CPU cases run in CI) of tests/ops/test_flatten.py tests/ops/test_optim_ops.py
#           tests/ops/test_cuda_ops.py tests/ops/test_layout_ops.py tests/ops/test_optim8_cuda.py
#           tests/offload/test_offload.py
#           tests/offload/test_host_accumulation.py tests/offload/test_forward_waits.py
#           tests/in_backward/test_in_backward_lowp.py tests/in_backward/test_lowbit_in_backward.py
#           tests/shard/test_shard_lowbit.py
#           tests/device/test_cuda_ddp_parity.py tests/device/test_cuda_ddp_async.py; then
#           compute-sanitizer memcheck, racecheck and synccheck, each over the op tests' CUDA
#           cases (-k cuda) and the in_backward cases of the test_cuda_ddp_*.py files (not
#           the no-host-synchronization ones); a run fails on
#           "ERROR SUMMARY: N errors" with N > 0, on a failing test, on no summary, on a
#           timeout. CI (tests/tools/test_gpu_suite.py) runs the same pytest arguments without
#           a GPU: each case must skip cleanly
#   the bench part: memory_timeline.py (fp32, bf16), step_time.py (GPT-2 small, bf16 and fp32),
#           benchmarks/bench_ops.py --device cuda, then report.py: OUT_DIR/report.md; both
#           benchmarks include leanddp in-backward sharded (shard_optimizer_state) at world size
#           1 (NCCL), where a rank's shard is the whole bucket: its step time against torch's DDP
#           (target <= 1.00) and its memory (target 4 + 8/N = 12); the memory saving at N > 1 is
#           python -m leanddp.bench's world-size series
#   --smoke (or LEANDDP_GPU_SMOKE=1) the bench part only, on the CPU with the tiny model and few
#           steps, without bench_ops: checks the scripts where there is no GPU (35-55 s on 2 cores)
#
# OUT_DIR: default $OUT, else benchmarks/out/gpu. Written there first: env.txt (GPUs and driver,
# torch, CUDA, NCCL, python, nvcc, compute-sanitizer, the git commit or "none" in a copy without
# .git, the source hash, cores; a missing tool is noted, never fatal), also at the top of run.log
# (everything); then logs/<step>.log (a failing step's too), steps.tsv (each step's status,
# seconds and note) and report.md, written whichever step failed: report.py's when it can (it
# shows steps.tsv), else one with env.txt, the steps and the end of each failing step's log.
# Environment: PYTHON (default python3; must have a CUDA build of torch, pytest, setuptools,
# ninja, matplotlib; nvcc and compute-sanitizer from the CUDA toolkit; no network is used),
# MAX_JOBS (default: nproc).
# Measured without a GPU (2 shared cores, load 4-5): the environment ~2 s; collecting the tests
# part's files ~6 s (1.4 s in pytest; 130 GPU cases, 116 CPU ones deselected: those took 197 s);
# --smoke bench 47 s (memory_timeline 23 s, step_time 17 s, report 5 s).
# Expected on one H100 with 16 cores (estimates, not yet measured; the step table and pytest's
# --durations record the real times):
#   build  1-3 minutes, one architecture (skipped when nothing changed: not on a fresh machine)
#   tests  pytest ~3-4 min: 28 process groups started (25 in test_cuda_ddp_parity.py and
#          test_cuda_ddp_async.py, ~5 s each for spawn, CUDA and NCCL start), ~1.5 min in their
#          bodies (the 256 MiB embedding read the moment its copy back is queued,
#          test_forward_waits.py, ~15 s of them), ~30 s
#          for the op tests' ~100 CUDA cases, plus the 8-bit cases' reference: torchao's step
#          compiled by inductor for Triton once per shape, dtype and optimizer (about a dozen
#          compiles, perhaps 1-2 min on a fresh machine); the three sanitizer runs share what is
#          left of TESTS_BUDGET_S, counted from the start with the build (each capped at
#          SANITIZER_MAX_S, at least SANITIZER_MIN_S, pytest capped so that three of those
#          fit). With a 3-minute build pytest gets 570 - 180 - 180 = 210 s: if its timeout
#          cuts it, run `tests` again on the same warm machine (the build is then skipped) or
#          split the call
#   bench  ~5-6 minutes: memory_timeline ~40 s, step_time ~2.5-3.5 min, bench_ops ~30 s,
#          restart ~1-1.5 min, report ~5 s
# Every step runs even when an earlier one failed; exit status 1 when any failed, 2 on bad usage.
set -euo pipefail
export PYTHONUNBUFFERED=1

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
HERE=$REPO/benchmarks/gpu
PYTHON=${PYTHON:-python3}
SMOKE=0
[ "${LEANDDP_GPU_SMOKE:-0}" = 1 ] && SMOKE=1
TESTS_BUDGET_S=570   # the tests part, pytest included: 9.5 minutes
SANITIZER_MAX_S=240  # one compute-sanitizer run at most
SANITIZER_MIN_S=60   # one compute-sanitizer run at least (pytest is capped so that three fit)
OPS_TESTS=(tests/ops/test_flatten.py tests/ops/test_optim_ops.py tests/ops/test_cuda_ops.py
  tests/ops/test_layout_ops.py tests/ops/test_optim8_cuda.py)
# the wrapper's GPU tests: every case in them needs a GPU (-k "cuda" selects them by file name)
DDP_TESTS=(tests/device/test_cuda_ddp_parity.py tests/device/test_cuda_ddp_async.py)
# the tests part's pytest arguments: the cases of these files that need a GPU (their CPU cases
# run in CI; tests/tools/test_gpu_suite.py runs these arguments there, where each must skip cleanly)
GPU_CASES="cuda or gpu"
PYTEST_ARGS=(-k "$GPU_CASES" "${OPS_TESTS[@]}" tests/offload/test_offload.py
  tests/offload/test_host_accumulation.py tests/offload/test_forward_waits.py
  tests/in_backward/test_in_backward_lowp.py tests/in_backward/test_lowbit_in_backward.py
  tests/shard/test_shard_lowbit.py
  "${DDP_TESTS[@]}")

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
bad_usage() {
  printf 'run.sh: %s\nusage: benchmarks/gpu/run.sh [--smoke] [all|build|tests|bench] [OUT_DIR]\n' \
    "$1" >&2
  exit 2
}

PART="" OUT_DIR=""
for arg in "$@"; do
  case $arg in
    --smoke) SMOKE=1 ;;
    --list-tests) printf '%s\n' "${PYTEST_ARGS[@]}" && exit 0 ;;
    -h | --help) usage && exit 0 ;;
    -*) bad_usage "unknown option $arg" ;;
    *)
      if [ -z "$PART" ]; then
        [[ $arg =~ ^(all|build|tests|bench)$ ]] ||
          bad_usage "unknown part '$arg' (OUT_DIR comes after the part: all $arg)"
        PART=$arg
      elif [ -z "$OUT_DIR" ]; then
        OUT_DIR=$arg
      else
        bad_usage "unexpected argument '$arg'"
      fi
      ;;
  esac
done
PART=${PART:-all}
OUT_DIR=${OUT_DIR:-${OUT:-$REPO/benchmarks/out/gpu}}
mkdir -p "$OUT_DIR/logs"
OUT_DIR=$(cd "$OUT_DIR" && pwd -P)
STEPS=$OUT_DIR/steps.tsv
FAILED=()

say() { printf '\n[gpu-suite %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

record() {  # record NAME STATUS SECONDS NOTE: one row of steps.tsv
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$STEPS"
}

step() {  # step PART NAME CMD...: runs CMD, output in logs/NAME.log too; a failure is recorded
  local name="$1: $2" log=$OUT_DIR/logs/$2.log start=$SECONDS status note=""
  shift 2
  say "$name: $*"
  rm -f "$log.note"
  set +e
  "$@" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  set -e
  [ -f "$log.note" ] && note=$(cat "$log.note")
  [ "$status" = 124 ] && note="timed out${note:+; $note}"
  if [ "$status" = 0 ]; then
    record "$name" PASS $((SECONDS - start)) "$note"
  else
    record "$name" "FAIL (exit $status)" $((SECONDS - start)) "$note"
    FAILED+=("$name")
  fi
  say "$name: $(tail -1 "$STEPS" | cut -f2) in $((SECONDS - start)) s"
}

skip() {  # skip PART NAME WHY
  say "$1: $2: skipped, $3"
  record "$1: $2" skipped 0 "$3"
}

source_hash() {  # what an installed build is made from
  (cd "$REPO" && find csrc python setup.py pyproject.toml -type f ! -name '*.so' ! -name '*.pyc' \
    ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 | LC_ALL=C sort -z |
    xargs -0 sha256sum) | sha256sum | cut -d' ' -f1
}

build_leanddp() {  # the build step (runs without errexit: every failure returns)
  local stamp=$REPO/build/gpu-suite.stamp arch want
  arch=$("$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())') ||
    return 1
  want="$(source_hash) arch $arch torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] &&
    "$PYTHON" -c 'import sys, leanddp; sys.exit(not leanddp.build_info()["cuda"])'; then
    echo "leanddp with CUDA kernels is installed from this source for sm_${arch/./}: no rebuild"
    echo "skipped: unchanged since $stamp" >"$OUT_DIR/logs/build.log.note"
    return 0
  fi
  rm -f "$stamp"
  (cd "$REPO" && TORCH_CUDA_ARCH_LIST=$arch LEANDDP_FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index .) || return 1
  "$PYTHON" -c 'import sys, leanddp; print(leanddp.build_info())
sys.exit(not leanddp.build_info()["cuda"])' || return 1
  mkdir -p "$REPO/build" && echo "$want" >"$stamp"
  echo "TORCH_CUDA_ARCH_LIST=$arch" >"$OUT_DIR/logs/build.log.note"
}

find_sanitizer() {
  local dir
  command -v compute-sanitizer && return 0
  for dir in "${CUDA_HOME:-}" /usr/local/cuda "$(dirname "$(command -v nvcc || echo .)")/.."; do
    [ -x "$dir/bin/compute-sanitizer" ] && echo "$dir/bin/compute-sanitizer" && return 0
  done
  return 1
}

probe() {  # probe LABEL CMD...: CMD's output after LABEL; a missing or failing tool is noted
  local label=$1 out status=0
  shift
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "$label: not found ($1)"
    return 0
  fi
  out=$(timeout -k 5 60 "$@" 2>&1) || status=$?
  ((status == 0)) || out="${out:+$out$'\n'}(exit status $status)"
  if [[ $out == *$'\n'* ]]; then
    echo "$label:"
    printf '%s\n' "$out" | sed 's/^/    /'
  else
    echo "$label: $out"
  fi
}

print_env() {  # the machine, the toolchain and the source: first in run.log, and in env.txt
  local nvcc sanitizer top
  nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
  sanitizer=$(find_sanitizer || echo compute-sanitizer)
  {
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    probe host uname -srm
    probe "cpu cores" nproc
    probe "cpu model" sh -c "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'"
    probe "memory" sh -c "grep -m1 MemTotal /proc/meminfo | tr -s ' '"
    probe "gpus" nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    probe python "$PYTHON" -c 'import sys; print(sys.version.split()[0], sys.executable)'
    probe torch "$PYTHON" -c '
import torch
print(torch.__version__, "cuda", torch.version.cuda, "gpus visible", torch.cuda.device_count())
try:
    v = torch.cuda.nccl.version()
    print("nccl", ".".join(map(str, v)) if isinstance(v, tuple) else v)
except Exception as e:
    print("nccl: unavailable:", e)'
    probe nvcc "$nvcc" --version
    probe compute-sanitizer "$sanitizer" --version
    top=$(git -C "$REPO" rev-parse --show-toplevel 2>/dev/null || true)
    if [ -n "$top" ] && [ "$(cd "$top" && pwd -P)" = "$REPO" ]; then
      probe "git commit" git -C "$REPO" log -1 --format='%H %cd %<(72,trunc)%s' --date=short
      echo "git: $(git -C "$REPO" status --porcelain 2>/dev/null | wc -l)" \
        "paths changed or untracked"
    else
      echo "git commit: none (no .git: a copy of the working tree)"
    fi
    echo "source hash (csrc, python, setup.py, pyproject.toml): $(source_hash || echo unknown)"
  } 2>&1 | tee "$OUT_DIR/env.txt"
}

sanitize() {  # sanitize TOOL SECONDS: one compute-sanitizer run (runs without errexit)
  local tool=$1 limit=$2 bin out status errors summaries selection file
  local pre=(env) files=("${OPS_TESTS[@]}")
  if ! bin=$(find_sanitizer); then
    echo "compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin, nvcc's dir)"
    return 1
  fi
  # (not the 4 GiB buffers past 2**31 elements: far too slow under the tools; -k matches a
  # file's name too: test_cuda_ddp, every case of DDP_TESTS, the test_cuda_ddp_*.py files)
  selection="(cuda and not test_cuda_ddp and not past_2_31)"
  for file in "${DDP_TESTS[@]}"; do
    if [ -f "$REPO/$file" ]; then files+=("$file"); fi
  done
  if [ "${#files[@]}" -gt "${#OPS_TESTS[@]}" ]; then
    # (the no-host-synchronization cases run the same kernels as the parity ones, 4 times over)
    selection="$selection or (test_cuda_ddp and in_backward and not synchronization)"
  fi
  # memcheck sees allocations, not the caching allocator's blocks: one cudaMalloc per tensor
  [ "$tool" = memcheck ] && pre+=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
  out=$OUT_DIR/logs/sanitizer-$tool.out
  echo "limit ${limit}s: $bin --tool $tool on ${files[*]} -k '$selection'"
  (cd "$REPO" && timeout -k 10 "$limit" "${pre[@]}" "$bin" --tool "$tool" --target-processes all \
    --report-api-errors no --print-limit 20 \
    "$PYTHON" -m pytest -x -q -p no:cacheprovider "${files[@]}" -k "$selection") >"$out" 2>&1
  status=$?
  cat "$out"
  # one summary per process: "ERROR SUMMARY: N errors"; racecheck's is
  # "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)"
  echo "summary lines:"
  grep -aE '(ERROR|RACECHECK) SUMMARY' "$out"
  summaries=$(grep -acE '(ERROR|RACECHECK) SUMMARY' "$out")
  errors=$(grep -aoE 'ERROR SUMMARY: [0-9]+|RACECHECK SUMMARY: .*\([0-9]+ error' "$out" |
    grep -oE '[0-9]+( error)?$' | awk '{n += $1} END {print n + 0}')
  echo "compute-sanitizer $tool: ERROR SUMMARY: $errors errors ($summaries summary lines," \
    "test exit status $status)" | tee "$OUT_DIR/logs/sanitizer-$tool.log.note"
  [ "$status" = 0 ] && [ "$summaries" -gt 0 ] && [ "$errors" = 0 ] && return 0
  [ "$status" = 0 ] && return 1
  return "$status"
}

fallback_report() {  # fallback_report WHY: report.md without report.py (none of its inputs,
  # or it failed): the environment, the steps, the end of each failing step's log
  local name log
  {
    printf '# leanddp GPU suite\n\nNo benchmark report: %s.\n\n## Environment\n\n```text\n' "$1"
    cat "$OUT_DIR/env.txt" 2>/dev/null
    printf '```\n\n## Suite steps (`benchmarks/gpu/run.sh`)\n\n'
    printf '| step | status | seconds | note |\n|---|---|---:|---|\n'
    [ -f "$STEPS" ] && awk -F'\t' '{printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4}' "$STEPS"
    for name in "${FAILED[@]}"; do
      log=logs/${name#*: }.log
      printf '\n## %s: the end of %s\n\n```text\n' "$name" "$log"
      tail -n 40 "$OUT_DIR/$log" 2>/dev/null
      printf '```\n'
    done
  } >"$OUT_DIR/report.md" || true
  echo "wrote $OUT_DIR/report.md ($1)"
}

ensure_report() {  # report.md holds this run's steps, whichever step failed
  if [ "$PART" = tests ] || [ "$PART" = build ]; then
    # the benchmarks of an earlier run into this directory, if any, with this run's steps
    rm -f "$OUT_DIR/report.md"
    "$PYTHON" "$HERE/report.py" "$OUT_DIR" >/dev/null 2>&1 || true
    [ -f "$OUT_DIR/report.md" ] || fallback_report "part $PART runs no benchmark"
  elif [ ! -f "$OUT_DIR/report.md" ]; then
    fallback_report "report.py wrote none (see logs/report.log)"
  fi
}

part_build() {
  if [ "$SMOKE" = 1 ]; then
    skip build build "smoke run: the installed leanddp is used"
  else
    step build build build_leanddp
  fi
}

part_tests() {
  if [ "$SMOKE" = 1 ]; then
    skip tests pytest "smoke run: no GPU"
    return 0
  fi
  local start=$PART_START tool left runs=3 limit
  # pytest gets what the build left and the three sanitizer runs do not need at least
  step tests pytest timeout -k 10 $((TESTS_BUDGET_S - (SECONDS - start) - 3 * SANITIZER_MIN_S)) \
    "$PYTHON" -m pytest -q -rs --durations=15 -p no:cacheprovider "${PYTEST_ARGS[@]}"
  for tool in memcheck racecheck synccheck; do
    left=$((TESTS_BUDGET_S - (SECONDS - start)))
    limit=$((left / runs))
    ((limit > SANITIZER_MAX_S)) && limit=$SANITIZER_MAX_S
    ((limit < SANITIZER_MIN_S)) && limit=$SANITIZER_MIN_S
    runs=$((runs - 1))
    step tests "sanitizer-$tool" sanitize "$tool" "$limit"
  done
}

part_bench() {
  # GPU: memory_timeline ~40 s (fp32 and bf16, batch 1 x seq 128, the plain model and 5
  # configurations each); step_time ~2.5-3.5 min (GPT-2 small, batch 8 x seq 1024; 2 dtypes x 2
  # accumulations x 6 configurations x (2 warm-up + 7 rounds x 3) steps; offload_to_cpu's steps
  # are bound by the host AdamW); bench_ops ~30 s. The limits only stop a run that hangs (the
  # first three add up to 10 minutes: the bench part fits one device command when nothing is
  # built and nothing hangs).
  # restart ~1-1.5 min (examples/torchrun_gpt.py killed mid-run under torchrun --max-restarts 1,
  # NCCL, one rank: the restart resumes bit for bit; restart.py).
  local memory=(--dtypes fp32,bf16) steps=(--model gpt2 --dtype bf16,fp32) limits=(150 330 120 150)
  local restart=(--modes plain,offload)
  rm -f "$OUT_DIR"/{memory_timeline,step_time,bench_ops,restart}.json "$OUT_DIR"/*.png \
    "$OUT_DIR/report.md"
  if [ "$SMOKE" = 1 ]; then
    memory=(--smoke) steps=(--smoke) limits=(120 120 0 150) restart=(--smoke --modes plain)
  fi
  step bench memory_timeline timeout -k 10 "${limits[0]}" \
    "$PYTHON" "$HERE/memory_timeline.py" "${memory[@]}" --out "$OUT_DIR"
  step bench step_time timeout -k 10 "${limits[1]}" \
    "$PYTHON" "$HERE/step_time.py" "${steps[@]}" --out "$OUT_DIR"
  if [ "$SMOKE" = 1 ]; then
    skip bench bench_ops "smoke run: CUDA only"
  else
    step bench bench_ops timeout -k 10 "${limits[2]}" \
      "$PYTHON" "$REPO/benchmarks/bench_ops.py" --device cuda --out "$OUT_DIR"
  fi
  step bench restart timeout -k 10 "${limits[3]}" \
    "$PYTHON" "$HERE/restart.py" "${restart[@]}" --out "$OUT_DIR"
  step bench report "$PYTHON" "$HERE/report.py" "$OUT_DIR"
}

main() {
  cd "$REPO"
  say "part $PART$([ "$SMOKE" = 1 ] && echo ' (smoke: CPU, tiny model)'), output in $OUT_DIR"
  say "environment (also in env.txt)"
  print_env
  if [ "$SMOKE" = 0 ] &&
    ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "no GPU is visible to $PYTHON's torch: use --smoke (LEANDDP_GPU_SMOKE=1) for the CPU check"
    exit 1
  fi
  # this invocation's rows replace those of the same parts from an earlier one
  touch "$STEPS"
  if [ "$PART" = all ]; then : >"$STEPS"; else
    grep -v "^$PART: " "$STEPS" >"$STEPS.tmp" || true
    mv "$STEPS.tmp" "$STEPS"
  fi
  PART_START=$SECONDS  # the tests part's budget counts its build too
  case $PART in
    all)
      part_build
      PART_START=$SECONDS
      part_tests
      part_bench
      ;;
    build) part_build ;;
    *)
      part_build
      "part_$PART"
      ;;
  esac
  ensure_report
  say "done in $SECONDS s; steps:"
  column -t -s $'\t' "$STEPS" 2>/dev/null || cat "$STEPS"
  if ((${#FAILED[@]})); then
    say "FAILED: ${FAILED[*]}"
    exit 1
  fi
}

main 2>&1 | tee -a "$OUT_DIR/run.log"
exit "${PIPESTATUS[0]}"
