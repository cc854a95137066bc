"""One order of exchanges: programs with several exchanges that do not depend on each other,
on the cuda backend between the CPU devices (host peers), each run 20 times and bit for bit
equal to the portable backend every time.

Without an order, XLA:CPU ran such exchanges at once on a device, or in different orders on
different ranks, through one buffer and one set of flags per rank: a segfault reading rows
gigabytes past the buffer, or gradients that differed from run to run
(jax_ep/_exchange_order.py). The programs run with the session's peer access
($JAX_EP_PEER_ACCESS, $JAX_EP_RANKS_PER_NODE); the first two also over puts and in nodes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import sharded, to_numpy
from test_host_peers import host_peers, host_peers_with  # noqa: F401 (host_peers: a fixture)
from test_virtual import assert_bitwise

import jax_ep
from jax_ep import _ffi

pytestmark = pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
RUNS = 20


def assert_every_run_matches(program, R, *args, runs=RUNS):
    """`program(backend)` on the cuda backend `runs` times, each bit for bit equal to one run
    on the portable backend."""
    want = to_numpy(sharded(program("xla"), R)(*args))
    run = sharded(program("cuda"), R)
    for i in range(runs):
        got = to_numpy(run(*args))
        for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                                jax.tree.leaves(want), strict=True):
            assert_bitwise(g, w, f"run {i}{jax.tree_util.keystr(path)}")


def forward_and_gradients_inputs(rng, R, T, K, E, H):
    """Routing with a duplicate choice in half the tokens, float16 rows, and the cotangents of
    the dispatch and combine (the reproduction of the segfault, at any R)."""
    idx = rng.integers(0, E, size=(R * T, K))
    dup = rng.random(R * T) < 0.5
    idx[dup, 1] = idx[dup, 0]
    idx = idx.reshape(R, T, K).astype(np.int32)
    cap = R * T * min(K, E // R)  # the expert-major default capacity
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return (normal(R, T, H).astype(np.float16), idx, normal(R, T, K),
            normal(R, cap, H).astype(np.float16), normal(R, cap), normal(R, T, H),
            normal(R, cap, H), normal(R, cap))


def forward_and_gradients(E, cap):
    """A layout, a dispatch, a combine with weights (padding of y and weights NaN), and the
    gradients of a dispatch (x, weights) and of a combine (y, weights): seven exchanges, most
    independent of each other."""

    def program(backend):
        kw = dict(num_experts=E, expert_major=True, on_overflow="drop", on_invalid="mask",
                  backend=backend)

        def per_shard(x, idx, w, y, y_weights, g, gx, gw):
            layout = jax_ep.get_dispatch_layout(idx, num_experts=E, backend=backend)
            recv, handle = jax_ep.dispatch(x, idx, w, **kw)
            keep = jnp.arange(cap) < recv.num_tokens
            y = jnp.where(keep[:, None], y, jnp.array(jnp.nan, y.dtype))
            y_weights = jnp.where(keep, y_weights, jnp.nan)
            out = jax_ep.combine(y, handle, topk_weights=y_weights, backend=backend)

            def dispatch_loss(x, w):
                r, _ = jax_ep.dispatch(x, idx, w, **kw)
                return jnp.sum(r.x.astype(jnp.float32) * gx) + jnp.sum(r.topk_weights * gw)

            def combine_loss(y, rw):
                out = jax_ep.combine(y, handle, topk_weights=rw, backend=backend)
                return jnp.sum(out.astype(jnp.float32) * g)

            dx, dw = jax.grad(dispatch_loss, argnums=(0, 1))(x, w)
            dy, drw = jax.grad(combine_loss, argnums=(0, 1))(y, y_weights)
            return dict(layout=layout.num_tokens_per_rank, x=recv.with_zero_padding().x,
                        num_tokens=recv.num_tokens, out=out, dx=dx, dw=dw, dy=dy, drw=drw)

        return per_shard

    return program


def test_forward_and_gradients_in_one_program():
    """The segfault's reproduction: R 8, T 130, K 6, E 128, H 256."""
    R, T, K, E, H = 8, 130, 6, 128, 256
    args = forward_and_gradients_inputs(np.random.default_rng(), R, T, K, E, H)
    assert_every_run_matches(forward_and_gradients(E, R * T * min(K, E // R)), R, *args)


@pytest.fixture(params=["puts", "nodes of 3"])
def other_access(request, monkeypatch):
    env = {"JAX_EP_PEER_ACCESS": "put"}
    if request.param == "nodes of 3":
        env["JAX_EP_RANKS_PER_NODE"] = "3"
    with host_peers_with(monkeypatch, **env):
        yield


@pytest.mark.parametrize("R", [3, 8])
def test_forward_and_gradients_over_puts(other_access, R):
    """The wrong gradients' reproduction: over puts (and in nodes of 3), R 3."""
    T, K, E, H = 37, 4, 6 * R, 128
    args = forward_and_gradients_inputs(np.random.default_rng(), R, T, K, E, H)
    assert_every_run_matches(forward_and_gradients(E, R * T * min(K, E // R)), R, *args)


@pytest.mark.parametrize("expert_major, streams", [(False, (None, None)), (True, (None, None)),
                                                   (True, (1, 2))])
def test_two_dispatches_of_unrelated_inputs(expert_major, streams):
    """Two dispatches and combines of unrelated inputs, also each on a GPU stream of its own
    (on the CPU the call runs as any other, in the one order of its token)."""
    R, T, K, E, H = 4, 29, 3, 12, 128
    rng = np.random.default_rng()
    firsts = [rng.integers(-1, E, size=(R, T, K)).astype(np.int32) for _ in range(2)]
    xs = [rng.standard_normal((R, T, H)).astype(np.float32) for _ in range(2)]
    ws = [rng.standard_normal((R, T, K)).astype(np.float32) for _ in range(2)]

    def program(backend):
        def per_shard(x0, x1, idx0, idx1, w0, w1):
            outs = []
            for x, idx, w, stream in ((x0, idx0, w0, streams[0]), (x1, idx1, w1, streams[1])):
                recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E,
                                               expert_major=expert_major, on_invalid="mask",
                                               backend=backend, stream=stream)
                weights = recv.topk_weights if expert_major else None
                outs.append(jax_ep.combine(recv.x * 2, handle, topk_weights=weights,
                                           backend=backend, stream=stream))
            return outs

        return per_shard

    assert_every_run_matches(program, R, *xs, *firsts, *ws)


def test_low_latency_halves_interleaved_with_normal_ops():
    """Both low-latency regions in flight, a normal dispatch and combine between the sends and
    the receives, and the low-latency combines after."""
    R, T, K, E, H = 4, 9, 3, 8, 128
    rng = np.random.default_rng()
    idx = [rng.integers(-1, E, size=(R, T, K)).astype(np.int32) for _ in range(2)]
    w = rng.standard_normal((R, T, K)).astype(np.float32)
    x = [rng.standard_normal((R, T, H)).astype(jnp.bfloat16) for _ in range(2)]

    def program(backend):
        def per_shard(x0, x1, idx0, idx1, w):
            sent = [jax_ep.low_latency_dispatch_send(x, i, num_experts=E, backend=backend,
                                                     buffer=b)
                    for b, (x, i) in enumerate(((x0, idx0), (x1, idx1)))]
            recv, handle = jax_ep.dispatch(x0.astype(jnp.float32), idx1, w, num_experts=E,
                                           on_invalid="mask", backend=backend)
            normal = jax_ep.combine(recv.x, handle, backend=backend)
            outs = [normal]
            for pending, i in zip(sent, (idx0, idx1), strict=True):
                got, ll_handle = jax_ep.low_latency_dispatch_recv(pending)
                weights = jnp.where(i >= 0, w, 0.0)
                outs.append(jax_ep.low_latency_combine(got.x, i, weights, ll_handle,
                                                       backend=backend))
            return outs

        return per_shard

    assert_every_run_matches(program, R, *x, *idx, w)


def test_scan_over_layers_with_gradients():
    """A lax.scan over 3 layers, each a dispatch, a local expert and a combine, and its
    gradient (the backward scan runs the layers' exchanges in reverse)."""
    R, T, K, E, H, L = 4, 11, 2, 8, 128, 3
    rng = np.random.default_rng()
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    idx = rng.integers(-1, E, size=(R, L, T, K)).astype(np.int32)
    w = rng.standard_normal((R, L, T, K)).astype(np.float32)
    scale = rng.standard_normal((R, L, H)).astype(np.float32)

    def program(backend):
        def per_shard(x, idx, w, scale):
            def layer(h, per_layer):
                i, wl, s = per_layer
                recv, handle = jax_ep.dispatch(h, i, wl, num_experts=E, on_invalid="mask",
                                               backend=backend)
                rows = recv.with_zero_padding().x * s  # the scale's gradient reads every row
                return h + jax_ep.combine(rows, handle, backend=backend), None

            def loss(x, scale):
                h, _ = jax.lax.scan(layer, x, (idx, w, scale))
                return jnp.sum(h * h), h

            (_, h), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, scale)
            return h, grads

        return per_shard

    assert_every_run_matches(program, R, x, idx, w, scale)


def exchange_chain(hlo: str) -> list[str]:
    """The exchange custom calls of HLO text in the order their tokens chain them; fails if
    one of them does not take the token of the one before (the first takes the program's)."""
    calls = re.findall(r"^\s*(\S+) = \(token\[\][^\n]*?custom-call\(\S+, (\S+?)[,)][^\n]*"
                       r'custom_call_target="(jax_ep_\w+)"', hlo, re.M)
    token_of = dict(re.findall(r"^\s*(\S+) = token\[\] get-tuple-element\((\S+)\), index=0",
                               hlo, re.M))
    for (previous, _, _), (name, token, target) in zip(calls, calls[1:], strict=False):
        assert token_of.get(token) == previous, f"{target} ({name}) is not ordered after " \
                                                f"{previous}: its token is {token}"
    return [target for _, _, target in calls]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_independent_exchanges_are_chained_by_their_tokens(platform):
    """Two dispatches and combines of unrelated inputs, and a low-latency round trip, lowered
    for the CPU and for GPUs: each exchange takes the token the one before it returned, in
    program order, so XLA can neither run two at once nor reorder them."""
    R, T, K, E, H = 4, 6, 2, 8, 128
    mesh = jax.make_mesh((R,), ("ep",), devices=jax.devices()[:R])
    spec = jax.sharding.PartitionSpec("ep")

    def per_shard(x0, x1, idx0, idx1, w):
        outs = []
        for x, idx in ((x0, idx0), (x1, idx1)):
            recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, backend="cuda")
            outs.append(jax_ep.combine(recv.x, handle, backend="cuda"))
        ll, handle = jax_ep.low_latency_dispatch(x1, idx0, num_experts=E, backend="cuda")
        outs.append(jax_ep.low_latency_combine(ll.x, idx0, w, handle, backend="cuda"))
        return outs

    sharding = jax.sharding.NamedSharding(mesh, spec)
    x = jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16, sharding=sharding)
    idx = jax.ShapeDtypeStruct((R * T, K), jnp.int32, sharding=sharding)
    w = jax.ShapeDtypeStruct((R * T, K), jnp.float32, sharding=sharding)
    fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec))
    with jax.set_mesh(mesh):
        hlo = fn.trace(x, x, idx, idx, w).lower(lowering_platforms=(platform,)).as_text(
            dialect="hlo")
    assert exchange_chain(hlo) == [
        "jax_ep_dispatch", "jax_ep_combine", "jax_ep_dispatch", "jax_ep_combine",
        "jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send",
        "jax_ep_ll_combine_recv"]


def test_exchanges_on_different_streams_keep_one_order():
    """`stream=` puts each exchange in its own call on a GPU stream; the token still passes
    from each call to the next, so XLA waits across the streams and two exchanges never run
    at once, whatever streams they are on."""
    R, T, K, E, H = 2, 6, 2, 4, 128
    mesh = jax.make_mesh((R,), ("ep",), devices=jax.devices()[:R])
    spec = jax.sharding.PartitionSpec("ep")

    def per_shard(x, idx, w):
        out = 0
        for stream, rows in ((1, x), (2, x * 2)):
            recv, handle = jax_ep.dispatch(rows, idx, w, num_experts=E, backend="cuda",
                                           stream=stream)
            out = out + jax_ep.combine(recv.x, handle, backend="cuda", stream=stream)
        return out

    sharding = jax.sharding.NamedSharding(mesh, spec)
    args = [jax.ShapeDtypeStruct((R * T, n), dtype, sharding=sharding)
            for n, dtype in ((H, jnp.bfloat16), (K, jnp.int32), (K, jnp.float32))]
    fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec))
    with jax.set_mesh(mesh):
        hlo = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")
    calls = re.findall(r"^\s*(\S+) = \(token\[\][^\n]*? call\((\S+?),[^\n]*"
                       r'_xla_stream_annotation="(\d+)"', hlo, re.M)
    token_of = dict(re.findall(r"^\s*(\S+) = token\[\] get-tuple-element\((\S+)\), index=0",
                               hlo, re.M))
    assert [stream for _, _, stream in calls] == ["1", "1", "2", "2"], calls
    for (previous, _, _), (name, token, _) in zip(calls, calls[1:], strict=False):
        assert token_of.get(token) == previous, f"{name} is not ordered after {previous}"
