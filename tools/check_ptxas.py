"""Compiles every cuda/*.cu for sm_90a with `ptxas -v` and checks the kernels' resources.

Prints one row per kernel (registers, spill stores/loads, stack frame) and exits non-zero when
a file does not compile, or when one of our kernels spills registers or uses a stack frame
(local memory, which is slow on the hot path). Run: python tools/check_ptxas.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH = "-gencode=arch=compute_90a,code=sm_90a"

ENTRY = re.compile(r"Compiling entry function '(\S+)' for")
OWNER = re.compile(r"Function properties for (\S+)")
PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGS = re.compile(r"Used (\d+) registers")


def nvshmem_include() -> str:
    import nvidia.nvshmem

    return os.path.join(list(nvidia.nvshmem.__path__)[0], "include")


def demangle(name: str) -> str:
    """Short kernel name (file-local kernels carry an `__nv_static_..._` prefix)."""
    name = name[name.index("_Z"):] if "_Z" in name else name
    try:
        out = subprocess.run(["c++filt", name], capture_output=True, text=True, check=True)
        readable = out.stdout.strip().replace("(anonymous namespace)::", "")
        return readable.split("(")[0].split("::")[-1]
    except (OSError, subprocess.CalledProcessError):
        return name


def compile_report(path: str, include: str) -> tuple[int, str]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["nvcc", ARCH, "-std=c++17", "-rdc=true", "-O3", "-DNDEBUG", "-Xptxas", "-v",
               f"-I{ROOT}", f"-I{include}", "-c", path, "-o", os.path.join(tmp, "k.o")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def kernels(report: str) -> list[dict]:
    """Our entry functions (namespace jax_ep) with their resource use."""
    rows, current = {}, None
    for line in report.splitlines():
        if match := ENTRY.search(line):
            if "jax_ep" in match.group(1):
                rows[match.group(1)] = {"kernel": match.group(1)}
        elif match := OWNER.search(line):  # the lines below belong to this function
            current = rows.get(match.group(1))
        elif current and (match := PROPS.search(line)):
            current.update(stack=int(match.group(1)), spill_stores=int(match.group(2)),
                           spill_loads=int(match.group(3)))
        elif current and (match := REGS.search(line)):
            current["registers"] = int(match.group(1))
    return list(rows.values())


def main() -> int:
    include = nvshmem_include()
    sources = sorted(f for f in os.listdir(os.path.join(ROOT, "cuda")) if f.endswith(".cu"))
    failed = False
    print(f"{'file':<12} {'kernel':<28} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6}")
    for name in sources:
        status, report = compile_report(os.path.join(ROOT, "cuda", name), include)
        if status != 0:
            print(f"{name}: does not compile\n{report}")
            failed = True
            continue
        for row in kernels(report):
            bad = row["spill_stores"] or row["spill_loads"] or row["stack"]
            failed |= bool(bad)
            print(f"{name:<12} {demangle(row['kernel']):<28} {row.get('registers', 0):>5} "
                  f"{row['spill_stores']:>9} {row['spill_loads']:>9} {row['stack']:>6}"
                  f"{'  <- spills or uses local memory' if bad else ''}")
    print("check_ptxas:", "FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
