"""One GPU test case, run in its own process: `python gpu_case.py TEST_NAME JSON_KWARGS`.

Runs a test function of tests/test_virtual.py (the kernels against jax_ep.tools.reference, bit for
bit) on the GPU with the cuda backend. Its own process, so that a hung or trapping kernel
fails this case only; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for test_virtual


def main(name: str, kwargs: str) -> int:
    import jax

    platforms = {d.platform for d in jax.devices()}
    if "gpu" not in platforms:
        print(f"no GPU visible to JAX (platforms: {sorted(platforms)})", file=sys.stderr)
        return 2
    import harness
    import test_virtual

    args = json.loads(kwargs)
    if "case" in args:
        args["case"] = tuple(args["case"])
    seed = harness.test_seed()  # JAX_EP_TEST_SEED reruns the inputs of a failure
    with harness.seeded_default_rng(seed):
        getattr(test_virtual, name)(**args)
    print(json.dumps({"test": name, "args": args, "seed": seed, "ok": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
