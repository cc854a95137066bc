"""The exchanges replayed, as XLA's command buffers run them on GPUs (CUDA graphs).

With $JAX_EP_CPU_REPLAY set when a program is traced, the CPU handlers between devices record
each exchange call's launches the first time it runs and replay them afterwards without the
op's host code (ffi/exchange_cpu.cc, host::record and host::replay), as a graph replays the
kernels XLA captured; like XLA, they record a call again when its buffers moved. So the ops
run in a lax.scan of 6 steps, as in a decode loop, where each call keeps its buffers from
step to step: recorded in the first, replayed in the next 5, on fresh inputs of every kind.
Every step must equal backend="xla" bit for bit, which fails if anything an op needs from
call to call (the arrival counts, the low-latency regions' records) were kept on the host,
and the meter must show the replays. tests/cpp/host_peers_test.cc replays every op under
ThreadSanitizer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import sharded, to_numpy
from test_host_peers import (  # noqa: F401 (host_peers: the fixture)
    assert_trees_bitwise,
    host_peers,
    normal_round,
    two_in_flight,
)
from test_virtual import routing

import jax_ep
from jax_ep import _ffi
from jax_ep.tools import reference

pytestmark = pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
RUNS = 6
KINDS = ["uniform", "masked", "duplicates", "empty_ranks", "hot_expert"]


@pytest.fixture(autouse=True)
def replays(monkeypatch):
    monkeypatch.setenv("JAX_EP_CPU_REPLAY", "1")
    _ffi.EXT.meter(reset=True)
    yield
    meter = _ffi.EXT.meter(reset=True)
    # Each call recorded once per device, in the first step, and replayed in every other.
    assert meter["recordings"] > 0, meter
    assert meter["replays"] == (RUNS - 1) * meter["recordings"], meter


def run_both(step, R, fresh_inputs):
    """`step(backend)(*per_shard_inputs)` in a scan over RUNS steps, each on fresh inputs
    ([R, ...] arrays from fresh_inputs(rng, kind)), on both backends."""
    rng = np.random.default_rng()
    steps = [fresh_inputs(rng, KINDS[i % len(KINDS)]) for i in range(RUNS)]
    # [R, RUNS, ...]: each shard scans over its own steps.
    inputs = [np.stack(arrays, axis=1) for arrays in zip(*steps, strict=True)]

    def program(backend):
        body = step(backend)
        return lambda *xs: jax.lax.scan(lambda carry, x: (carry, body(*x)), 0, xs)[1]

    got, want = (to_numpy(sharded(program(b), R)(*inputs)) for b in ("cuda", "xla"))
    assert_trees_bitwise(got, want)


@pytest.mark.parametrize("R", [3, 4])
@pytest.mark.parametrize("expert_major, fp8", [(False, False), (True, False), (False, True)])
def test_normal_ops_replayed(R, expert_major, fp8):
    T, K, E, H = 7, 3, 2 * R, 128
    full = R * T * min(K, E // R) if expert_major else R * T
    capacity = full - 2  # cuts the odd row

    def fresh_inputs(rng, kind):
        idx, w = routing(rng, R, T, K, E, kind, invalid=True)
        x = rng.standard_normal((R, T, H)).astype(np.float32)
        data = reference.quantize(x) if fp8 else (x.astype(ml_dtypes.bfloat16),)
        return (*data, idx, w)

    step = functools.partial(normal_round, E=E, capacity=capacity, expert_major=expert_major,
                             fp8=fp8)
    run_both(step, R, fresh_inputs)


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_replayed(R, use_fp8):
    """A fused round trip on buffer 0, then two split exchanges in flight, one per region."""
    T, K, E, H = 5, 3, 2 * R, 256

    def fresh_inputs(rng, kind):
        (idx_a, w_a), (idx_b, w_b) = (routing(rng, R, T, K, E, kind) for _ in "ab")
        x_a, x_b = (rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16) for _ in "ab")
        return x_a, x_b, idx_a, idx_b, w_a, w_b

    def step(backend):
        split = two_in_flight(backend, E=E, use_fp8=use_fp8)

        def per_shard(x_a, x_b, idx_a, idx_b, w_a, w_b):
            recv, handle = jax_ep.low_latency_dispatch(x_a, idx_a, num_experts=E,
                                                       use_fp8=use_fp8, backend=backend,
                                                       buffer=0)
            y = (recv.x.astype(jnp.float32) * 2).astype(jnp.bfloat16)
            fused = jax_ep.low_latency_combine(y, idx_a, w_a, handle, backend=backend)
            return fused, split(x_a, x_b, idx_a, idx_b, w_a, w_b)

        return per_shard

    run_both(step, R, fresh_inputs)
