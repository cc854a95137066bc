"""The CUDA kernels on a GPU against the NumPy reference, bit for bit (virtual ranks).

Each case runs tests/test_virtual.py's check with backend="cuda" in a subprocess with a
timeout, so that a hung or trapping kernel fails its case, not the suite. Skipped cleanly
where no GPU is visible or jax_ep was built without CUDA.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import test_virtual as tv

from jax_ep import _ffi

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 300


def _gpu_env() -> dict[str, str]:
    """This environment without the CPU-only settings of tests/conftest.py."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


@functools.cache
def _why_no_gpu() -> str | None:
    if not _ffi.cuda_kernels_compiled():
        return "jax_ep was built without the CUDA kernels"
    probe = "import jax; print(any(d.platform == 'gpu' for d in jax.devices()))"
    try:
        out = subprocess.run([sys.executable, "-c", probe], env=_gpu_env(), capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"probing for a GPU failed: {error}"
    return None if out.stdout.strip().endswith("True") else "no GPU visible to JAX"


def _cases():
    for case in tv.CASES:
        for em in (False, True):
            yield "test_dispatch_combine", {"backend": "cuda", "expert_major": em, "case": case}
    for em in (False, True):
        yield "test_handles_match_portable_backend", {"expert_major": em}
        yield "test_dispatch_fp8_pair", {"backend": "cuda", "expert_major": em}
    for case in tv.LL_CASES:
        for fp8 in (False, True):
            for split in (False, True):
                yield "test_low_latency", {"backend": "cuda", "use_fp8": fp8, "split": split,
                                           "case": case}
    for format in ("e4m3", "e4m3_ue8m0", "mxfp8", "nvfp4"):
        yield "test_low_latency_wire_format", {"backend": "cuda", "format": format,
                                               "split": format == "nvfp4"}
    yield "test_layout", {"backend": "cuda"}


CASES = list(_cases())


@pytest.mark.gpu
@pytest.mark.parametrize("name, kwargs", CASES,
                         ids=[f"{n}-{json.dumps(k, sort_keys=True)}" for n, k in CASES])
def test_kernel_case_on_gpu(name, kwargs):
    why = _why_no_gpu()
    if why:
        pytest.skip(why)
    command = [sys.executable, os.path.join(HERE, "gpu_case.py"), name, json.dumps(kwargs)]
    # The case's inputs follow this test's seed (printed when it fails).
    env = {**_gpu_env(), "JAX_EP_TEST_SEED": str(np.random.default_rng().integers(2**32))}
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} {kwargs}: no result within {TIMEOUT_S} s (a hung kernel?)")
    assert proc.returncode == 0, f"{name} {kwargs}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
