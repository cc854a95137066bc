"""`python -m jax_ep.tools.doctor`: whether this machine can run jax_ep, each check with its fix.

It gathers the facts (JAX and its CUDA plugin, the extension's build, NVSHMEM's host library
against the device library built in, the devices and their compute capabilities, the CUDA
driver against the runtime built in, peer access between the local GPUs, free device memory,
the RDMA stack between hosts, the JAX_EP_* and NVSHMEM_* variables set, the defaults the
runtime takes for this GPU and where from: the tuned table or the built-in ones), checks
them against what a configuration needs (`BufferConfig`, DeepSeek's shapes by default), then
runs a bit-exact self-test of the local paths under a time limit. Exit status 0 only when
every check that applies passes; on CPU the GPU checks say why they were skipped.
"""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import os
import sys
import threading
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

OK, SKIP, FAIL = "ok", "skip", "FAIL"
MIN_JAX = (0, 10, 2)
RDMA_DEVICES = "/sys/class/infiniband"


@dataclasses.dataclass(frozen=True)
class Device:
    platform: str  # "gpu" or "cpu"
    kind: str
    compute_capability: tuple[int, int] | None = None  # GPUs
    free_bytes: int | None = None  # GPUs, where the runtime says


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the checks read; gather() finds them, tests fake them."""

    jax_version: str
    jaxlib_version: str
    cuda_plugin: str | None  # the jax CUDA plugin's version, None without one
    build: dict[str, Any] | None  # jax_ep._ext.build_info(), None without the extension
    build_error: str | None
    devices: tuple[Device, ...]
    process_count: int
    variables: dict[str, str]  # JAX_EP_* and NVSHMEM_* that are set
    nvshmem_host: str | None = None  # the installed nvidia-nvshmem-cu13 (its host library)
    ibverbs: bool = False  # libibverbs loads (NVSHMEM's RDMA transports need it)
    rdma_devices: tuple[str, ...] = ()  # /sys/class/infiniband
    # The CUDA driver's version and the runtime's built in (1000 x major + 10 x minor; 0:
    # unknown), and whether local GPU a can access GPU b's memory; None without CUDA.
    cuda_versions: dict[str, int] | None = None
    peer_access: tuple[tuple[bool, ...], ...] | None = None


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, SKIP or FAIL
    detail: str
    fix: str = ""


def gather() -> Facts:
    """The facts of this process (imports JAX; starts no exchange)."""
    import jax
    import jaxlib

    from jax_ep import _ffi

    plugin = None
    for name in ("jax-cuda13-plugin", "jax-cuda12-plugin"):
        try:
            plugin = f"{name} {metadata.version(name)}"
            break
        except metadata.PackageNotFoundError:
            continue
    devices = []
    for d in jax.local_devices():
        capability = getattr(d, "compute_capability", None)
        if isinstance(capability, str):
            capability = tuple(int(v) for v in capability.split("."))
        stats = d.memory_stats() if d.platform == "gpu" else None
        free = None
        if stats and "bytes_limit" in stats:
            free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        devices.append(Device(d.platform, d.device_kind, capability, free))
    cuda = _ffi.EXT is not None and any(d.platform == "gpu" for d in devices)
    peers = _ffi.EXT.peer_access_matrix() if cuda else None
    return Facts(
        jax_version=jax.__version__, jaxlib_version=jaxlib.__version__, cuda_plugin=plugin,
        build=_ffi.EXT.build_info() if _ffi.EXT is not None else None,
        build_error=_ffi.IMPORT_ERROR,
        devices=tuple(devices), process_count=jax.process_count(),
        variables={k: v for k, v in sorted(os.environ.items())
                   if k.startswith(("JAX_EP_", "NVSHMEM_"))},
        nvshmem_host=_installed("nvidia-nvshmem-cu13"),
        ibverbs=ctypes.util.find_library("ibverbs") is not None,
        rdma_devices=tuple(sorted(os.listdir(RDMA_DEVICES))) if os.path.isdir(RDMA_DEVICES)
        else (),
        cuda_versions=_ffi.EXT.cuda_versions() if cuda else None,
        peer_access=None if peers is None else tuple(tuple(row) for row in peers))


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_facts(facts: Facts, config: Any) -> list[Check]:
    """Every check but the self-test, from the facts alone."""
    from jax_ep import _ffi, runtime

    checks = []
    jax_ok = _version(facts.jax_version) >= MIN_JAX
    checks.append(Check("jax", OK if jax_ok else FAIL,
                        f"jax {facts.jax_version}, jaxlib {facts.jaxlib_version}",
                        "" if jax_ok else "pip install 'jax>=0.10.2' 'jaxlib>=0.10.2'"))
    gpus = [d for d in facts.devices if d.platform == "gpu"]
    if facts.build is None:
        checks.append(Check("extension", FAIL, f"not loaded: {facts.build_error}",
                            "reinstall from the project's folder: pip install ."))
    else:
        checks.append(Check("extension", OK, ", ".join(f"{k} {v}" for k, v in
                                                         facts.build.items())))
    if not gpus:
        why = "no GPU in this process: the cuda backend runs its CPU handlers"
        for name in ("CUDA plugin", "CUDA kernels", "CUDA driver", "architectures",
                     "peer access", "device memory"):
            checks.append(Check(name, SKIP, why))
    else:
        checks.append(Check("CUDA plugin", OK if facts.cuda_plugin else FAIL,
                            facts.cuda_plugin or "JAX sees GPUs but no CUDA plugin is installed",
                            "" if facts.cuda_plugin else "pip install 'jax[cuda13]'"))
        built = bool(facts.build and facts.build.get("cuda"))
        checks.append(Check("CUDA kernels", OK if built else FAIL,
                            "compiled in" if built else "this build has no CUDA kernels",
                            "" if built else "rebuild with nvcc on PATH: pip install "
                            "-C cmake.define.JAX_EP_CUDA=ON ."))
        checks.append(_check_driver(facts))
        arch = (facts.build or {}).get("cuda_arch")
        for i, d in enumerate(gpus):
            cc = d.compute_capability
            ok = built and cc is not None and \
                any(_ffi.runs_on(a, cc) for a in _ffi.architectures(facts.build or {}))
            checks.append(Check(
                f"architectures (GPU {i})", OK if ok else FAIL,
                f"{d.kind}, compute capability {'.'.join(map(str, cc)) if cc else '?'}; "
                f"built for {arch or 'no GPU'}",
                "" if ok else f"rebuild for sm_{cc[0]}{cc[1]}: JAX_EP_CUDA_ARCHITECTURES="
                f"{cc[0]}{cc[1]}-real pip install ." if cc else
                "the GPU does not report its compute capability"))
        checks.append(_check_peer_access(facts))
        need = runtime.required_bytes(config)
        for i, d in enumerate(gpus):
            if d.free_bytes is None:
                checks.append(Check(f"device memory (GPU {i})", SKIP,
                                    "the runtime does not report free memory"))
                continue
            ok = d.free_bytes >= need
            checks.append(Check(
                f"device memory (GPU {i})", OK if ok else FAIL,
                f"{need / 2**30:.2f} GiB of symmetric buffer needed, "
                f"{d.free_bytes / 2**30:.2f} GiB free",
                "" if ok else "make the BufferConfig smaller (num_tokens, low_latency_tokens) "
                "or leave XLA less memory (XLA_PYTHON_CLIENT_MEM_FRACTION)"))
    checks.append(_check_nvshmem(facts))
    checks.append(_check_transports(facts))
    checks.append(_check_variables(facts))
    checks.append(_check_defaults(facts))
    return checks


def _check_defaults(facts: Facts) -> Check:
    """The rings and num_sms the runtime uses where the caller sets none, for this machine's
    first GPU (or its CPU devices), and where each came from: $JAX_EP_CHANNELS, the tuned
    table (jax_ep.tuned) or the built-in defaults."""
    from jax_ep import runtime

    gpus = [d for d in facts.devices if d.platform == "gpu"]
    try:
        found = runtime.defaults_for(gpus[0].kind if gpus else None)
    except ValueError as error:
        return Check("defaults", FAIL, f"cannot resolve them for "
                     f"{gpus[0].kind if gpus else 'CPU devices'}", str(error))
    return Check("defaults", OK, found.describe())


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _check_driver(facts: Facts) -> Check:
    """The driver runs a runtime of its major version or older (CUDA's minor version
    compatibility): a CUDA 13 build needs a CUDA 13 driver."""
    v = facts.cuda_versions
    if not v or not v.get("runtime"):
        return Check("CUDA driver", SKIP, "this build has no CUDA runtime to check against")
    built = _cuda_version(v["runtime"])
    if not v.get("driver"):
        return Check("CUDA driver", FAIL, f"no CUDA driver answered; runtime {built} built in",
                     "install the NVIDIA driver (nvidia-smi should list the GPUs)")
    ok = v["driver"] // 1000 >= v["runtime"] // 1000
    return Check("CUDA driver", OK if ok else FAIL,
                 f"driver supports CUDA {_cuda_version(v['driver'])}, runtime {built} built in",
                 "" if ok else f"update the NVIDIA driver to one for CUDA {v['runtime'] // 1000}"
                 f" (nvidia-smi shows the CUDA version it supports), or build jax_ep and jax "
                 f"for CUDA {_cuda_version(v['driver'])}")


def _check_peer_access(facts: Facts) -> Check:
    """GPUs of one node reach each other's memory (NVLink or PCIe P2P): several GPUs of one
    process exchange through it, and NVSHMEM's stores within a node need it."""
    can = facts.peer_access
    if can is None or len(can) < 2:
        return Check("peer access", SKIP, "one GPU in this process: its peers, if any, are "
                     "other processes' (NVSHMEM checks them when it starts)")
    missing = [f"{a}->{b}" for a, row in enumerate(can) for b, ok in enumerate(row) if not ok]
    rows = "; ".join(f"GPU {a}: " + "".join("x" if ok else "." for ok in row)
                     for a, row in enumerate(can))
    if not missing:
        return Check("peer access", OK, f"all {len(can)} GPUs reach each other ({rows})")
    return Check("peer access", FAIL,
                 f"no peer access {', '.join(missing)} (x: reaches, .: does not; {rows})",
                 "check the links between them (nvidia-smi topo -m: NVLink, or PCIe with P2P, "
                 "which IOMMU and ACS settings can disable)")


def _check_nvshmem(facts: Facts) -> Check:
    """NVSHMEM's host library refuses a device library of another major version or a newer
    minor one: the classic failure of a mismatched install."""
    device = (facts.build or {}).get("nvshmem_version")
    if not device:
        return Check("NVSHMEM", SKIP, "this build has no CUDA kernels, so no NVSHMEM")
    fix = f"pip install 'nvidia-nvshmem-cu13>={device},<{int(device.split('.')[0]) + 1}'"
    if facts.nvshmem_host is None:
        return Check("NVSHMEM", FAIL, f"device library {device} built in; the host library "
                     "(nvidia-nvshmem-cu13) is not installed", fix)
    host, built = _version(facts.nvshmem_host), _version(device)
    ok = host[0] == built[0] and host[:2] >= built[:2]
    return Check("NVSHMEM", OK if ok else FAIL,
                 f"host library {facts.nvshmem_host}, device library {device} built in"
                 + ("" if ok else ": the host library refuses a device library of another "
                    "major version or a newer minor one"), "" if ok else fix)


def _check_transports(facts: Facts) -> Check:
    """Between hosts NVSHMEM's puts need its RDMA stack: libibverbs and a NIC."""
    if facts.process_count <= 1:
        return Check("transports", SKIP, "one host: its GPUs reach each other without RDMA")
    nics = ", ".join(facts.rdma_devices) or "none"
    ok = facts.ibverbs and bool(facts.rdma_devices)
    ibgda = facts.variables.get("NVSHMEM_IB_ENABLE_IBGDA", "").strip() in ("1", "true")
    verbs = "found" if facts.ibverbs else "missing"
    return Check("transports", OK if ok else FAIL,
                 f"{facts.process_count} hosts; libibverbs {verbs}; RDMA devices: {nics}; "
                 f"NVSHMEM's transport: "
                 f"{'IBGDA (NVSHMEM_IB_ENABLE_IBGDA)' if ibgda else 'IBRC, its default'}",
                 "" if ok else "install the RDMA stack (rdma-core: libibverbs) and check that "
                 "the NICs show in /sys/class/infiniband (ibv_devices)")


def _check_variables(facts: Facts) -> Check:
    """The JAX_EP_* variables, each read by the rule every variable follows."""
    from jax_ep import backends, runtime
    from jax_ep.backends import xla

    readers: list[Callable[[], Any]] = [runtime.peer_access, runtime.ranks_per_node,
                                        lambda: backends.resolve("auto"), xla.transport]
    readers += [lambda name=name: runtime.env_seconds(name) for name in runtime.TIMEOUT_VARS]
    errors = []
    for read in readers:
        try:
            read()
        except ValueError as error:
            errors.append(str(error))
    shown = ", ".join(f"{k}={v}" for k, v in facts.variables.items()) or "none set"
    if errors:
        return Check("environment", FAIL, shown, "; ".join(errors))
    return Check("environment", OK, shown)


def self_test(timeout_s: float) -> list[Check]:
    """Dispatch and combine of one small routing on each local path, bit for bit against the
    portable backend: the cuda backend with virtual ranks (the kernels on a GPU, the CPU
    handlers otherwise)."""
    result: list[Check] = []

    def run():
        import jax
        import numpy as np

        from jax_ep import _ffi, virtual

        rng = np.random.default_rng(0)
        R, T, K, E, H = 4, 37, 3, 8, 128
        x = rng.standard_normal((R, T, H)).astype(np.float32)
        idx = rng.integers(-1, E, (R, T, K)).astype(np.int32)
        w = rng.random((R, T, K)).astype(np.float32)
        outs = {}
        names = ["xla"] + (["cuda"] if _ffi.EXT is not None else [])
        for name in names:
            recv, handle = virtual.dispatch(x, idx, w, num_experts=E, backend=name)
            out = virtual.combine(recv.with_zero_padding().x, handle, backend=name)
            outs[name] = jax.tree.map(np.asarray, (recv.with_zero_padding(), out))
        platform = jax.default_backend()
        for name in names[1:]:
            same = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in
                       zip(jax.tree.leaves(outs[name]), jax.tree.leaves(outs["xla"]),
                           strict=True))
            result.append(Check(f"self-test ({name}, {platform})", OK if same else FAIL,
                                "dispatch and combine at R 4 (virtual ranks) bit for bit "
                                + ("equal to the portable backend" if same else "DIFFER"),
                                "" if same else "report this with the doctor's output"))
        if len(names) == 1:
            result.append(Check("self-test", SKIP, "no extension: only the portable backend"))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return [Check("self-test", FAIL, f"did not finish within {timeout_s:g} s",
                      "a hang here is a bug: report it with the doctor's output")]
    return result or [Check("self-test", FAIL, "raised before it finished",
                            "run it again with python -X faulthandler -m jax_ep.tools.doctor")]


def report(checks: Sequence[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"[{c.status:>4}] {c.name}: {c.detail}")
        if c.fix:
            lines.append(f"       fix: {c.fix}")
    failed = sum(c.status == FAIL for c in checks)
    lines.append(f"\n{len(checks)} checks: {failed} failed, "
                 f"{sum(c.status == SKIP for c in checks)} skipped (they do not apply here).")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_ep.tools.doctor", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096,
                        help="BufferConfig.num_tokens for the memory check")
    parser.add_argument("--ll-tokens", type=int, default=128,
                        help="BufferConfig.low_latency_tokens for the memory check")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds the self-test may take")
    args = parser.parse_args(argv)
    from jax_ep.runtime import BufferConfig

    facts = gather()
    config = BufferConfig(num_tokens=args.tokens, low_latency_tokens=args.ll_tokens,
                          num_ranks=1)
    checks = check_facts(facts, config) + self_test(args.timeout)
    print(report(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
