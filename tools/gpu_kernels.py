"""Every kernel case on the GPU, in one process: `python3 tools/gpu_kernels.py [--json PATH]`.

Runs the cases of tests/gpu/test_gpu_kernels.py (tests/test_virtual.py's checks with
backend="cuda": the kernels against jax_ep.tools.reference, bit for bit) one after another in this
process, printing one line per case with the seed that reproduces it. A case that fails is run
again in a subprocess of its own (tests/gpu/gpu_case.py), so that a kernel fault that poisons
this process's CUDA context is told apart from a wrong result. Exits non-zero when no GPU is
visible, when jax_ep is imported from the source tree or lacks the CUDA kernels, or when any
case fails: a run that checked nothing cannot pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "gpu")]


def require_installed_gpu_build() -> None:
    """Exits unless jax_ep is the installed package with CUDA kernels and JAX sees a GPU."""
    import jax

    import jax_ep
    from jax_ep import _ffi

    where = os.path.dirname(os.path.abspath(jax_ep.__file__))
    problems = []
    if where.startswith(ROOT + os.sep):
        problems.append(f"jax_ep is imported from the source tree ({where}); run from elsewhere")
    if not _ffi.cuda_kernels_compiled():
        why = _ffi.IMPORT_ERROR or "built without CUDA"
        problems.append(f"jax_ep at {where} has no CUDA kernels ({why})")
    platforms = sorted({d.platform for d in jax.devices()})
    if "gpu" not in platforms:
        problems.append(f"no GPU visible to JAX (platforms {platforms})")
    if problems:
        sys.exit("gpu_kernels.py: error: " + "; ".join(problems))
    print(f"jax_ep {where}; {jax.devices()[0].device_kind}; jax {jax.__version__}; "
          f"{_ffi.EXT.build_info()}", flush=True)


def run_in_subprocess(name: str, kwargs: dict, seed: int, timeout: int = 300) -> str:
    command = [sys.executable, os.path.join(ROOT, "tests", "gpu", "gpu_case.py"), name,
               json.dumps(kwargs)]
    env = {**os.environ, "JAX_EP_TEST_SEED": str(seed)}  # the same inputs again
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return f"timeout after {timeout} s"
    return "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-1500:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write one record per case to this file")
    parser.add_argument("--check-install", action="store_true",
                        help="only check the installed build and the GPU, run no case")
    args = parser.parse_args()
    require_installed_gpu_build()
    if args.check_install:
        return 0
    import harness
    import test_virtual
    from test_gpu_kernels import CASES

    records = []
    for i, (name, kwargs) in enumerate(CASES):
        started = time.perf_counter()
        call = dict(kwargs)
        if "case" in call:
            call["case"] = tuple(call["case"])
        seed = harness.test_seed()
        record = {"test": name, "args": kwargs, "seed": seed}
        try:
            with harness.seeded_default_rng(seed):
                getattr(test_virtual, name)(**call)
            record["status"] = "ok"
        except Exception as error:  # noqa: BLE001  (every failure is reported, then retried)
            record["status"] = "failed"
            record["error"] = f"{type(error).__name__}: {error}"[:2000]
            record["traceback"] = traceback.format_exc()[-3000:]
            record["retry"] = run_in_subprocess(name, kwargs, seed)
        record["seconds"] = round(time.perf_counter() - started, 2)
        records.append(record)
        line = f"[{i + 1}/{len(CASES)}] {record['status']:<6} {record['seconds']:6.2f} s  {name} " \
               f"{json.dumps(kwargs, sort_keys=True)} seed {seed}"
        print(line, flush=True)
        if record["status"] != "ok":
            print("    " + record["error"].replace("\n", "\n    "), flush=True)
            print(f"    retried alone: {record['retry']}", flush=True)
    failed = [r for r in records if r["status"] != "ok"]
    print(f"kernel cases: {len(records) - len(failed)} passed, {len(failed)} failed "
          f"of {len(records)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 1 if failed or not records else 0


if __name__ == "__main__":
    sys.exit(main())
