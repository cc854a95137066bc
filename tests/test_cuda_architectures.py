"""Which GPU architectures a build compiles for (cmake/cuda_architectures.cmake): this
machine's GPUs by default, every architecture of a wheel where it has none, or the choice
named in $JAX_EP_CUDA_ARCHITECTURES or the CMake definition."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALL = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]["cmake"][
    "define"]["JAX_EP_ALL_CUDA_ARCHITECTURES"]

def _cmake() -> str | None:
    """A cmake of version 3.26 or later (CMakeLists.txt's minimum), or None."""
    for path in filter(None, [shutil.which("cmake"), "/usr/bin/cmake"]):
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
        except OSError:
            continue
        version = tuple(int(v) for v in out.split()[2].split(".")[:2]) if out else (0, 0)
        if version >= (3, 26):
            return path
    return None


CMAKE = _cmake()
pytestmark = pytest.mark.skipif(CMAKE is None, reason="needs cmake 3.26 or later")


def chosen(tmp_path, choice: str, gpus: list[str] | None, env_choice: str | None = None) -> str:
    """The architectures CMake picks for `choice` on a machine whose nvidia-smi lists `gpus`'
    compute capabilities (None: an nvidia-smi that fails, as without a driver)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"  # ahead of any real one on PATH
    lines = "exit 1" if gpus is None else "printf '" + "".join(f"{g}\\n" for g in gpus) + "'"
    smi.write_text(f"#!/bin/sh\n{lines}\n")
    smi.chmod(0o755)
    script = tmp_path / "choose.cmake"
    script.write_text("cmake_minimum_required(VERSION 3.26)\n"  # as CMakeLists.txt
                      f'include("{ROOT}/cmake/cuda_architectures.cmake")\n'
                      f'jax_ep_cuda_architectures("${{CHOICE}}" "{ALL}" out)\n'
                      'message("${out}")\n')
    env = {k: v for k, v in os.environ.items() if k != "JAX_EP_CUDA_ARCHITECTURES"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    if env_choice is not None:
        env["JAX_EP_CUDA_ARCHITECTURES"] = env_choice
    proc = subprocess.run([CMAKE, f"-DCHOICE={choice}", "-P", str(script)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.strip()


def test_auto_builds_this_machines_gpus_once_each(tmp_path):
    assert chosen(tmp_path, "auto", ["9.0", "9.0", "8.6", "12.0"]) == "90-real;86-real;120-real"


def test_auto_without_a_gpu_builds_every_architecture(tmp_path):
    assert chosen(tmp_path, "auto", None) == ALL  # no driver
    assert chosen(tmp_path, "auto", []) == ALL  # nvidia-smi without GPUs
    assert chosen(tmp_path, "auto", ["No devices were found"]) == ALL


def test_the_variable_and_the_definition_choose(tmp_path):
    assert chosen(tmp_path, "auto", ["9.0"], env_choice="100-real") == "100-real"
    assert chosen(tmp_path, "auto", ["9.0"], env_choice="all") == ALL
    assert chosen(tmp_path, "80-real;90-real", ["9.0"], env_choice="100-real") == \
        "80-real;90-real"  # a definition on the command line wins
    assert chosen(tmp_path, "all", ["9.0"]) == ALL
    assert ALL == "80-real;90-real;100-real;120-real"  # what the wheels and CI build
