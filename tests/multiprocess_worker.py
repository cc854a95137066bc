"""One process of the multi-process test: 4 CPU devices, joined through jax.distributed.

Usage: python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT SEED OUT.npz
Every process builds the same global inputs from SEED, runs the jax_ep ops over the
8 global devices, and process 0 writes the gathered outputs to OUT.npz.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402


def main() -> None:
    process_id, num_processes, port, seed, out = sys.argv[1:6]
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=int(num_processes),
        process_id=int(process_id),
        initialization_timeout=120,
    )
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import multiprocess_case

    outputs = multiprocess_case.run(int(seed))
    gathered = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
                for k, v in outputs.items()}
    if jax.process_index() == 0:
        np.savez(out, **gathered)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
