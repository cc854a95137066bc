"""tools/check_ptxas.py reading a build's log (CI's path: the kernels it built, not a second
compile), on a log written the way Ninja and ptxas write it."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location(
    "check_ptxas", os.path.join(ROOT, "tools", "check_ptxas.py"))
check_ptxas = importlib.util.module_from_spec(spec)
sys.modules["check_ptxas"] = check_ptxas  # its dataclass looks itself up there
spec.loader.exec_module(check_ptxas)


def ptxas(symbol, arch, registers, spills=0):
    return [
        f"ptxas info    : Compiling entry function '{symbol}' for '{arch}'",
        f"ptxas info    : Function properties for {symbol}",
        f"    0 bytes stack frame, {spills} bytes spill stores, {spills} bytes spill loads",
        f"ptxas info    : Used {registers} registers, used 1 barriers, 288 bytes smem",
    ]


LAYOUT = "_ZN6jax_ep4cuda22dispatch_layout_kernelEPKi"
NVSHMEM = "_Z22nvshmemi_transfer_thingv"


def build_log(spills_at=None):
    """Two files over sm_80 and sm_90 (an arch list per file, like one nvcc call), NVSHMEM's own
    function among them, and a C++ step between."""
    lines = ["  [1/4] Building CUDA object CMakeFiles/_ext.dir/cuda/layout.cu.o"]  # as pip -v
    for arch in ("sm_80", "sm_90"):
        lines += ptxas(LAYOUT, arch, 38, 16 if arch == spills_at else 0)
        lines += ptxas(NVSHMEM, arch, 200, 64)
    lines += ["[2/4] Building CXX object CMakeFiles/_ext.dir/ffi/module.cc.o",
              "ptxas info    : Compiling entry function '_ZN6jax_ep3notmine' for 'sm_90'"]
    return "\n".join(lines) + "\n"


def test_reports_per_file_and_architecture():
    reports = check_ptxas.split_build_log(build_log())
    assert sorted(reports) == ["cuda/layout.cu"]
    kernels = check_ptxas.parse_kernels("layout.cu", reports["cuda/layout.cu"])
    assert [(k.arch, k.registers, k.spill_stores) for k in kernels] == [
        ("sm_80", 38, 0), ("sm_90", 38, 0)]
    assert all(k.hot for k in kernels)


def test_a_spill_on_one_architecture_is_that_architecture_s():
    reports = check_ptxas.split_build_log(build_log(spills_at="sm_90"))
    kernels = check_ptxas.parse_kernels("layout.cu", reports["cuda/layout.cu"])
    assert [(k.arch, k.uses_local_memory) for k in kernels] == [
        ("sm_80", False), ("sm_90", True)]


def test_a_log_without_every_file_and_architecture_fails(tmp_path, capsys):
    log = tmp_path / "build.log"
    log.write_text(build_log())
    assert check_ptxas.main(["--build-log", str(log)]) == 1
    out = capsys.readouterr().out
    assert "cuda/peer_exchange.cu is not compiled in" in out
    assert "hot kernels not found in the report: copy_rate_kernel, per_warp_kernel" in out
    assert "no kernel reported for" in out and "sm_100" in out
