#!/usr/bin/env bash
# The GPU check: one command for a single-GPU machine without network access.
#
#   bash tools/gpu_check.sh [--dry-run] [OUT_DIR] [STEP ...]
#
# Builds and installs jax_ep against what is installed (no build isolation, no dependency
# resolution), then runs every check on the installed package from a directory outside the
# source tree: the kernel cases, the large case (DeepEP's shapes, GPU against the CPU handlers,
# per-kernel profile), the xla backend's ragged transport (XLA's ragged_all_to_all),
# compute-sanitizer (memcheck, synccheck, initcheck, racecheck on jax_ep's
# kernels), 2 and 4 processes through real NVSHMEM (with stores, with puts, node-aware, two EP
# groups), the GPUs of one process, a low-latency decode loop under XLA's command buffers
# (CUDA graphs), and the benchmarks (which fail unless their cuda rows ran).
# Writes one report (markdown + JSON) under docs/gpu/ (or $JAX_EP_GPU_REPORT_DIR) and OUT_DIR,
# rewritten after every step, so a run stopped at a time limit still leaves one. A failing step
# is recorded and the next one runs; the exit status is non-zero when any step failed.
#
# Every step but `tests` (the CPU suite, which needs a run of its own) runs by default, each
# bounded ($JAX_EP_STEP_TIMEOUT_S, default 300 s), with the waits between ranks bounded by
# $JAX_EP_START_TIMEOUT_S / $JAX_EP_TIMEOUT_S (default 60 s / 30 s here) and a hung smoke
# failed after 80 s. Name STEPs to run only those: env build installed ptxas kernels large
# ragged memcheck synccheck initcheck racecheck smoke2 smoke4 smoke2_put smoke4_put
# smoke4_nodes smoke4_groups smoke2_phased smoke4_nodes_phased smoke2_streamed
# smoke4_streamed_put smoke4_streamed_nodes smoke_local graph graph2 bench_ep1 bench_virtual
# tests. --dry-run runs no
# step: it checks that each one's command exists (CI runs it) and writes the report of that.
# See docs/gpu/README.md.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
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

export -f environment build installed sanitize bench
export ROOT OUT_DIR RUN_DIR
SMOKE=("$ROOT/tools/gpu_multiprocess_smoke.py" --timeout "$SMOKE_TIMEOUT_S")

step env environment
step build build
step installed installed
step ptxas python3 "$ROOT/tools/check_ptxas.py"
step kernels python3 "$ROOT/tools/gpu_kernels.py" --json "$OUT_DIR/kernels.json"
step large python3 "$ROOT/tools/gpu_large_case.py" --profile "$RUN_DIR/profile" \
  --json "$OUT_DIR/large.json"
step ragged python3 "$ROOT/tools/gpu_ragged_case.py"
step memcheck sanitize memcheck
step synccheck sanitize synccheck
step initcheck sanitize initcheck
step racecheck sanitize racecheck
step smoke2 python3 "${SMOKE[@]}" --processes 2
step smoke4 python3 "${SMOKE[@]}" --processes 4
step smoke2_put python3 "${SMOKE[@]}" --processes 2 --peer-access put
step smoke4_put python3 "${SMOKE[@]}" --processes 4 --peer-access put
step smoke4_nodes python3 "${SMOKE[@]}" --processes 4 --peer-access put \
  --ranks-per-node 2
step smoke4_groups python3 "${SMOKE[@]}" --processes 4 --data 2
# The smokes above stream through the default rings; in phases, and through rings of 2 slots
# (cuda/channels.h), so that every ring wraps.
step smoke2_phased python3 "${SMOKE[@]}" --processes 2 --channels off
step smoke4_nodes_phased python3 "${SMOKE[@]}" --processes 4 --peer-access put \
  --ranks-per-node 2 --channels off
step smoke2_streamed python3 "${SMOKE[@]}" --processes 2 --channels 2,1,2
step smoke4_streamed_put python3 "${SMOKE[@]}" --processes 4 --peer-access put --channels 2,1,2
step smoke4_streamed_nodes python3 "${SMOKE[@]}" --processes 4 --peer-access put \
  --ranks-per-node 2 --channels 2,1,2
step smoke_local python3 "${SMOKE[@]}" --local
step graph python3 "$ROOT/tools/gpu_graph_case.py" --json "$OUT_DIR/graph.json"
step graph2 python3 "$ROOT/tools/gpu_graph_case.py" --processes 2 --steps 8
step bench_ep1 bench --json "$OUT_DIR/bench_ep1.json"
step bench_virtual bench --virtual --ranks 8 --json "$OUT_DIR/bench_virtual.json"
step tests python3 -m pytest -q "$ROOT/tests" --ignore="$ROOT/tests/gpu" -p no:cacheprovider \
  --rootdir "$ROOT"

python3 tools/gpu_report.py "$OUT_DIR" "$REPORT_DIR"
! cut -f2 "$STATUS_FILE" | grep -qv '^0$'
