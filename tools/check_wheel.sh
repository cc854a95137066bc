#!/usr/bin/env bash
# Installs a wheel of jax_ep (tools/build_wheel.sh) into a fresh virtual environment where no
# nvcc is on PATH, and checks it: build_info() shows the CUDA kernels and the architectures
# expected (ARCHS, default pyproject.toml's JAX_EP_ALL_CUDA_ARCHITECTURES), and the doctor's CPU self-test passes.
#
#   tools/check_wheel.sh WHEEL
set -euo pipefail
cd "$(dirname "$0")/.."
wheel="$(realpath "$1")"
archs="${ARCHS:-$(python3 -c 'import tomllib
print(tomllib.load(open("pyproject.toml", "rb"))["tool"]["scikit-build"]["cmake"]["define"]
      ["JAX_EP_ALL_CUDA_ARCHITECTURES"])')}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
cd "$work"  # away from the source tree, so that the installed package is imported
env PATH="$work/venv/bin:/usr/bin:/bin" ARCHS="$archs" bash -euo pipefail -c '
  if command -v nvcc >/dev/null; then echo "check_wheel: nvcc is on PATH"; exit 1; fi
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet "'"$wheel"'"
  python - <<PY
import os
import jax_ep
info = jax_ep.build_info()
want = ["sm_" + a.removesuffix("-real") for a in os.environ["ARCHS"].split(";")]
assert info["cuda"], info
assert jax_ep._ffi.architectures(info) == want, (info, want)
print("check_wheel: build_info", info)
PY
  python -m jax_ep.tools.doctor
'
echo "check_wheel: ok ($(du -h "$wheel" | cut -f1) $(basename "$wheel"))"
