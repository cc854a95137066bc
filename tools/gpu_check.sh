#!/usr/bin/env bash
# The GPU check: one command for a single-GPU machine without network access.
#
#   bash tools/gpu_check.sh [OUT_DIR] [STEP ...]
#
# Builds jax_ep against what is installed (pip --no-build-isolation), checks the kernels'
# registers, runs the whole test suite and the GPU tests, compute-sanitizer (memcheck and
# racecheck) on small cases, a smoke test of 2 and 4 processes through real NVSHMEM on the one
# GPU, and the benchmarks (EP1 and 8 virtual ranks), then writes one report (markdown + JSON)
# under docs/gpu/ (or $JAX_EP_GPU_REPORT_DIR) and OUT_DIR. A failing step is recorded and the next one runs; the exit
# status is non-zero when any step failed. Name STEPs to run only those (the report covers the
# steps run): env build ptxas tests gpu_tests memcheck racecheck smoke2 smoke4 bench_ep1
# bench_virtual. See docs/gpu/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_check_out}}
shift || true
mkdir -p "$OUT_DIR"
STEPS=("$@")
STATUS_FILE="$OUT_DIR/steps.tsv"
: > "$STATUS_FILE"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
unset JAX_PLATFORMS XLA_FLAGS

wanted() {
  [ ${#STEPS[@]} -eq 0 ] && return 0
  local s
  for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
}

# step NAME COMMAND...: runs COMMAND with its output in OUT_DIR/NAME.log; records the status.
step() {
  local name=$1
  shift
  wanted "$name" || return 0
  echo "== $name: $*"
  local start=$SECONDS
  "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$STATUS_FILE"
  echo "   $name: exit $rc in $((SECONDS - start)) s"
  tail -n 3 "$OUT_DIR/$name.log" | sed 's/^/   | /'
}

environment() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -n 2
  python -c "import sys, jax, jaxlib; print(sys.version.split()[0], jax.__version__, jaxlib.__version__); print(jax.devices())"
  echo "commit $(git rev-parse HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) files changed"
  command -v compute-sanitizer
}

sanitize() {
  compute-sanitizer --tool "$1" --target-processes all --error-exitcode 1 \
    python tools/gpu_sanitize_case.py
}

step env environment
step build pip install --no-build-isolation -v .
step ptxas python tools/check_ptxas.py
step tests pytest -q tests --ignore=tests/gpu -p no:cacheprovider
step gpu_tests pytest -q tests/gpu -m gpu -p no:cacheprovider --junitxml="$OUT_DIR/gpu_tests.xml"
step memcheck sanitize memcheck
step racecheck sanitize racecheck
step smoke2 python tools/gpu_multiprocess_smoke.py --processes 2
step smoke4 python tools/gpu_multiprocess_smoke.py --processes 4
step bench_ep1 python -m jax_ep.bench --fp8 --json "$OUT_DIR/bench_ep1.json"
step bench_virtual python -m jax_ep.bench --virtual --ranks 8 --fp8 --json "$OUT_DIR/bench_virtual.json"

python tools/gpu_report.py "$OUT_DIR" "${JAX_EP_GPU_REPORT_DIR:-docs/gpu}"
! cut -f2 "$STATUS_FILE" | grep -qv '^0$'
