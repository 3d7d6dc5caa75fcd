#!/usr/bin/env bash
# One command for a maintainer with a GPU: build the extension in place, run the whole test
# suite, then the benchmarks.
#
#   bash scripts/gpu_check.sh [results_dir]
#
# The benchmarks write their results to results_dir if given, else where benchmarks/common.py
# puts them (benchmarks/results/<gpu>/). The logs of the build, the tests and each benchmark
# go to $LOG_DIR (default: ${TMPDIR:-/tmp}/mti-gpu-check), outside the repository.
#
# Environment: QUICK=1 passes --quick to the benchmarks that take it; SKIP_BENCH=1 stops after
# the tests; PYTEST_WORKERS (default 12) sets the pytest-xdist workers where it is installed;
# TORCH_CUDA_ARCH_LIST (default: this GPU's own arch, the fastest build) and MAX_JOBS
# (default 16) go to the build.
# Exits non-zero if the build, any test or any benchmark failed, or if a GPU is present but a
# CUDA test was skipped or the build has no CUDA kernels.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOGS="${LOG_DIR:-${TMPDIR:-/tmp}/mti-gpu-check}"
mkdir -p "$LOGS"
LOGS="$(cd "$LOGS" && pwd)"
if [[ $# -ge 1 ]]; then
  mkdir -p "$1"
  MTI_RESULTS_DIR="$(cd "$1" && pwd)"
  export MTI_RESULTS_DIR # benchmarks/common.py writes its results here
fi
QUICK="${QUICK:-0}"
SKIP_BENCH="${SKIP_BENCH:-0}"
echo "logs: $LOGS"

cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS="${MAX_JOBS:-16}"

SUMMARY=()
FAILED=0
note() { SUMMARY+=("$(printf '%-22s %s' "$1" "$2")"); }
fail() { note "$1" "FAILED: $2"; FAILED=1; }

# Runs "$@" with its output both on the terminal and in $LOGS/<name>.log; returns its status.
logged() {
  local name="$1"
  shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$LOGS/$name.log"
}

HAS_GPU="$(python -c 'import torch; print(int(torch.cuda.is_available()))')"
if [[ "$HAS_GPU" == 1 ]]; then
  GPU_ARCH="$(python -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
  # sm_90 builds as sm_90a, which has the warpgroup MMA kernels (see setup.py).
  [[ "$GPU_ARCH" == 9.0 ]] && GPU_ARCH=9.0a
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$GPU_ARCH}"
  python -c 'import torch; print(f"GPU: {torch.cuda.get_device_name()}, " +
    f"torch {torch.__version__}, CUDA {torch.version.cuda}")'
else
  echo "No GPU: building and testing the CPU backend only"
fi

# ---------------------------------------------------------------- build
if ! logged build python setup.py build_ext --inplace; then
  echo "build failed; log: $LOGS/build.log"
  exit 1
fi
note build "ok (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-cpu only}, MAX_JOBS=$MAX_JOBS)"

if [[ "$HAS_GPU" == 1 ]]; then
  # A build without nvcc (no CUDA_HOME) silently yields CPU kernels only.
  if python -c '
import sys, torch, make_torch_inplace
ops = ["square_matmul_", "softmax_", "layer_norm_", "rms_norm_"]
has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
missing = [op for op in ops if not has_kernel(f"make_torch_inplace::{op}", "CUDA")]
print("ops without a CUDA kernel:", missing or "none")
sys.exit(1 if missing else 0)'; then
    note "cuda kernels" "all ops registered for CUDA"
  else
    fail "cuda kernels" "some ops have no CUDA kernel (was nvcc / CUDA_HOME found?)"
  fi
fi

# ---------------------------------------------------------------- tests
# -v names every test and its outcome; -rs lists every skip with its reason. With
# pytest-xdist installed the tests run in parallel.
PYTEST_ARGS=(tests -v -rs)
if python -c 'import xdist' 2>/dev/null; then
  PYTEST_ARGS+=(-n "${PYTEST_WORKERS:-12}")
fi
PYTEST_STATUS=0
# New hypothesis examples on every GPU check (CI draws the same ones each run).
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-explore}"
logged pytest python -m pytest "${PYTEST_ARGS[@]}" || PYTEST_STATUS=$?
COUNTS="$(grep -E '^=+ .*[0-9]+ (passed|failed|skipped|error)' "$LOGS/pytest.log" |
  tail -1 | tr -d '=' | xargs || true)"
if [[ "$PYTEST_STATUS" == 0 ]]; then
  note pytest "${COUNTS:-no summary line}"
else
  fail pytest "exit $PYTEST_STATUS: ${COUNTS:-no summary line}"
fi
if [[ "$HAS_GPU" == 1 ]]; then
  # A skipped CUDA test on a GPU machine means the GPU path went untested (tests that need
  # a second GPU are expected to skip on a one-GPU machine).
  # The -rs summary lines ("SKIPPED [n] file:line: reason") name the reason; the -v lines
  # do not, so only the summary is counted.
  CUDA_SKIPS="$(grep -E '^SKIPPED \[' "$LOGS/pytest.log" | grep -iE 'cuda|gpu' |
    grep -vic 'two' || true)"
  if [[ "$CUDA_SKIPS" == 0 ]]; then
    note "cuda skips" "none"
  else
    fail "cuda skips" "$CUDA_SKIPS CUDA/GPU skip lines in $LOGS/pytest.log"
    grep -E '^SKIPPED \[' "$LOGS/pytest.log" | grep -iE 'cuda|gpu' | grep -vi 'two' | head -20
  fi
fi

# ---------------------------------------------------------------- benchmarks
QUICK_ARGS=()
[[ "$QUICK" == 1 ]] && QUICK_ARGS=(--quick)

bench() { # bench <script> [quick|save]: quick passes --quick when QUICK=1
  local script="benchmarks/$1.py"
  if [[ ! -f "$script" ]]; then
    note "$1" "not present, skipped"
    return 0
  fi
  local args=()
  [[ "${2:-}" == quick ]] && args=("${QUICK_ARGS[@]}")
  [[ "${2:-}" == save ]] && args=(--save)
  if logged "$1" python "$script" "${args[@]}"; then
    note "$1" "ok"
  else
    fail "$1" "see $LOGS/$1.log"
  fi
}

if [[ "$SKIP_BENCH" == 1 ]]; then
  note benchmarks "skipped (SKIP_BENCH=1)"
else
  bench memory_demo save
  bench bench_rowwise quick
  bench bench_square_matmul quick
  bench bench_cross_entropy quick
  bench bench_rope quick
  bench bench_silu_mul
  bench bench_e2e quick
  bench bench_train quick
  # FSDP2 over NCCL needs two GPUs; its results go to benchmarks/results/<gpu>x2/.
  GPU_COUNT="$(python -c 'import torch; print(torch.cuda.device_count())')"
  if [[ "$GPU_COUNT" -ge 2 ]]; then
    bench bench_distributed quick
  else
    note bench_distributed "skipped (needs 2 GPUs, $GPU_COUNT here)"
  fi
fi

# ---------------------------------------------------------------- summary
echo
echo "================ gpu_check summary ================"
printf '%s\n' "${SUMMARY[@]}"
if [[ "$SKIP_BENCH" != 1 ]]; then
  echo "results: $(python -c 'from benchmarks.common import results_dir; print(results_dir())')"
fi
echo "logs: $LOGS"
if [[ "$FAILED" == 1 ]]; then
  echo "RESULT: FAILED"
  exit 1
fi
echo "RESULT: ok"
