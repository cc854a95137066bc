#!/usr/bin/env bash
# The GPU check: one command for a single-GPU machine without network access.
#
#   bash tools/gpu_check.sh [--dry-run] [OUT_DIR] [STEP ...]
#   bash tools/gpu_check.sh --list        (the steps that run by default, in order)
#
# Builds and installs jax_ep against what is installed (no build isolation, no dependency
# resolution), then runs every check on the installed package from a directory outside the
# source tree, in this order: first what changed since the last report (the streamed smokes,
# the low-latency decode loop under XLA's command buffers), then the rest of the correctness
# checks (2 and 4 processes through real NVSHMEM in phases, with stores, with puts,
# node-aware, two EP groups; the GPUs of one process; the kernel cases; the xla backend's
# ragged transport; the kernels' resources; the large case: DeepEP's shapes, GPU against the
# CPU handlers, per-kernel profile), then compute-sanitizer (memcheck, synccheck, initcheck,
# racecheck on jax_ep's kernels), then performance: processes on the GPU under CUDA MPS
# (`mps`, and `tune`, the sweep of the streamed ops' settings against the phased ops;
# skipped, and say so, where MPS cannot run), the rate of the row copy alone (`copyrate`)
# and the benchmarks (which fail unless their cuda rows ran).
# Writes one report (markdown + JSON) under docs/gpu/ (or $JAX_EP_GPU_REPORT_DIR) and OUT_DIR,
# rewritten after every step, so a run stopped at a time limit still leaves one. A failing step
# is recorded and the next one runs; the exit status is non-zero when any step failed.
#
# Every step but `tests` (the CPU suite, which needs a run of its own) runs by default, each
# bounded ($JAX_EP_STEP_TIMEOUT_S, default 300 s), with the waits between ranks bounded by
# $JAX_EP_START_TIMEOUT_S / $JAX_EP_TIMEOUT_S (default 60 s / 30 s here), a hung smoke
# failed after 80 s and the sweep's points after $JAX_EP_TUNE_BUDGET_S (default 150 s). Name
# STEPs to run only those: env build installed smoke2_streamed smoke4_streamed_put
# smoke4_streamed_nodes graph graph2 smoke2_phased smoke4_nodes_phased smoke_local kernels
# ragged smoke2 smoke4 smoke2_put smoke4_put smoke4_nodes smoke4_groups ptxas large memcheck
# synccheck initcheck racecheck mps tune copyrate bench_ep1 bench_virtual tests. --dry-run runs no
# step: it checks that each one's command exists (CI runs it) and writes the report of that.
# See docs/gpu/README.md.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
if [ "${1:-}" = "--list" ]; then
  sed -n 's/^step \([A-Za-z0-9_]*\) .*/\1/p' "$0" | grep -vx tests
  exit 0
fi
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY_RUN=1
  shift
fi
OUT_DIR=${1:-${OUT:-gpu_check_out}}
shift || true
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
STEPS=("$@")
STATUS_FILE="$OUT_DIR/steps.tsv"
: > "$STATUS_FILE"
# Python steps run here, so that `import jax_ep` finds the installed package, never the tree.
RUN_DIR=$(mktemp -d)
REPORT_DIR=${JAX_EP_GPU_REPORT_DIR:-docs/gpu}
[ "$DRY_RUN" = 1 ] && REPORT_DIR=${JAX_EP_GPU_REPORT_DIR:-$OUT_DIR}
STEP_TIMEOUT_S=${JAX_EP_STEP_TIMEOUT_S:-300}
SMOKE_TIMEOUT_S=80
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_EP_START_TIMEOUT_S=${JAX_EP_START_TIMEOUT_S:-60} JAX_EP_TIMEOUT_S=${JAX_EP_TIMEOUT_S:-30}
unset JAX_PLATFORMS XLA_FLAGS PYTHONPATH

# Every step but `tests` when none is named.
wanted() {
  [ ${#STEPS[@]} -eq 0 ] && { [ "$1" != tests ]; return; }
  local s
  for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
}

# Whether COMMAND... could run: its first word a function of this script or a program on
# PATH, and every file of the tree it names (in its arguments, or in the function) present.
runnable() {
  declare -F "$1" > /dev/null || command -v "$1" > /dev/null || { echo "missing: $1"; return 1; }
  local path
  for path in "$@" $(declare -f "$1" | grep -o '\$ROOT/[A-Za-z0-9_./-]*' | sed "s|\\\$ROOT|$ROOT|"); do
    case "$path" in
      "$ROOT"/tools/* | "$ROOT"/tests*) [ -e "$path" ] || { echo "missing: $path"; return 1; } ;;
    esac
  done
  echo "would run: $*"
}

# step NAME COMMAND...: runs COMMAND in RUN_DIR, bounded by STEP_TIMEOUT_S, with its output in
# OUT_DIR/NAME.log; records the status and rewrites the report.
step() {
  local name=$1
  shift
  wanted "$name" || return 0
  echo "== $name: $*"
  local start=$SECONDS rc
  if [ "$DRY_RUN" = 1 ]; then
    runnable "$@" > "$OUT_DIR/$name.log" 2>&1
    rc=$?
  else
    # In a child shell (the functions below are exported to it), so that timeout bounds it.
    (cd "$RUN_DIR" && timeout --kill-after=10 "$STEP_TIMEOUT_S" bash -c '"$@"' "$name" "$@") \
      > "$OUT_DIR/$name.log" 2>&1
    rc=$?
    [ "$rc" = 124 ] && echo "step $name: stopped after $STEP_TIMEOUT_S s" >> "$OUT_DIR/$name.log"
  fi
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$STATUS_FILE"
  echo "   $name: exit $rc in $((SECONDS - start)) s"
  tail -n 4 "$OUT_DIR/$name.log" | sed 's/^/   | /'
  python3 "$ROOT/tools/gpu_report.py" "$OUT_DIR" "$REPORT_DIR" > /dev/null 2>&1
}

environment() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -n 2
  python3 -c "import sys, jax, jaxlib; print(sys.version.split()[0], jax.__version__, jaxlib.__version__); print(jax.devices())"
  python3 -m pip show nvidia-nvshmem-cu13 nanobind scikit-build-core 2>/dev/null | grep -E '^(Name|Version)'
  echo "commit $(git -C "$ROOT" rev-parse HEAD 2>/dev/null) $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) files changed"
  command -v compute-sanitizer ncu
}

# The build uses what is installed: no isolated environment (nothing to download) and no
# dependency resolution (nothing to download either; the dependencies are there already).
build() {
  python3 -m pip install --no-build-isolation --no-deps --force-reinstall -v "$ROOT"
}

# The package every later step imports: installed (not the tree), with the CUDA kernels, and a
# GPU that JAX sees.
installed() {
  python3 "$ROOT/tools/gpu_kernels.py" --check-install
}

# Only jax_ep's kernels are instrumented; the case script must also print its "ok" line, so a
# run that checked nothing cannot pass.
sanitize() {
  compute-sanitizer --tool "$1" --target-processes all --error-exitcode 1 \
    --kernel-name kns=jax_ep ${JAX_EP_SANITIZER_FLAGS:-} python3 "$ROOT/tools/gpu_sanitize_case.py" &&
    echo "sanitizer $1: clean"
}

bench() {
  python3 -m jax_ep.tools.bench --fp8 --backends cuda xla --require cuda "$@"
}

# CUDA MPS for the `mps` and `tune` steps: a control daemon of this run's own (its pipe and
# log directories in MPS_DIR), started by the first of them, stopped after `tune` and at exit
# whatever happened. Without MPS, processes on one GPU time-slice it, and their timings would
# mean nothing: where MPS cannot run, MPS_DIR/none says why and both steps pass, saying
# "skipped: no MPS (why)".
MPS_DIR=$RUN_DIR/mps

# Starts the daemon once (a later call finds it) and exports its directories; fails where it
# cannot start, or a CUDA client does not get through it (tools/gpu_tune.py --check-mps).
mps_up() {
  export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
  [ -e "$MPS_DIR/none" ] && return 1
  [ -e "$MPS_DIR/started" ] && return 0
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  # The daemon's output goes into a file: one that kept a pipe of ours open would hang $(...).
  local why
  if ! command -v nvidia-cuda-mps-control > /dev/null; then
    why="nvidia-cuda-mps-control is not on PATH"
  elif ! nvidia-cuda-mps-control -d > "$MPS_DIR/start.log" 2>&1; then
    why="nvidia-cuda-mps-control -d: $(tail -n 1 "$MPS_DIR/start.log")"
  else
    touch "$MPS_DIR/started"
    why=$(python3 "$ROOT/tools/gpu_tune.py" --check-mps 2>&1) && { echo "$why"; return 0; }
    why=$(echo "$why" | tail -n 1)
    mps_stop
  fi
  echo "$why" > "$MPS_DIR/none"
  return 1
}

mps_stop() {
  [ -e "$MPS_DIR/started" ] || return 0
  echo quit | CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe nvidia-cuda-mps-control > /dev/null 2>&1
  rm -f "$MPS_DIR/started"
}

# The rig: the daemon, a client through it, then 4 processes through real NVSHMEM at once,
# each on a quarter of the SMs (NVSHMEM's full multi-process mode), streamed by default.
mps_rig() {
  mps_up || { echo "mps: skipped: no MPS ($(cat "$MPS_DIR/none"))"; return 0; }
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 python3 "$ROOT/tools/gpu_multiprocess_smoke.py" \
    --timeout 80 --processes 4
}

# The sweep, its budget within the step's bound (room for the last point and the exits).
tune() {
  mps_up || { echo "tune: skipped: no MPS ($(cat "$MPS_DIR/none"))"; return 0; }
  local budget=${JAX_EP_TUNE_BUDGET_S:-150}
  [ "$budget" -gt $((STEP_TIMEOUT_S - 40)) ] 2> /dev/null && budget=$((STEP_TIMEOUT_S - 40))
  python3 "$ROOT/tools/gpu_tune.py" --mps-checked --budget-s "$budget" \
    --json "$OUT_DIR/tune.json"
}

export -f environment build installed sanitize bench mps_up mps_stop mps_rig tune
export ROOT OUT_DIR RUN_DIR MPS_DIR STEP_TIMEOUT_S
trap mps_stop EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
SMOKE=("$ROOT/tools/gpu_multiprocess_smoke.py" --timeout "$SMOKE_TIMEOUT_S")

step env environment
step build build
step installed installed
# First what changed since the last report: the rank-major dispatch and combine streamed
# through rings of 2 slots (cuda/channels.h), so that every ring wraps, over stores, over puts
# and in 2 simulated nodes of 2; then the decode loop under command buffers.
step smoke2_streamed python3 "${SMOKE[@]}" --processes 2 --channels 2,1,2
step smoke4_streamed_put python3 "${SMOKE[@]}" --processes 4 --peer-access put --channels 2,1,2
step smoke4_streamed_nodes python3 "${SMOKE[@]}" --processes 4 --peer-access put \
  --ranks-per-node 2 --channels 2,1,2
step graph python3 "$ROOT/tools/gpu_graph_case.py" --json "$OUT_DIR/graph.json"
step graph2 python3 "$ROOT/tools/gpu_graph_case.py" --processes 2 --steps 8
# The rest of the correctness checks.
step smoke2_phased python3 "${SMOKE[@]}" --processes 2 --channels off
step smoke4_nodes_phased python3 "${SMOKE[@]}" --processes 4 --peer-access put \
  --ranks-per-node 2 --channels off
step smoke_local python3 "${SMOKE[@]}" --local
step kernels python3 "$ROOT/tools/gpu_kernels.py" --json "$OUT_DIR/kernels.json"
step ragged python3 "$ROOT/tools/gpu_ragged_case.py"
step smoke2 python3 "${SMOKE[@]}" --processes 2
step smoke4 python3 "${SMOKE[@]}" --processes 4
step smoke2_put python3 "${SMOKE[@]}" --processes 2 --peer-access put
step smoke4_put python3 "${SMOKE[@]}" --processes 4 --peer-access put
step smoke4_nodes python3 "${SMOKE[@]}" --processes 4 --peer-access put \
  --ranks-per-node 2
step smoke4_groups python3 "${SMOKE[@]}" --processes 4 --data 2
step ptxas python3 "$ROOT/tools/check_ptxas.py"
step large python3 "$ROOT/tools/gpu_large_case.py" --profile "$RUN_DIR/profile" \
  --json "$OUT_DIR/large.json"
step memcheck sanitize memcheck
step synccheck sanitize synccheck
step initcheck sanitize initcheck
step racecheck sanitize racecheck
# Performance: under MPS, then the benchmarks (without it: the daemon is stopped first).
step mps mps_rig
step tune tune
mps_stop
# The row copy alone: one warp per SM on 8, 16, 32 and every SM, 4/8/16 loads in flight.
step copyrate python3 -m jax_ep.tools.copy_rate --json "$OUT_DIR/copy_rate.json"
step bench_ep1 bench --json "$OUT_DIR/bench_ep1.json"
step bench_virtual bench --virtual --ranks 8 --json "$OUT_DIR/bench_virtual.json"
step tests python3 -m pytest -q "$ROOT/tests" --ignore="$ROOT/tests/gpu" -p no:cacheprovider \
  --rootdir "$ROOT"

python3 tools/gpu_report.py "$OUT_DIR" "$REPORT_DIR"
! cut -f2 "$STATUS_FILE" | grep -qv '^0$'
