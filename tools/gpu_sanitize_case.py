"""Small cases of every exchange kernel with virtual ranks, for compute-sanitizer.

Run: compute-sanitizer --tool memcheck --target-processes all python tools/gpu_sanitize_case.py
Each op runs once on tiny shapes (R = 2 and 3) and is checked against jax_ep.tools.reference. The
split low-latency ops run as one jitted program, as a step runs them: called one by one, XLA
copies the send's half-written buffers into the receive's outputs, which initcheck reports as
reads of uninitialized memory.
"""

from __future__ import annotations

import os
import sys

import jax
import ml_dtypes
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import test_virtual as tv  # noqa: E402

from jax_ep import virtual  # noqa: E402
from jax_ep.tools import reference  # noqa: E402

SMALL = [(2, 5, 2, 4, 16, "duplicates"), (3, 4, 3, 6, 8, "masked")]
SMALL_LL = [(2, 3, 2, 4, 128, "duplicates"), (3, 2, 3, 6, 128, "masked")]


def low_latency_round_trip(case, use_fp8: bool, rng) -> None:
    R, T, K, E, H, kind = case
    idx, w = tv.routing(rng, R, T, K, E, kind, invalid=True)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)

    # The expert outputs come from the host: only jax_ep's kernels are instrumented, so
    # initcheck would not see XLA's kernels write them.
    y = rng.standard_normal((R, E // R, R * T, H)).astype(ml_dtypes.bfloat16)

    def step(x, idx, w, y):
        pending = virtual.low_latency_dispatch_send(x, idx, num_experts=E, use_fp8=use_fp8)
        recv, handle = virtual.low_latency_dispatch_recv(pending)
        out = virtual.low_latency_combine_recv(
            virtual.low_latency_combine_send(y, idx, w, handle))
        return recv, out

    recv, out = jax.jit(step)(x, idx, w, y)
    recv = recv.with_zero_padding()
    want = reference.low_latency_dispatch(x, idx, num_experts=E, use_fp8=use_fp8)
    for key in ("x", "count", "num_invalid"):
        tv.assert_bitwise(getattr(recv, key), want[key], f"ll dispatch {key}")
    tv.assert_bitwise(out, reference.low_latency_combine(y, idx, w, num_experts=E), "ll combine")


def main() -> int:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"sanitize cases: seed {seed}", flush=True)
    rng = np.random.default_rng(seed)
    for case in SMALL:
        for em in (False, True):
            tv.test_dispatch_combine(backend="cuda", expert_major=em, case=case)
    for case in SMALL_LL:
        for fp8 in (False, True):
            low_latency_round_trip(case, fp8, rng)
    tv.test_layout(backend="cuda")
    print("sanitize cases: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
