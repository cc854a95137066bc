"""The xla backend's ragged transport on one GPU (R = 1): XLA's own ragged_all_to_all.

Run: python tools/gpu_ragged_case.py
Each case runs dispatch + combine with their gradients and the low-latency round trip
(tests/test_ragged.py's program) through both transports and compares every output bit for
bit (the weights' gradient to float32 rounding); the lowered program must hold
ragged_all_to_all. Prints one "ok" line per case.
"""

from __future__ import annotations

import os
import sys

import jax
import ml_dtypes
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import test_ragged as tr  # noqa: E402
from harness import mesh, sharded, to_numpy  # noqa: E402
from test_dispatch import _assert_bitwise  # noqa: E402

from jax_ep.backends import xla  # noqa: E402
from jax_ep.tools.bench import suite  # noqa: E402
from jax_ep.tools.bench.routings import make_routing  # noqa: E402

# (T, K, E, kind, capacity, expert_major, FP8)
CASES = [(37, 3, 12, "hot_expert", None, False, False), (37, 3, 12, "duplicates", 20, True, False),
         (21, 4, 9, "masked", None, True, True)]
# The gradient of the weights, a dot over H whose summation order docs/contract.md leaves open
# ("Backward"): XLA's GPU reductions take an order that depends on the program's fusions.
WEIGHT_GRADIENT = "[2][1]"


def main() -> None:
    platform = jax.devices()[0].platform
    if platform != "gpu":
        sys.exit(f"gpu_ragged_case.py: error: needs a GPU; JAX sees {platform}.")
    rng = np.random.default_rng(0)
    for T, K, E, kind, capacity, expert_major, use_fp8 in CASES:
        idx, w = make_routing(rng, num_ranks=1, num_tokens=T, top_k=K, num_experts=E, kind=kind)
        x = rng.standard_normal((1, T, 128)).astype(np.float32)
        args = (x, idx, w, x.astype(ml_dtypes.bfloat16))
        results = {}
        for name in xla.TRANSPORTS:
            os.environ[xla.TRANSPORT_ENV_VAR] = name
            program = tr._program(E, capacity, expert_major, use_fp8=use_fp8)
            results[name] = to_numpy(sharded(program, 1)(*args))
            if name == "ragged":  # (XLA may turn an exchange with one rank into a copy)
                with jax.set_mesh(mesh(1)):
                    lowered = jax.jit(suite.stacked_shard_map(program, mesh(1))).lower(
                        *suite.put(mesh(1), args))
                assert "ragged_all_to_all" in lowered.as_text(), "lowered without it"
        leaves = jax.tree_util.tree_leaves_with_path(results["all_gather"])
        for (path, want), got in zip(leaves, jax.tree.leaves(results["ragged"]), strict=True):
            what = jax.tree_util.keystr(path)
            if what == WEIGHT_GRADIENT:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)
            else:
                _assert_bitwise(got, want, what)
        print(f"ok: T={T} K={K} E={E} {kind} capacity={capacity} expert_major={expert_major} "
              f"fp8={use_fp8}: ragged == all_gather, bit for bit")


if __name__ == "__main__":
    main()
