"""One process of the peer-loss test: runs jax_ep steps between 2 processes until its peer
dies (process 1 exits after step 2).

Usage: python peer_loss_worker.py PROCESS_ID PORT HEARTBEAT_SECONDS
Prints "step N" after each step; the survivor must end (JAX's distributed service aborts it
once the peer misses its heartbeats), never hang.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402


def main() -> None:
    process_id, port, heartbeat = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=120,
                               heartbeat_timeout_seconds=heartbeat)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import multiprocess_case

    for step in range(1000):
        if process_id == 1 and step == 2:
            os._exit(0)  # dies without a word to its peer
        jax.block_until_ready(multiprocess_case.run(step))
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    main()
