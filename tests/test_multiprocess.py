"""2 processes x 4 CPU devices through jax.distributed on 127.0.0.1 give the same bits as one
process with 8 devices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import multiprocess_case
import numpy as np
import pytest
from harness import to_numpy

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    seed = int(np.random.default_rng().integers(2**31))
    port = _free_port()
    out = tmp_path / "out.npz"
    # Several CPU processes exchange through XLA only (host peers live in one process), so
    # a JAX_EP_BACKEND=cuda run does not apply here.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_EP_BACKEND")}
    env["PYTHONPATH"] = HERE  # the harness; jax_ep itself comes from the installation
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "multiprocess_worker.py"), str(pid), "2",
             str(port), str(seed), str(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for pid in range(2)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("multi-process run timed out:\n" + "\n".join(logs))
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]

    multi = np.load(out)
    single = to_numpy(multiprocess_case.run(seed))
    for key, want in single.items():
        got = multi[key]
        assert got.shape == want.shape, key
        np.testing.assert_array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8),
                                      err_msg=key)


@pytest.mark.slow
def test_a_lost_peer_ends_the_survivor_instead_of_hanging(tmp_path):
    """Process 1 dies after two steps; process 0, in the middle of the next step's exchanges,
    is ended by JAX's distributed service once the heartbeats stop (README, "Between GPUs")."""
    heartbeat = 5
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_EP_BACKEND")}
    env["PYTHONPATH"] = HERE
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(HERE, "peer_loss_worker.py"), str(pid), str(port),
         str(heartbeat)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for pid in range(2)]
    try:
        survivor_log = procs[0].communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        pytest.fail("the survivor hung after its peer died")
    finally:
        for p in procs:
            p.kill()
    assert "step 1" in survivor_log, survivor_log[-3000:]  # it ran before the loss ...
    assert procs[0].returncode != 0, survivor_log[-3000:]  # ... and was ended after it
