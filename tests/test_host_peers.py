"""backend="cuda" between the CPU devices of this process: host peers (cuda/host_peers.h).

After jax_ep.initialize() on CPU, each device of a shard_map runs its own rank of every
exchange (V = 1, first_rank = its EP index) through the ops of cuda/peer_ops.h, the code the
GPUs run between each other: the symmetric buffer's carving, the barriers, the phases with
peer addresses. Every op must give results bitwise equal to backend="xla" at R in
{2, 3, 4, 8}; gradients to the last bits XLA's own arithmetic allows (test_cuda_backend.py).
"""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import HOST_PEER_BYTES, HOST_PEER_LOW_LATENCY_BYTES, initialize_host_peers
from harness import compiled_text, forget_failed_exchange, sharded, to_numpy, two_group_axes
from test_cuda_backend import gradient_program
from test_virtual import assert_bitwise, routing

import jax_ep
from jax_ep import _ffi, runtime
from jax_ep.tools import reference

pytestmark = pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
RANKS = [2, 3, 4, 8]
MODES = [(False, False), (True, False), (False, True)]  # (expert_major, fp8)


def drawn_mode():
    """One of MODES, drawn from the test's seed: where the transport, not the layout or the
    row format, is what a test varies, each mode over runs for a third of the cost."""
    return MODES[np.random.default_rng().integers(len(MODES))]


@pytest.fixture(scope="module", autouse=True)
def host_peers():
    if runtime.is_initialized():  # the session's (JAX_EP_BACKEND=cuda)
        yield
        return
    initialize_for_tests()
    yield
    jax_ep.finalize()


def initialize_for_tests():
    initialize_host_peers()


def assert_trees_bitwise(got, want):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        assert_bitwise(g, w, jax.tree_util.keystr(path))


def both_backends(program, R, *args):
    return [to_numpy(sharded(program(backend), R)(*args)) for backend in ("cuda", "xla")]


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("expert_major, fp8", MODES)
def test_normal_ops_match_portable_backend(R, expert_major, fp8):
    rng = np.random.default_rng()
    T, K, E, H = int(rng.integers(5, 14)), 3, 2 * R, 128
    kind = str(rng.choice(["uniform", "hot_expert", "empty_ranks", "duplicates"]))
    idx, w = routing(rng, R, T, K, E, kind, invalid=True)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    data = reference.quantize(x) if fp8 else (x.astype(ml_dtypes.bfloat16),)
    full = R * T * min(K, E // R) if expert_major else R * T
    capacity = int(rng.integers(max(1, full // 3), full + 1))  # often cuts

    program = functools.partial(normal_round, E=E, capacity=capacity,
                                expert_major=expert_major, fp8=fp8)
    got, want = both_backends(program, R, *data, idx, w)
    assert_trees_bitwise(got, want)


def normal_round(backend, *, E, capacity, expert_major, fp8):
    """Per shard: dispatch (data, idx, w), then combine the received rows (FP8 ones scaled)."""
    def per_shard(*args):
        *data, idx, w = args
        recv, handle = jax_ep.dispatch(tuple(data) if fp8 else data[0], idx, w,
                                       num_experts=E, capacity=capacity,
                                       expert_major=expert_major, on_overflow="drop",
                                       on_invalid="mask", backend=backend)
        rows = recv.x.astype(jnp.float32) * 0.5 if fp8 else recv.x
        weights = recv.topk_weights if expert_major else None
        out = jax_ep.combine(rows, handle, topk_weights=weights, backend=backend)
        return recv.with_zero_padding(), out

    return per_shard


@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_split_matches_portable_backend(R, use_fp8):
    rng = np.random.default_rng()
    T, K, E, H = int(rng.integers(3, 9)), 3, 2 * R, 256
    idx, w = routing(rng, R, T, K, E, "duplicates")
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)

    def program(backend):
        def per_shard(x, idx, w):
            pending = jax_ep.low_latency_dispatch_send(x, idx, num_experts=E, use_fp8=use_fp8,
                                                       backend=backend)
            recv, handle = jax_ep.low_latency_dispatch_recv(pending)
            y = (recv.x.astype(jnp.float32) * 2).astype(jnp.bfloat16)
            sent = jax_ep.low_latency_combine_send(y, idx, w, handle, backend=backend)
            return recv.with_zero_padding(), jax_ep.low_latency_combine_recv(sent)

        return per_shard

    got, want = both_backends(program, R, x, idx, w)
    assert_trees_bitwise(got, want)


@pytest.mark.parametrize("R", [2, 3])
def test_low_latency_past_the_sends_own_count(R):
    """Above 4,096 routing entries per rank the send no longer numbers its own messages: a
    count launch does (cuda/exchange.h, kSendCountEntries); both sides of the bound."""
    rng = np.random.default_rng()
    K, E, H = 8, 4 * R, 128

    def program(backend):
        def per_shard(x, idx, w):
            recv, handle = jax_ep.low_latency_dispatch(x, idx, num_experts=E, backend=backend)
            y = (recv.x.astype(jnp.float32) * 2).astype(jnp.bfloat16)
            out = jax_ep.low_latency_combine(y, idx, w, handle, backend=backend)
            return recv.with_zero_padding(), out

        return per_shard

    for T in (4096 // K, 4096 // K + int(rng.integers(1, 9))):
        idx, w = routing(rng, R, T, K, E, "duplicates", invalid=True)
        x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
        got, want = both_backends(program, R, x, idx, w)
        assert_trees_bitwise(got, want)


@pytest.mark.parametrize("R", [2, 3])
def test_two_low_latency_exchanges_in_flight_on_the_two_regions(R):
    """Micro-batches a and b: a's send, b's send, a's receive, b's receive, then their
    combines the same way. Each uses its own low-latency region, so b's send waits only for
    the last call on its region, never for a's receive; the results are the portable
    backend's."""
    rng = np.random.default_rng()
    T, K, E, H = int(rng.integers(3, 7)), 2, 2 * R, 256
    idx_a, w_a = routing(rng, R, T, K, E, "hot_expert")
    idx_b, w_b = routing(rng, R, T, K, E, "masked")
    x_a, x_b = (rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16) for _ in "ab")

    def program(backend):
        def per_shard(x_a, x_b, idx_a, idx_b, w_a, w_b):
            sent = [jax_ep.low_latency_dispatch_send(x, idx, num_experts=E, backend=backend,
                                                     buffer=b)
                    for b, (x, idx) in enumerate(((x_a, idx_a), (x_b, idx_b)))]
            received = [jax_ep.low_latency_dispatch_recv(p) for p in sent]
            routings = zip(received, (idx_a, idx_b), (w_a, w_b), strict=True)
            staged = [jax_ep.low_latency_combine_send(recv.x * 3, idx, w, handle,
                                                      backend=backend)
                      for (recv, handle), idx, w in routings]
            return ([recv.with_zero_padding() for recv, _ in received],
                    [jax_ep.low_latency_combine_recv(s) for s in staged])

        return per_shard

    got, want = both_backends(program, R, x_a, x_b, idx_a, idx_b, w_a, w_b)
    assert_trees_bitwise(got, want)


# (streamed, access, replayed): each of the four once, and each pair of them.
REFUSALS = [(False, "store", False), (True, "store", True), (False, "put", True),
            (True, "put", False)]


@pytest.mark.parametrize("streamed, access, replayed", REFUSALS,
                         ids=[f"{'streamed' if s else 'phased'}-{a}s{'-replayed' if r else ''}"
                              for s, a, r in REFUSALS])
def test_a_dispatch_sent_on_a_buffer_in_flight_fails_every_rank(monkeypatch, streamed, access,
                                                                  replayed):
    """Two dispatches sent on one low-latency buffer before either is received: the second
    would overwrite the first's messages, so its own launches refuse it on every rank, as on a
    GPU (the send returns; the rank's status word holds the refusal), and the next exchange
    of every rank (here a dispatch and combine, phased or streamed, over stores or puts, run
    or replayed) reports it, naming the fix: the program returns nothing. The group stays
    unusable, and later programs fail with the same error, until jax_ep is initialized again;
    then the same step on the two buffers (each exchange received at the end) runs and
    matches the portable backend."""
    if replayed:
        monkeypatch.setenv("JAX_EP_CPU_REPLAY", "1")
    R, T, K, E, H = 4, 6, 2, 8, 128
    rng = np.random.default_rng()
    idx, w = routing(rng, R, T, K, E, "uniform")
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)

    def program(buffers, backend="cuda"):
        def per_shard(x, idx, w):
            # Both sends, then a dispatch and combine, then the receives.
            sent = [jax_ep.low_latency_dispatch_send(x, idx, num_experts=E, backend=backend,
                                                     buffer=b) for b in buffers]
            recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, backend=backend)
            out = jax_ep.combine(recv.x, handle, backend=backend)
            return out, [jax_ep.low_latency_dispatch_recv(p)[0].count for p in sent]

        return per_shard

    refused = (r"jax_ep_dispatch: an earlier call of jax_ep_ll_dispatch_send: low-latency "
               r"buffer 0 still holds an exchange that was sent and not yet received; call "
               r"low_latency_dispatch_recv on it .* or send this one on buffer 1 .*the EP "
               r"group is unusable, call jax_ep.finalize\(\) and jax_ep.initialize\(\) again")
    with host_peers_with(monkeypatch, JAX_EP_PEER_ACCESS=access,
                         JAX_EP_CHANNELS="2,1,2" if streamed else "off") as state:
        assert (state["channels"] is not None) == streamed
        with pytest.raises(Exception, match=refused):
            jax.block_until_ready(sharded(program((0, 0)), R)(x, idx, w))
        with pytest.raises(Exception, match="low-latency buffer 0 still holds"):
            jax.block_until_ready(sharded(program((0, 1)), R)(x, idx, w))
        jax_ep.finalize()
        jax_ep.initialize(buffer_bytes=state["buffer_bytes"],
                          low_latency_bytes=state["low_latency_bytes"])
        got = to_numpy(sharded(program((0, 1)), R)(x, idx, w))
    want = to_numpy(sharded(program((0, 1), "xla"), R)(x, idx, w))
    assert_trees_bitwise(got, want)


@pytest.mark.parametrize("R", [3, 8])
@pytest.mark.parametrize("expert_major", [False, True])
def test_gradients_match_portable_backend(R, expert_major):
    rng = np.random.default_rng()
    T, K, E, H = 7, 2, 2 * R, 16
    idx, w = routing(rng, R, T, K, E, "masked")
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    target = rng.standard_normal((R, T, H)).astype(np.float32)

    program = functools.partial(gradient_program, E=E, expert_major=expert_major)
    (gx, gw), (want_x, want_w) = both_backends(program, R, x, w, idx, target)
    np.testing.assert_allclose(gx, want_x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gw, want_w, rtol=1e-5, atol=1e-5)


def test_a_call_larger_than_the_buffer_says_how_to_grow():
    if runtime.state()["buffer_bytes"] != HOST_PEER_BYTES:
        pytest.skip("another buffer size is set up")
    R, T, K, E, H = 2, 64, 2, 4, 4096  # 2*64 rows of 16 KiB: 2 MiB of rows, over 1 MiB
    rng = np.random.default_rng()
    idx, w = routing(rng, R, T, K, E, "uniform")
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    jax_ep.finalize()
    jax_ep.initialize(buffer_bytes=1 << 20)
    try:
        run = sharded(lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=E, backend="cuda")[0]
                      .with_zero_padding().x, R)
        with pytest.raises(Exception, match=r"jax_ep_dispatch: needs \d+ bytes of normal-mode "
                                            r"region in the symmetric buffer, but "
                                            r"jax_ep.initialize\(\) reserved \d+.*BufferConfig"):
            jax.block_until_ready(run(x, idx, w))
    finally:
        forget_failed_exchange()
        jax_ep.finalize()
        initialize_for_tests()
    # Large enough now.
    got = np.asarray(run(x, idx, w))
    want = np.asarray(sharded(lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=E,
                                                              backend="xla")[0].x, R)(x, idx, w))
    assert_bitwise(got, want, "x after initialize() with a larger buffer")


def test_normal_calls_never_reach_a_low_latency_exchange_in_flight():
    """The low-latency regions have their own part of the buffer: a normal-mode call larger
    than its own part fails rather than overwrite a split low-latency dispatch in flight."""
    if runtime.state()["buffer_bytes"] != HOST_PEER_BYTES:
        pytest.skip("another buffer size is set up")
    R, T, K, E, H = 2, 4, 2, 4, 256
    config = jax_ep.BufferConfig(num_tokens=T, hidden=H, top_k=K, num_experts=E, num_ranks=R,
                                 low_latency_tokens=64, channels=None)  # in phases
    regions = runtime.buffer_regions(config)
    assert regions["low_latency"] > 4 * regions["normal"]  # room for a much larger call
    rng = np.random.default_rng()
    idx, w = routing(rng, R, T, K, E, "uniform")
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    big_idx, big_w = routing(rng, R, 4 * T, K, E, "uniform")
    big_x = rng.standard_normal((R, 4 * T, H)).astype(np.float32)

    def program(backend, big):
        def per_shard(x, idx, w, big_x, big_idx, big_w):
            pending = jax_ep.low_latency_dispatch_send(x, idx, num_experts=E, backend=backend)
            n_x, n_idx, n_w = (big_x, big_idx, big_w) if big else (x, idx, w)
            recv, _ = jax_ep.dispatch(n_x, n_idx, n_w, num_experts=E, backend=backend)
            ll, _ = jax_ep.low_latency_dispatch_recv(pending)
            return recv.with_zero_padding().x, ll.with_zero_padding()

        return per_shard

    jax_ep.finalize()
    jax_ep.initialize(config)
    try:
        args = (x, idx, w, big_x, big_idx, big_w)
        got, want = (to_numpy(sharded(program(b, big=False), R)(*args)) for b in ("cuda", "xla"))
        assert_trees_bitwise(got, want)  # a call that fits, between the halves
        with pytest.raises(Exception, match=r"jax_ep_dispatch: needs \d+ bytes of normal-mode "
                                            r"region"):
            jax.block_until_ready(sharded(program("cuda", big=True), R)(*args))
        forget_failed_exchange()
    finally:
        jax_ep.finalize()
        initialize_for_tests()


# Peers reached by puts only ($JAX_EP_PEER_ACCESS=put: HostPutPeers, cuda/host_peers.cc): no
# phase gets a pointer into a peer's buffer, each send copies what it sends into a send area
# of its own buffer and puts it from there, combine returns the rows to the homes instead of
# being read, and a phase that read another rank's buffer, or put from outside its own, would
# abort the process.


@contextlib.contextmanager
def host_peers_with(monkeypatch, **env: str):
    """Host peers initialized with these environment variables for one test (their state),
    then the module's again."""
    jax_ep.finalize()
    if "JAX_EP_CHANNELS" not in env:  # the dispatch in phases unless the test streams it
        monkeypatch.setenv("JAX_EP_CHANNELS", "off")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    jax_ep.initialize(buffer_bytes=HOST_PEER_BYTES, low_latency_bytes=HOST_PEER_LOW_LATENCY_BYTES)
    try:
        yield runtime.state()
    finally:
        jax_ep.finalize()
        monkeypatch.undo()
        initialize_for_tests()


@pytest.fixture
def put_peers(monkeypatch):
    """Host peers reached by puts for one test."""
    with host_peers_with(monkeypatch, JAX_EP_PEER_ACCESS="put") as state:
        assert state["peer_access"] == "put"
        yield


@pytest.mark.parametrize("R", RANKS)
def test_low_latency_over_puts_matches_portable_backend(put_peers, R, use_fp8=None):
    """Two exchanges in flight, one on each low-latency region, with fresh routings of every
    kind (masked choices, duplicates, empty ranks, a hot expert) and T not a power of two;
    FP8 or not drawn from the seed unless given."""
    rng = np.random.default_rng()
    if use_fp8 is None:
        use_fp8 = bool(rng.integers(2))
    T, K, E, H = int(rng.integers(3, 12)), 3, 2 * R, 256
    kinds = rng.choice(["uniform", "masked", "duplicates", "empty_ranks", "hot_expert"], 2,
                       replace=False)
    (idx_a, w_a), (idx_b, w_b) = (routing(rng, R, T, K, E, str(kind)) for kind in kinds)
    x_a, x_b = (rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16) for _ in "ab")

    program = functools.partial(two_in_flight, E=E, use_fp8=use_fp8)
    got, want = both_backends(program, R, x_a, x_b, idx_a, idx_b, w_a, w_b)
    assert_trees_bitwise(got, want)


def two_in_flight(backend, *, E, use_fp8):
    """Per shard: two split low-latency round trips, one on each region, both sent before
    either is received."""
    def per_shard(x_a, x_b, idx_a, idx_b, w_a, w_b):
        sent = [jax_ep.low_latency_dispatch_send(x, idx, num_experts=E, use_fp8=use_fp8,
                                                 backend=backend, buffer=b)
                for b, (x, idx) in enumerate(((x_a, idx_a), (x_b, idx_b)))]
        received = [jax_ep.low_latency_dispatch_recv(p) for p in sent]
        staged = []
        for (recv, handle), idx, w in zip(received, (idx_a, idx_b), (w_a, w_b), strict=True):
            y = (recv.x.astype(jnp.float32) * 3).astype(jnp.bfloat16)
            staged.append(jax_ep.low_latency_combine_send(y, idx, w, handle, backend=backend))
        return ([recv.with_zero_padding() for recv, _ in received],
                [jax_ep.low_latency_combine_recv(s) for s in staged])

    return per_shard


@pytest.mark.parametrize("R", RANKS)
def test_normal_ops_over_puts_match_portable_backend(put_peers, R):
    """Dispatch puts the rows from the send area; combine has the receivers return their rows
    (or partial sums) to the homes, which sum them in rank order as with stores."""
    test_normal_ops_match_portable_backend(R, *drawn_mode())


def test_peer_access_sizes_the_send_areas(monkeypatch):
    monkeypatch.delenv("JAX_EP_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("JAX_EP_CHANNELS", raising=False)
    R, T, K, H = 4, 24, 4, 256
    config = jax_ep.BufferConfig(num_tokens=16, hidden=H, top_k=K, num_experts=8, num_ranks=R,
                                 low_latency_tokens=T, channels=None)
    store, put = (runtime.buffer_regions(config, access=a) for a in ("store", "put"))
    # Per half: each token's bf16 row (the FP8 call's rows and scales are smaller) and the rows
    # returned to each source (multiples of 256 bytes here, so no alignment padding).
    send = T * 2 * H + R * T * K * H * 2
    assert put["low_latency"] - store["low_latency"] == 2 * send
    # Normal mode: the largest call is now combine's, whose R*T staged rows, weights and
    # src_row come back as R*T returned rows, weights and row flags (each piece 256 bytes
    # aligned here); with stores the dispatch was larger.
    combine = R * 16 * (2 * H + 4 + 4)
    assert put["normal"] == 2 * combine and store["normal"] > combine
    monkeypatch.setenv("JAX_EP_PEER_ACCESS", "put")
    assert runtime.buffer_regions(config) == put
    monkeypatch.setenv("JAX_EP_PEER_ACCESS", "loads")
    with pytest.raises(ValueError, match=r"\$JAX_EP_PEER_ACCESS='loads' is not one of "
                                         r"\('store', 'put'\)"):
        runtime.buffer_regions(config)


# Channels ($JAX_EP_CHANNELS): the rank-major dispatch and combine streamed through rings a
# few slots deep (cuda/channels.h), so that every ring wraps around many times; expert-major
# runs in phases beside them.


@pytest.fixture(params=[("store", "2,1,2", 0), ("put", "3,2,2", 0), ("put", "1,3,1,3", 0),
                        ("put", "2,1,2", 3), ("put", "1,2,2,4", 2)],
                ids=lambda p: f"{p[0]}s, rings {p[1]}" + (f", nodes of {p[2]}" if p[2] else ""))
def streamed_peers(request, monkeypatch):
    """Host peers whose dispatch streams through tiny rings, over stores or puts, in one node
    or through relays in nodes of 2 or 3; with the grid's warps per role and channel, or 3 or
    4 of them (Channels.warps: senders that split a token's destinations unevenly, receivers
    that split the rings, combine senders that split the homes)."""
    access, rings, nodes = request.param
    with host_peers_with(monkeypatch, JAX_EP_PEER_ACCESS=access, JAX_EP_CHANNELS=rings,
                         **({"JAX_EP_RANKS_PER_NODE": str(nodes)} if nodes else {})) as state:
        assert state["channels"] == runtime.Channels(*map(int, rings.split(",")))
        yield


@pytest.mark.parametrize("R", [2, 3, 8])
@pytest.mark.parametrize("fp8", [False, True])
def test_streamed_ops_match_portable_backend(streamed_peers, R, fp8):
    test_normal_ops_match_portable_backend(R, False, fp8)


@pytest.mark.parametrize("R", [3, 8])
def test_streamed_ops_of_everything_to_one_rank(streamed_peers, R):
    """Every choice on rank 1's experts: its rings from every source fill and wrap while
    the other receivers' stay empty, and back home only rank 1's rings carry rows; T is not
    a multiple of any chunk."""
    rng = np.random.default_rng()
    T, K, E, H = 37, 2, 2 * R, 128
    idx = rng.choice([2, 3], size=(R, T, K)).astype(np.int32)
    idx[:, ::5, 1] = -1  # masked choices too
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)

    def program(backend):
        def per_shard(x, idx, w):
            recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, capacity=R * T,
                                           backend=backend)
            return recv.with_zero_padding(), jax_ep.combine(recv.x, handle, backend=backend)

        return per_shard

    got, want = both_backends(program, R, x, idx, w)
    assert_trees_bitwise(got, want)
    assert int(got[0].num_tokens[1]) == R * T


def streamed_messages(monkeypatch, rings, x, idx, w, E, **env):
    """The messages over puts of a streamed dispatch, and of it and its combine, less the
    count's totals (a put of each rank's row of R + E to every other rank)."""
    R = x.shape[0]

    def program(combine):
        def per_shard(x, idx, w):
            recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, backend="cuda")
            return jax_ep.combine(recv.x, handle, backend="cuda") if combine else recv.x

        return sharded(per_shard, R)

    with host_peers_with(monkeypatch, JAX_EP_PEER_ACCESS="put",
                         JAX_EP_CHANNELS=f"{rings.channels},{rings.chunk_tokens},"
                                         f"{rings.ring_chunks}", **env):
        counted = []
        for combine in (False, True):
            run = program(combine)
            jax.block_until_ready(run(x, idx, w))  # compiled
            _ffi.EXT.meter(reset=True)
            jax.block_until_ready(run(x, idx, w))
            counted.append(_ffi.EXT.meter(reset=True)["messages"] - R * (R - 1))
    return counted


def test_streamed_ops_send_one_message_per_chunk(monkeypatch):
    """Over puts, rings deep enough that no sender waits: each (channel, sender, receiver)
    stream of n rows is floor(n / chunk) puts with their signals plus its close; its receiver
    returns its head once per chunk and once for the rest, ceil(n / chunk) signals (each adds
    the slots consumed since the last: none for none). The dispatch's count also puts each
    rank's row of R + E totals to every other rank. The CPU meter counts every put and
    signal."""
    if two_group_axes():
        pytest.skip("counts the messages of one EP group")
    R, T, K, E, H = 4, 64, 4, 16, 128
    rings = runtime.Channels(2, 8, 8)
    rng = np.random.default_rng()
    idx, w = routing(rng, R, T, K, E, "masked")
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    first = [c * T // rings.channels for c in range(rings.channels + 1)]
    goes = np.zeros((R, T, R), bool)  # token t of source s has a row on rank d
    for e in range(E):
        goes[..., e // (E // R)] |= (idx == e).any(-1)
    n = np.stack([goes[:, first[c]:first[c + 1]].sum(1) for c in range(rings.channels)])
    assert n.max() <= rings.slots()  # no sender waits for space
    streams = int((n // rings.chunk_tokens + 1).sum())
    heads = int((-(-n // rings.chunk_tokens)).sum())

    dispatch, both = streamed_messages(monkeypatch, rings, x, idx, w, E)
    assert dispatch == both - dispatch == streams + heads  # the combine: the same streams back
    assert both < 2 * goes.sum()  # fewer than one message per row and op


@pytest.mark.parametrize("access", ["store", "put"])
def test_the_default_channels_match_portable_backend(monkeypatch, access):
    """The default Channels() (40 x 4 x 3; the suite's host peers stream through smaller
    rings, conftest.TEST_CHANNELS): dispatch, FP8 dispatch and combine at R 8, bit for bit."""
    R, T, K, E, H = 8, 37, 4, 16, 128  # more tokens than channels: some hold 2
    rng = np.random.default_rng()
    idx, w = routing(rng, R, T, K, E, "hot_expert", invalid=True)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    pair = reference.quantize(x)

    def program(backend):
        def per_shard(x, x_fp8, scales, idx, w):
            recv, handle = jax_ep.dispatch(x.astype(jnp.bfloat16), idx, w, num_experts=E,
                                           on_invalid="mask", backend=backend)
            recv8, _ = jax_ep.dispatch((x_fp8, scales), idx, w, num_experts=E,
                                       on_invalid="mask", backend=backend)
            out = jax_ep.combine(recv.x, handle, backend=backend)
            return recv.with_zero_padding(), recv8.with_zero_padding(), out

        return per_shard

    with host_peers_with(monkeypatch, JAX_EP_PEER_ACCESS=access, JAX_EP_CHANNELS="40,4,3"):
        assert runtime.channels() == runtime.Channels()
        got, want = both_backends(program, R, x, *pair, idx, w)
    assert_trees_bitwise(got, want)


def test_the_sm_budget_bounds_the_channels(monkeypatch):
    """A streaming launch's blocks (8 warps: per channel a sender and a receiver) are resident
    at once, 2 to an SM: an op whose num_sms holds fewer warps than the rings' channels need
    streams through fewer (num_sms x 16 / the warps of a channel, at least 1), with the same
    results; expert-major calls (in phases) and num_sms=None are not bounded. At R 2 a
    channel's dispatch has 2 senders and 2 receivers (one per destination), its combine 2
    senders and a receiver; with Channels.warps 1, 2 and 2."""
    R, T, K, E, H = 2, 8, 2, 4, 128
    rng = np.random.default_rng()
    idx, w = routing(rng, R, T, K, E, "uniform")
    x = rng.standard_normal((R, T, H)).astype(np.float32)

    def program(num_sms, expert_major=False):
        def per_shard(x, idx, w):
            recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, num_sms=num_sms,
                                           expert_major=expert_major, backend="cuda")
            return recv.with_zero_padding().x, jax_ep.combine(recv.x, handle, num_sms=num_sms,
                                                              backend="cuda")

        return per_shard

    def channels(num_sms):
        text = compiled_text(program(num_sms), R, x, idx, w)
        return re.findall(r"channels = (\d+)", text)

    with host_peers_with(monkeypatch, JAX_EP_CHANNELS="9,2,2"):
        assert channels(1) == ["4", "5"]  # 1 SM holds 16 warps: 4 channels of 4, 5 of 3
        assert channels(None) == ["9", "9"]
        want = to_numpy(sharded(program(None), R)(x, idx, w))
        for num_sms in (1, 2, 3):
            assert_trees_bitwise(to_numpy(sharded(program(num_sms), R)(x, idx, w)), want)
        jax.block_until_ready(sharded(program(1, expert_major=True), R)(x, idx, w))
    with host_peers_with(monkeypatch, JAX_EP_CHANNELS="20,2,2,1"):
        assert channels(1) == ["8", "8"]  # 1 SM's 16 warps: 8 channels of 2
        assert_trees_bitwise(to_numpy(sharded(program(1), R)(x, idx, w)), want)


def test_channels_keep_the_normal_region_flat_in_the_tokens(monkeypatch):
    """Streamed, the dispatch's and the combine's symmetric bytes are their ring counters and
    rings (and the dispatch's counts), whatever T; expert-major calls run in phases and grow
    with R*T. Node-aware, the dispatch's rings are those of the node (from each rank of the
    node and each of its forwarders) and those from the sources a rank relays. With the
    default Channels, the normal region at EP64 over puts (DeepSeek's shapes) stays under
    1 GiB, in one node and in nodes of 8."""
    monkeypatch.delenv("JAX_EP_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("JAX_EP_CHANNELS", raising=False)
    rings = runtime.Channels(2, 4, 2)
    R, K, E, H = 8, 4, 16, 256
    dispatch_slot = 2 * H + 4 * (H // 128 + 2 + 2 * K)  # a row, its scales, its metadata
    combine_slot = 2 * H + 16  # a row, its weight and token, to 16 bytes
    for access in ("store", "put"):
        def split(T, access=access, **kw):
            config = jax_ep.BufferConfig(num_tokens=T, hidden=H, top_k=K, num_experts=E,
                                         num_ranks=R, low_latency_tokens=0, **kw)
            return runtime.normal_region_bytes(config, access=access)

        sizes = {T: split(T, channels=rings) for T in (16, 64, 256)}
        assert len({tuple(v.values()) for v in sizes.values()}) == 1, sizes
        copies = 2 if access == "put" else 1
        for op, slot in (("dispatch", dispatch_slot), ("combine", combine_slot)):
            ring_bytes = copies * rings.channels * R * rings.slots() * slot
            assert ring_bytes < sizes[16][op] <= ring_bytes + 4096  # counters and counts
        phased = [split(T, channels=None) for T in (16, 64)]
        assert phased[1]["combine"] > phased[0]["combine"]  # in phases: grows with T
        em = [split(T, channels=rings, expert_major=True)["dispatch"] for T in (16, 64)]
        assert em[1] > em[0]  # expert-major runs in phases
    # Node-aware, nodes of 4 ranks: per channel 4 x (1 + 2 forwarders) node rings over stores,
    # and 2 relay rings (one per node) over puts, of slots with K (receiver, row) pairs.
    relay_slot = -(-(dispatch_slot + 8 * K) // 16) * 16
    for T in (16, 64, 256):
        config = jax_ep.BufferConfig(num_tokens=T, hidden=H, top_k=K, num_experts=E,
                                     num_ranks=R, low_latency_tokens=0, channels=rings)
        aware = runtime.normal_region_bytes(config, access="put", nodes=4)
        ring_bytes = rings.channels * rings.slots() * (12 * dispatch_slot + 2 * 2 * relay_slot)
        assert ring_bytes < aware["dispatch"] <= ring_bytes + 4096
    for T in (4096, 16384):  # the defaults stream
        config = jax_ep.BufferConfig(num_tokens=T, num_ranks=64, low_latency_tokens=0)
        assert runtime.buffer_regions(config, access="put", nodes=0)["normal"] < 1 << 30
        assert runtime.buffer_regions(config, access="put", nodes=8)["normal"] < 1 << 30
        monkeypatch.setenv("JAX_EP_CHANNELS", "off")
        assert runtime.buffer_regions(config, access="put", nodes=8)["normal"] > 7 << 30
        monkeypatch.delenv("JAX_EP_CHANNELS")
    with pytest.raises(ValueError, match=r"Channels.chunk_tokens must be an int in \[1, 2\^20\]"):
        jax_ep.BufferConfig(channels=runtime.Channels(2, 0, 2)).check()
    with pytest.raises(ValueError, match=r"Channels.warps must be an int in \[0, 64\]"):
        jax_ep.BufferConfig(channels=runtime.Channels(2, 2, 2, 65)).check()
    monkeypatch.setenv("JAX_EP_CHANNELS", "8,16")
    with pytest.raises(ValueError, match=r"\$JAX_EP_CHANNELS='8,16' is not .* or \"off\""):
        runtime.channels_from_env()
    for text, want in (("off", None), ("OFF", None), ("3,2,1", runtime.Channels(3, 2, 1)),
                       ("3,2,1,5", runtime.Channels(3, 2, 1, 5))):
        monkeypatch.setenv("JAX_EP_CHANNELS", text)
        assert runtime.channels_from_env(runtime.Channels()) == want


# Node-aware ($JAX_EP_RANKS_PER_NODE with puts): stores within a node, puts between nodes, and
# the normal dispatch through relays: a token crosses to another node once, to the rank there
# with its index in the node, which stores it into the receivers of its node. A store into
# another node's rank, or a read of another rank's buffer, aborts the process.


@pytest.fixture(params=[2, 3], ids=lambda n: f"nodes of {n}")
def node_peers(request, monkeypatch):
    """Host peers in nodes of 2 or 3 ranks (3: the last node of 4 or 8 ranks is smaller), for
    one test."""
    with host_peers_with(monkeypatch, JAX_EP_PEER_ACCESS="put",
                         JAX_EP_RANKS_PER_NODE=str(request.param)) as state:
        assert state["ranks_per_node"] == request.param
        yield


@pytest.mark.parametrize("R", [2, 4, 5, 8])
def test_node_aware_normal_ops_match_portable_backend(node_peers, R):
    test_normal_ops_match_portable_backend(R, *drawn_mode())


@pytest.mark.parametrize("R", [4, 5, 8])
def test_node_aware_with_channels_matches_portable_backend(monkeypatch, R):
    """In nodes of 3 with rings: the dispatch streams through the relays (a smaller last node
    makes a relay serve several sources of a node), the combine over puts (as its phased form,
    straight to each home)."""
    with host_peers_with(monkeypatch, JAX_EP_PEER_ACCESS="put", JAX_EP_RANKS_PER_NODE="3",
                         JAX_EP_CHANNELS="2,2,2"):
        test_normal_ops_match_portable_backend(R, False, False)


@pytest.mark.parametrize("R", [4, 8])
def test_node_aware_low_latency_matches_portable_backend(node_peers, R):
    """The low-latency ops put straight to each expert's rank, within a node too."""
    test_low_latency_over_puts_matches_portable_backend(None, R, False)


def test_nodes_size_the_relays(monkeypatch):
    monkeypatch.delenv("JAX_EP_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("JAX_EP_CHANNELS", raising=False)
    R, T, K, H = 8, 16, 4, 256
    config = jax_ep.BufferConfig(num_tokens=T, hidden=H, top_k=K, num_experts=8, num_ranks=R,
                                 low_latency_tokens=24, channels=None)
    put, nodes = (runtime.buffer_regions(config, access="put", nodes=n) for n in (0, 4))
    # The relays' slots: R*T rows, FP8 scales and K (receiver, row) pairs; and the targets
    # staged for 2 nodes, 2*T*K pairs (each piece a multiple of 256 bytes here). The normal
    # region holds the larger of dispatch and combine, and the dispatch over puts is at most
    # the region without nodes.
    relays = R * T * (2 * H + H // 128 * 4 + 8 * K) + 2 * T * K * 8
    assert relays < nodes["normal"] <= put["normal"] + relays
    assert nodes["low_latency"] == put["low_latency"]
    assert runtime.buffer_regions(config, access="put", nodes=8) == put  # one node
    monkeypatch.setenv("JAX_EP_RANKS_PER_NODE", "4")
    assert runtime.buffer_regions(config, access="put") == nodes
    monkeypatch.setenv("JAX_EP_RANKS_PER_NODE", "four")
    with pytest.raises(ValueError, match=r"\$JAX_EP_RANKS_PER_NODE='four' is not a positive"):
        runtime.buffer_regions(config)


def test_nodes_need_puts(monkeypatch):
    jax_ep.finalize()
    monkeypatch.setenv("JAX_EP_RANKS_PER_NODE", "4")
    try:
        with pytest.raises(RuntimeError, match=r"nodes of 4 .* set \$JAX_EP_PEER_ACCESS=put"):
            jax_ep.initialize(buffer_bytes=HOST_PEER_BYTES,
                              low_latency_bytes=HOST_PEER_LOW_LATENCY_BYTES)
        assert not runtime.is_initialized()
    finally:
        monkeypatch.undo()
        initialize_for_tests()


@pytest.mark.parametrize("hosts, nodes", [
    ("aaaa", 0), ("aabb", 2), ("aaabbbcc", 3), ("abcd", 1), ("aaab", 3)])
def test_nodes_of_hosts(hosts, nodes):
    assert runtime.nodes_of_hosts(list(hosts)) == nodes


@pytest.mark.parametrize("hosts", ["abab", "aabbb", "abbca"])
def test_hosts_out_of_node_order_are_refused(hosts):
    with pytest.raises(RuntimeError, match="not in node order"):
        runtime.nodes_of_hosts(list(hosts))
