"""Compiles every cuda/*.cu for each architecture of a wheel's build (pyproject.toml's
JAX_EP_ALL_CUDA_ARCHITECTURES) with `ptxas -v` and checks the kernels' resources.

Needs nvcc (PATH, or $CUDA_HOME/bin) and the nvidia-nvshmem-cu13 wheel (for its headers); no
GPU. Prints one row per kernel of ours (registers, spill stores/loads, stack frame) and exits
non-zero when a file does not compile, when a hot kernel (a name containing one of
HOT_KERNELS) spills registers or has a stack frame (both mean local memory, which is slow on
the hot path), or when a copy kernel (one of COPY_PHASES: cuda/phase_functors.h builds them
for 4 blocks per SM on Hopper, 2 elsewhere) holds more registers than that allows
(COPY_REGISTERS). Other kernels are reported but do not fail the check.

Run: python tools/check_ptxas.py [cuda/file.cu ...]
     python tools/check_ptxas.py --build-log LOG

With --build-log it compiles nothing: it reads the ptxas reports of a build that printed them
(JAX_EP_PTXAS_VERBOSE=ON, the default, and `pip install -v`, whose log holds Ninja's line
"Building CUDA object .../cuda/X.cu.o" before each file's report), so that CI checks the very
kernels it built, every architecture, without compiling them a second time.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC_FLAGS = [
    "-rdc=true",
    "-std=c++17",
    "-O3",
    "-DNDEBUG",
    "-Xptxas",
    "-v",
]
# Kernels on the per-step path of a model, and the copy-rate kernel (whose rate, with local
# memory, would not be the row copy's): any spill or stack frame there fails the check.
HOT_KERNELS = frozenset({"copy_rate_kernel", "dispatch_layout", "per_warp_kernel"})
# The phases that move rows: 32 warps per SM need at most 64 registers per thread.
COPY_PHASES = frozenset(
    {
        "DispatchSend",
        "DispatchFinish",
        "CombineStage",
        "LowLatencySend",
        "LowLatencyFinish",
        "LowLatencyCombineSend",
        "RowsPull",
    }
)
COPY_REGISTERS = {"sm_90": 64}  # Hopper's copies; the other architectures': 128
OTHER_COPY_REGISTERS = 128  # (cuda/phase_functors.h, kCopyBlocksPerSm)
# Of those, the casts compute more than they copy and are built for the default blocks per SM
# (kCopy): the low-latency send to NVFP4 (a block's scale needs a correctly rounded
# reciprocal, and each segment's warp reduces its whole row's amax first), the normal
# dispatch's send to any format (the cast beside its lookup of each row's place), its
# finish that dequantizes, and the combine's stage that casts each weighted row.
NOT_COPIES = (re.compile(r"^per_warp_kernel<LowLatencySend<[^<>]*(<[^<>]*>)?, 4>"),
              re.compile(r"^per_warp_kernel<DispatchSend<[^<>]*(<[^<>]*>)?, [1-4]>"),
              re.compile(r"^per_warp_kernel<DispatchFinish<[^<>]*(<[^<>]*>)?, true>"),
              re.compile(r"^per_warp_kernel<CombineStage<[^<>]*, true>"))

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\w+)'")
OWNER = re.compile(r"Function properties for (\S+)")
WARNING = re.compile(r"warning #\d+")
PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGS = re.compile(r"Used (\d+) registers")
# Ninja's line before each step's output in a build log (pip -v indents it).
BUILD_STEP = re.compile(r"^\s*\[\d+/\d+\] ")
CUDA_OBJECT = re.compile(r"Building CUDA object \S*?\b(cuda/\w+\.cu)\.o")


def architectures() -> list[str]:
    """The machine-code architectures a wheel's build compiles for ("90", "100a", ...)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        define = tomllib.load(f)["tool"]["scikit-build"]["cmake"]["define"]
    archs = [a.removesuffix("-real") for a in define["JAX_EP_ALL_CUDA_ARCHITECTURES"].split(";")]
    return [a for a in archs if not a.endswith("-virtual")]


@dataclass
class Kernel:
    file: str
    symbol: str
    arch: str = ""
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def name(self) -> str:
        return demangle(self.symbol)

    @property
    def hot(self) -> bool:
        return any(hot in self.name for hot in HOT_KERNELS)

    @property
    def copies(self) -> bool:
        if any(pattern.match(self.name) for pattern in NOT_COPIES):
            return False
        return any(self.name.startswith(f"per_warp_kernel<{phase}<") for phase in COPY_PHASES)

    @property
    def uses_local_memory(self) -> bool:
        return bool(self.stack or self.spill_stores or self.spill_loads)


def find_nvcc() -> str:
    nvcc = shutil.which("nvcc")
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if nvcc is None and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if nvcc is None:
        sys.exit("check_ptxas.py: error: nvcc not found; put it on PATH or set CUDA_HOME")
    return nvcc


def nvshmem_include() -> str:
    try:
        import nvidia.nvshmem
    except ImportError:
        sys.exit("check_ptxas.py: error: NVSHMEM headers not found: "
                 "pip install nvidia-nvshmem-cu13==3.4.5")
    # A namespace package: its location is __path__, not __file__.
    return os.path.join(list(nvidia.nvshmem.__path__)[0], "include")


def demangle(symbol: str) -> str:
    """The kernel's unqualified name (file-local kernels carry an `__nv_static_..._` prefix)."""
    mangled = symbol[symbol.index("_Z") :] if "_Z" in symbol else symbol
    try:
        out = subprocess.run(["c++filt", mangled], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return symbol
    readable = out.stdout.strip().replace("(anonymous namespace)::", "")
    depth = 0
    for i, char in enumerate(readable):  # cut the parameter list, outside template arguments
        depth += {"<": 1, ">": -1}.get(char, 0)
        if char == "(" and depth == 0:
            readable = readable[:i]
            break
    readable = readable.removeprefix("void ")
    return re.sub(r"\b\w+::", "", readable)  # without namespaces: per_warp_kernel<DispatchSend>


def compile_report(nvcc: str, path: str, arch: str, include: str) -> tuple[int, str]:
    """Compiles one file for sm_`arch`; returns nvcc's exit status and its output (the ptxas
    report)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            nvcc,
            f"-gencode=arch=compute_{arch},code=sm_{arch}",
            *NVCC_FLAGS,
            f"-I{ROOT}",
            f"-I{include}",
            "-c",
            path,
            "-o",
            os.path.join(tmp, "out.o"),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def parse_kernels(file: str, report: str) -> list[Kernel]:
    """Our entry functions (namespace jax_ep) with their resource use, per architecture (one
    report may hold several). Device functions of NVSHMEM that ptxas also reports are not ours
    and are skipped."""
    kernels: dict[tuple[str, str], Kernel] = {}
    arch = ""
    current = None
    for line in report.splitlines():
        if match := ENTRY.search(line):
            arch = match.group(2)
            if "jax_ep" in match.group(1):
                kernels[match.group(1), arch] = Kernel(file, match.group(1), arch)
        elif match := OWNER.search(line):  # the lines below belong to this function
            current = kernels.get((match.group(1), arch))
        elif current and (match := PROPS.search(line)):
            current.stack, current.spill_stores, current.spill_loads = map(int, match.groups())
        elif current and (match := REGS.search(line)):
            current.registers = int(match.group(1))
    return list(kernels.values())


def cuda_files() -> list[str]:
    """Every cuda/*.cu, relative to the repository."""
    return sorted(f"cuda/{f}" for f in os.listdir(os.path.join(ROOT, "cuda")) if f.endswith(".cu"))


def split_build_log(log: str) -> dict[str, str]:
    """The output of each CUDA file's compile step in a build log, by its path (cuda/X.cu)."""
    reports: dict[str, list[str]] = {}
    lines = None
    for line in log.splitlines():
        if BUILD_STEP.match(line):
            match = CUDA_OBJECT.search(line)
            lines = reports.setdefault(match.group(1), []) if match else None
        elif lines is not None:
            lines.append(line)
    return {file: "\n".join(lines) for file, lines in reports.items()}


def compiled_reports(argv: list[str]) -> tuple[list[tuple[str, str | None, str]], bool]:
    """(where, what went wrong or None, ptxas's report) for each file and architecture it
    compiles, and whether every file of cuda/ is among them."""
    nvcc = find_nvcc()
    include = nvshmem_include()
    paths = [os.path.abspath(p) for p in argv] or [os.path.join(ROOT, f) for f in cuda_files()]
    jobs = [(path, arch) for arch in architectures() for path in paths]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        outputs = list(pool.map(lambda job: compile_report(nvcc, *job, include), jobs))
    return [
        (f"{os.path.relpath(path, ROOT)} (sm_{arch})", "does not compile" if status else None,
         report)
        for (path, arch), (status, report) in zip(jobs, outputs, strict=True)
    ], not argv


def logged_reports(path: str) -> list[tuple[str, str | None, str]]:
    """The same from a build log; a file of cuda/ that the log does not show compiled (an
    incremental build that skipped it) is reported as missing."""
    with open(path, errors="replace") as f:
        reports = split_build_log(f.read())
    missing = f"is not compiled in {path} (build from a clean build directory with -v)"
    return [(file, None if file in reports else missing, reports.get(file, ""))
            for file in cuda_files()]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--build-log"] and len(argv) == 2:
        reports, whole = logged_reports(argv[1]), True
    else:
        reports, whole = compiled_reports(argv)

    failed = False
    rows: list[Kernel] = []
    for where, error, report in reports:
        if error:
            print(f"check_ptxas: {where} {error}" + (f":\n{report}" if report else ""))
            failed = True
            continue
        # nvcc only warns when device code calls a host function, and the kernel then does
        # not do what it says (it can compile to almost nothing): any warning fails.
        warnings = [line for line in report.splitlines() if WARNING.search(line)]
        if warnings:
            print(f"check_ptxas: {where} compiles with warnings:\n" + "\n".join(warnings))
            failed = True
        rows += parse_kernels(os.path.basename(where.split()[0]), report)

    width = max([len("kernel"), *(len(k.name) for k in rows)])
    fw = max([len("file"), *(len(k.file) for k in rows)])
    print(
        f"{'file':<{fw}} {'arch':<6} {'kernel':<{width}} {'hot':>3} {'copy':>4} {'regs':>5} "
        f"{'spill st':>9} {'spill ld':>9} {'stack':>6}"
    )
    for k in rows:
        flag = ""
        if k.uses_local_memory:
            flag = "  <- local memory in a hot kernel" if k.hot else "  (local memory)"
            failed |= k.hot
        limit = COPY_REGISTERS.get(k.arch, OTHER_COPY_REGISTERS)
        if k.copies and k.registers > limit:
            flag += f"  <- over {limit} registers in a copy kernel"
            failed = True
        print(
            f"{k.file:<{fw}} {k.arch:<6} {k.name:<{width}} {'yes' if k.hot else '':>3} "
            f"{'yes' if k.copies else '':>4} {k.registers:>5} "
            f"{k.spill_stores:>9} {k.spill_loads:>9} {k.stack:>6}{flag}"
        )
    missing = [h for h in sorted(HOT_KERNELS) if not any(h in k.name for k in rows)]
    if missing and whole:
        print(f"check_ptxas: hot kernels not found in the report: {', '.join(missing)}")
        failed = True
    unbuilt = sorted({f"sm_{a}" for a in architectures()} - {k.arch for k in rows})
    if unbuilt and whole:
        print(f"check_ptxas: no kernel reported for {', '.join(unbuilt)}")
        failed = True
    print("check_ptxas:", "FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
