"""python -m jax_ep.tools.doctor: on this CPU machine it passes; with GPU facts faked, each check
fails where it should and names its fix."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import jax_ep
from jax_ep import _ffi
from jax_ep.runtime import BufferConfig
from jax_ep.tools import doctor

BUILD = {"ffi_api_version": "0.3", "cuda": True, "cuda_arch": "sm_80,sm_90,sm_100,sm_120",
         "nvshmem_version": "3.4.5"}
H100 = doctor.Device("gpu", "NVIDIA H100 80GB HBM3", (9, 0), 70 * 2**30)


def facts(**changes) -> doctor.Facts:
    base = doctor.Facts(jax_version="0.11.2", jaxlib_version="0.11.2",
                        cuda_plugin="jax-cuda13-plugin 0.11.2", build=BUILD, build_error=None,
                        devices=(H100,), process_count=1, variables={},
                        nvshmem_host="3.4.5", ibverbs=True, rdma_devices=("mlx5_0",),
                        cuda_versions={"driver": 13000, "runtime": 13000},
                        peer_access=((True,),))
    return dataclasses.replace(base, **changes)


def by_name(checks):
    return {c.name: c for c in checks}


CONFIG = BufferConfig(num_ranks=1)


def test_a_good_gpu_machine_passes_every_check():
    checks = by_name(doctor.check_facts(facts(), CONFIG))
    assert checks.pop("transports").status == doctor.SKIP  # one host
    assert checks.pop("peer access").status == doctor.SKIP  # one GPU
    assert all(c.status == doctor.OK for c in checks.values()), checks
    assert "compute capability 9.0; built for sm_80,sm_90,sm_100,sm_120" in \
        checks["architectures (GPU 0)"].detail


@pytest.mark.parametrize("change, name, fix", [
    (dict(devices=(dataclasses.replace(H100, compute_capability=(7, 0)),)),
     "architectures (GPU 0)", "rebuild for sm_70"),
    (dict(build={**BUILD, "cuda_arch": "sm_90a"},
          devices=(dataclasses.replace(H100, compute_capability=(10, 0)),)),
     "architectures (GPU 0)", "rebuild for sm_100"),
    (dict(build={**BUILD, "cuda": False, "cuda_arch": None}), "CUDA kernels", "nvcc on PATH"),
    (dict(cuda_plugin=None), "CUDA plugin", "jax[cuda13]"),
    (dict(devices=(dataclasses.replace(H100, free_bytes=2**20),)), "device memory (GPU 0)",
     "BufferConfig smaller"),
    (dict(build=None, build_error="No module named 'jax_ep._ext'"), "extension", "pip install ."),
    (dict(jax_version="0.9.0"), "jax", "jax>=0.10.2"),
    (dict(nvshmem_host="3.3.9"), "NVSHMEM", "nvidia-nvshmem-cu13>=3.4.5,<4"),
    (dict(nvshmem_host=None), "NVSHMEM", "nvidia-nvshmem-cu13>=3.4.5,<4"),
    (dict(process_count=2, ibverbs=False), "transports", "libibverbs"),
    (dict(cuda_versions={"driver": 12080, "runtime": 13000}), "CUDA driver",
     "driver to one for CUDA 13"),
    (dict(cuda_versions={"driver": 0, "runtime": 13000}), "CUDA driver",
     "install the NVIDIA driver"),
    (dict(devices=(H100,) * 3, peer_access=((True, True, False), (True,) * 3, (True,) * 3)),
     "peer access", "nvidia-smi topo -m"),
    (dict(process_count=2, rdma_devices=()), "transports", "/sys/class/infiniband"),
])
def test_each_failure_names_its_fix(change, name, fix):
    checks = by_name(doctor.check_facts(facts(**change), CONFIG))
    assert checks[name].status == doctor.FAIL and fix in checks[name].fix, checks[name]


def test_driver_and_peer_access_say_what_they_found():
    """A newer driver runs an older runtime; the peer access matrix is shown, with the pairs
    that lack it named."""
    checks = by_name(doctor.check_facts(facts(
        devices=(H100,) * 2, cuda_versions={"driver": 13020, "runtime": 13000},
        peer_access=((True, True), (True, True))), CONFIG))
    assert checks["CUDA driver"].status == doctor.OK
    assert checks["CUDA driver"].detail == "driver supports CUDA 13.2, runtime 13.0 built in"
    assert checks["peer access"].status == doctor.OK
    assert checks["peer access"].detail == "all 2 GPUs reach each other (GPU 0: xx; GPU 1: xx)"
    failed = by_name(doctor.check_facts(facts(
        devices=(H100,) * 2, peer_access=((True, False), (True, True))), CONFIG))["peer access"]
    assert "no peer access 0->1" in failed.detail and "GPU 0: x." in failed.detail


def test_bad_variables_fail_with_the_variable_named(monkeypatch):
    monkeypatch.setenv("JAX_EP_TIMEOUT_S", "soon")
    check = by_name(doctor.check_facts(facts(variables={"JAX_EP_TIMEOUT_S": "soon"}),
                                       CONFIG))["environment"]
    assert check.status == doctor.FAIL and "$JAX_EP_TIMEOUT_S='soon'" in check.fix
    assert "JAX_EP_TIMEOUT_S=soon" in check.detail


def test_architecture_rules():
    runs = _ffi.runs_on
    assert runs("sm_90a", (9, 0)) and not runs("sm_90a", (10, 0))
    assert runs("sm_80", (8, 6)) and not runs("sm_80", (9, 0))
    assert runs("sm_100a", (10, 0)) and not runs("sm_100a", (10, 3))
    assert runs("sm_100", (10, 3)) and not runs("sm_100", (12, 0))
    assert runs("compute_90", (12, 0)) and not runs("compute_90", (8, 9))
    assert _ffi.architectures({"cuda_arch": "sm_80,compute_120"}) == ["sm_80", "compute_120"]
    assert _ffi.architectures({"cuda_arch": None}) == []


def test_build_info_lists_what_was_built():
    info = jax_ep.build_info()
    assert set(info) == {"extension", "ffi_api_version", "cuda", "cuda_arch", "nvshmem_version"}
    if info["cuda"]:  # machine code only: this machine's GPUs, or every architecture of a
        # wheel (tools/check_wheel.sh checks CI's has all four)
        archs = _ffi.architectures(info)
        assert archs and all(a.startswith("sm_") for a in archs), archs


def test_the_extension_reports_cuda_versions_and_peer_access():
    """The bindings the doctor reads on a GPU machine: the runtime built in, the driver's
    version (0 without one), and a square matrix over the GPUs this process sees."""
    if not jax_ep.build_info()["cuda"]:
        assert _ffi.EXT.cuda_versions() is None and _ffi.EXT.peer_access_matrix() is None
        return
    versions = _ffi.EXT.cuda_versions()
    assert versions["runtime"] >= 13000 and versions["driver"] >= 0, versions
    matrix = _ffi.EXT.peer_access_matrix()
    assert all(len(row) == len(matrix) and row[i] for i, row in enumerate(matrix)), matrix


def test_on_this_machine_it_runs_the_cpu_checks_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "jax_ep.tools.doctor", "--timeout", "120"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "[skip] architectures: no GPU in this process" in proc.stdout
    assert "0 failed" in proc.stdout and "self-test" in proc.stdout


def test_nvshmem_and_transports_between_hosts():
    """A newer host library of the same major version accepts the device library; between
    hosts the RDMA stack is checked and NVSHMEM's transport named."""
    checks = by_name(doctor.check_facts(
        facts(nvshmem_host="3.6.1", process_count=2,
              variables={"NVSHMEM_IB_ENABLE_IBGDA": "1"}), CONFIG))
    assert checks["NVSHMEM"].status == doctor.OK, checks["NVSHMEM"]
    assert checks["transports"].status == doctor.OK
    assert "IBGDA" in checks["transports"].detail and "mlx5_0" in checks["transports"].detail
    no_cuda = by_name(doctor.check_facts(facts(build={**BUILD, "cuda": False, "cuda_arch": None,
                                                       "nvshmem_version": None}), CONFIG))
    assert no_cuda["NVSHMEM"].status == doctor.SKIP
