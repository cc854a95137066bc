"""Small cases of every exchange kernel with virtual ranks, for compute-sanitizer.

Run: compute-sanitizer --tool memcheck --target-processes all python tools/gpu_sanitize_case.py
Each op runs once on tiny shapes (R = 2 and 3) and is checked against jax_ep.reference.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import test_virtual as tv  # noqa: E402

SMALL = [(2, 5, 2, 4, 16, "duplicates"), (3, 4, 3, 6, 8, "masked")]
SMALL_LL = [(2, 3, 2, 4, 128, "duplicates"), (3, 2, 3, 6, 128, "masked")]


def main() -> int:
    for case in SMALL:
        for em in (False, True):
            tv.test_dispatch_combine(backend="cuda", expert_major=em, case=case)
    for case in SMALL_LL:
        for fp8 in (False, True):
            tv.test_low_latency(backend="cuda", use_fp8=fp8, split=True, case=case)
    tv.test_layout(backend="cuda")
    print("sanitize cases: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
