"""Edge cases every backend handles the same way: no tokens, differentiation of the
low-latency ops, and vmap.

The cuda backend runs at R = 1 here (no peers needed); `JAX_EP_BACKEND=cuda` runs the xla
cases' R = 2 through host peers too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import sharded, to_numpy

import jax_ep
from jax_ep import _ffi, runtime
from jax_ep.backends import xla

# (backend, R, transport of the xla backend); cuda at R = 2 runs between the CPU devices
# through host peers, set up by `JAX_EP_BACKEND=cuda pytest` (tests/conftest.py).
_EXT = pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
BACKENDS = [("xla", 2, "all_gather"), ("xla", 2, "ragged"),
            pytest.param("cuda", 1, None, marks=_EXT), pytest.param("cuda", 2, None, marks=_EXT)]


def _use(monkeypatch, backend, num_ranks, transport):
    if transport:
        monkeypatch.setenv(xla.TRANSPORT_ENV_VAR, transport)
    if backend == "cuda" and num_ranks > 1 and not runtime.is_initialized():
        pytest.skip("between devices the cuda backend needs host peers: run with "
                    "JAX_EP_BACKEND=cuda")


def _random_inputs(num_ranks, T, K, E, H, dtype):
    """x [R, T, H] of `dtype`, uniform routing and weights."""
    rng = np.random.default_rng()
    return (rng.standard_normal((num_ranks, T, H)).astype(dtype),
            rng.integers(0, E, (num_ranks, T, K)).astype(np.int32),
            rng.random((num_ranks, T, K)).astype(np.float32))


@pytest.mark.parametrize("backend,num_ranks,transport", BACKENDS)
def test_no_tokens(monkeypatch, backend, num_ranks, transport):
    """T = 0: empty results, zero counts, zero gradients, on every backend."""
    _use(monkeypatch, backend, num_ranks, transport)
    K, E, H = 2, 4, 128
    x = np.zeros((num_ranks, 0, H), np.float32)
    idx = np.zeros((num_ranks, 0, K), np.int32)
    w = np.zeros((num_ranks, 0, K), np.float32)

    shapes = {}  # recorded while tracing: arrays of zero rows cannot leave a shard_map

    def per_shard(x, idx, w):
        counts = []
        for expert_major in (False, True):
            def loss(x, w, expert_major=expert_major):
                recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E,
                                               expert_major=expert_major, backend=backend)
                y = jax_ep.combine(recv.x, handle, backend=backend)
                return jnp.sum(y), (recv, y)

            (total, (recv, y)), (dx, dw) = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w)
            shapes[expert_major] = (recv.x.shape, y.shape, dx.shape, dw.shape)
            counts += [recv.num_tokens, recv.num_dropped, total]
        ll_recv, handle = jax_ep.low_latency_dispatch(x.astype(jnp.bfloat16), idx,
                                                      num_experts=E, backend=backend)
        ll_y = jax_ep.low_latency_combine(ll_recv.x, idx, w, handle, backend=backend)
        shapes["low_latency"] = (ll_recv.x.shape, ll_y.shape)
        return jnp.stack(counts), ll_recv.count

    counts, ll_count = to_numpy(sharded(per_shard, num_ranks)(x, idx, w))
    assert not counts.any() and not ll_count.any()
    for expert_major in (False, True):
        assert shapes[expert_major] == ((0, H), (0, H), (0, H), (0, K)), shapes
    assert shapes["low_latency"] == ((E // num_ranks, 0, H), (0, H)), shapes


@pytest.mark.parametrize("backend,num_ranks,transport", BACKENDS)
def test_low_latency_ops_refuse_differentiation(monkeypatch, backend, num_ranks, transport):
    """The same error on every backend, naming the op (not a plausible gradient on one and
    JAX's "cannot be differentiated" on the other)."""
    _use(monkeypatch, backend, num_ranks, transport)
    T, K, E, H = 5, 2, 4, 128
    x, idx, w = _random_inputs(num_ranks, T, K, E, H, ml_dtypes.bfloat16)

    def through_dispatch(x, idx, w):
        def loss(x):
            recv, _ = jax_ep.low_latency_dispatch(x, idx, num_experts=E, backend=backend)
            return jnp.sum(recv.x.astype(jnp.float32))
        return jax.grad(loss)(x)

    def through_combine(x, idx, w):
        recv, handle = jax_ep.low_latency_dispatch(x, idx, num_experts=E, backend=backend)

        def loss(w):
            out = jax_ep.low_latency_combine(recv.x, idx, w, handle, backend=backend)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss)(w)

    for program, op in ((through_dispatch, "low_latency_dispatch"),
                        (through_combine, "low_latency_combine")):
        with pytest.raises(TypeError, match=rf"jax_ep\.{op} is not differentiable"):
            sharded(program, num_ranks)(x, idx, w)

    def stopped(x, idx, w):  # the way out the message names
        def loss(x):
            recv, _ = jax_ep.low_latency_dispatch(jax.lax.stop_gradient(x), idx,
                                                  num_experts=E, backend=backend)
            return jnp.sum(recv.x.astype(jnp.float32)) + jnp.sum(x.astype(jnp.float32))
        return jax.grad(loss)(x)

    np.testing.assert_array_equal(np.asarray(sharded(stopped, num_ranks)(x, idx, w)), 1)


@pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
def test_vmap_of_the_cuda_backend_points_to_virtual_ranks():
    T, K, E, H = 4, 2, 4, 8
    x = np.ones((1, 3, T, H), np.float32)
    idx = np.zeros((1, 3, T, K), np.int32)
    w = np.ones((1, 3, T, K), np.float32)

    def per_shard(x, idx, w, backend):
        def one(x, idx, w):
            recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, backend=backend)
            return jax_ep.combine(recv.x, handle, backend=backend)
        return jax.vmap(one)(x, idx, w)

    with pytest.raises(ValueError, match=r"cannot run under jax\.vmap.*jax_ep\.virtual"):
        sharded(lambda *a: per_shard(*a, "cuda"), 1)(x, idx, w)
    # The xla backend maps: each batch element is its own dispatch.
    got = np.asarray(sharded(lambda *a: per_shard(*a, "xla"), 1)(x, idx, w))
    np.testing.assert_array_equal(got, x)


@pytest.mark.parametrize("backend,num_ranks,transport", BACKENDS)
def test_ops_under_remat_with_default_arguments(monkeypatch, backend, num_ranks, transport):
    """jax.checkpoint around dispatch + combine (default arguments: their value checks on)
    gives the gradients of the same step without it, bit for bit; a low-latency round trip
    inside a checkpointed function runs too."""
    _use(monkeypatch, backend, num_ranks, transport)
    T, K, E, H = 6, 2, 4, 128
    rng = np.random.default_rng()
    x = rng.standard_normal((num_ranks, T, H)).astype(np.float32)
    idx = rng.integers(-1, E, (num_ranks, T, K)).astype(np.int32)
    w = rng.random((num_ranks, T, K)).astype(np.float32)

    def step(x, w, idx):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=True,
                                       backend=backend)
        y = jnp.sin(recv.x)
        out = jax_ep.combine(y, handle, topk_weights=recv.topk_weights, backend=backend)
        ll_recv, ll_handle = jax_ep.low_latency_dispatch(
            jax.lax.stop_gradient(x).astype(jnp.bfloat16), idx, num_experts=E, backend=backend)
        ll_out = jax_ep.low_latency_combine(ll_recv.x, idx, jax.lax.stop_gradient(w),
                                            ll_handle, backend=backend)
        return jnp.sum(out * out) + jnp.sum(ll_out.astype(jnp.float32))

    def grads(remat):
        def per_shard(x, idx, w):
            fn = jax.checkpoint(step) if remat else step
            return jax.grad(fn, argnums=(0, 1))(x, w, idx)
        return to_numpy(sharded(per_shard, num_ranks)(x, idx, w))

    for got, want in zip(grads(True), grads(False), strict=True):
        np.testing.assert_array_equal(got, want)


def test_moe_layer_under_nnx_remat():
    from flax import nnx

    from jax_ep.nn import MoE, RouterConfig

    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
    model = MoE(16, 12, RouterConfig(num_experts=4, top_k=2), mesh=mesh, backend="xla",
                rngs=nnx.Rngs(0))
    x = np.asarray(jax.random.normal(jax.random.key(1), (8, 16)))

    def loss(m, x):
        return jnp.sum(jnp.sin(m(x)[0]))

    with jax.set_mesh(mesh):
        want = nnx.jit(nnx.grad(loss))(model, x)
        got = nnx.jit(nnx.grad(lambda m, x: nnx.remat(loss)(m, x)))(model, x)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_array_equal(got[name][...], want[name][...], err_msg=name)


def test_huge_capacity_names_the_argument_and_its_cost():
    x = np.zeros((2, 4, 256), np.float32)
    idx = np.zeros((2, 4, 2), np.int32)
    w = np.ones((2, 4, 2), np.float32)

    def per_shard(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=4, capacity=10**9, backend="xla")[0].x

    with pytest.raises(ValueError, match=r"capacity=1000000000 is more than a rank can ever "
                                         r"need \(8 rows\).*953\.7 GiB.*capacity<=8"):
        sharded(per_shard, 2)(x, idx, w)


def test_virtual_ranks_take_a_numpy_integer_for_num_experts():
    x = np.ones((2, 4, 8), np.float32)
    idx = np.tile(np.arange(4, dtype=np.int32)[None, :, None] % 4, (2, 1, 2))
    w = np.ones((2, 4, 2), np.float32)
    got, _ = jax_ep.virtual.dispatch(x, idx, w, num_experts=np.int64(4), backend="xla")
    want, _ = jax_ep.virtual.dispatch(x, idx, w, num_experts=4, backend="xla")
    np.testing.assert_array_equal(np.asarray(got.x), np.asarray(want.x))


def test_moe_checks_the_hidden_size():
    from flax import nnx

    from jax_ep.nn import MoE, RouterConfig

    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
    model = MoE(16, 12, RouterConfig(num_experts=4, top_k=2), mesh=mesh, backend="xla",
                rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"MoE: x must be \[\.\.\., hidden\] "
                                                            r"with the layer's hidden size 16"):
        model(jnp.ones((4, 15)))


def test_moe_statistics_survive_a_nan_token():
    """One token holding a NaN: its output is NaN, the others' are those of a run where it
    is a zero row; aux_loss and the router's gradient through it stay finite, and the stats
    count the token."""
    from flax import nnx

    from jax_ep.nn import MoE, RouterConfig

    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
    model = MoE(16, 12, RouterConfig(num_experts=4, top_k=2), mesh=mesh, backend="xla",
                rngs=nnx.Rngs(0))
    x = np.asarray(jax.random.normal(jax.random.key(3), (8, 16)))
    bad, zero = x.copy(), x.copy()
    bad[5, 3], zero[5] = np.nan, 0.0

    def aux(m, x):
        return m(x)[1].aux_loss

    with jax.set_mesh(mesh):
        out, stats = nnx.jit(lambda m, x: m(x))(model, bad)
        clean, clean_stats = nnx.jit(lambda m, x: m(x))(model, zero)
        g = nnx.jit(nnx.grad(aux))(model, bad)
    out, clean = np.asarray(out), np.asarray(clean)
    assert np.isnan(out[5]).all()
    np.testing.assert_array_equal(np.delete(out, 5, 0), np.delete(clean, 5, 0))
    assert np.isfinite(float(stats.aux_loss)) and int(stats.nonfinite) == 1
    assert int(clean_stats.nonfinite) == 0
    np.testing.assert_array_equal(stats.load, clean_stats.load)  # routed as the zero row
    assert np.isfinite(np.asarray(g["router"][...])).all()


@pytest.mark.parametrize("backend,num_ranks,transport", BACKENDS)
def test_combine_cotangent_is_plus_zero_past_the_count(monkeypatch, backend, num_ranks,
                                                       transport):
    """docs/contract.md: the backward of combine gives zero in the rows of y past the count,
    +0 whatever the weight there (a negative weight gave -0.0, a NaN weight NaN)."""
    _use(monkeypatch, backend, num_ranks, transport)
    T, K, E, H = 6, 2, 4, 16
    x, idx, w = _random_inputs(num_ranks, T, K, E, H, np.float32)
    rng = np.random.default_rng()
    bad = np.where(rng.random((num_ranks, 64)) < 0.5, -1.5, np.nan).astype(np.float32)

    def per_shard(x, idx, w, bad):
        grads = []
        for expert_major in (False, True):
            recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=expert_major,
                                           backend=backend)
            rows = recv.x.shape[0]
            past = jnp.arange(rows) >= recv.num_tokens
            weights = jnp.where(past, bad[:rows], 2.0)  # -1.5 or NaN in every padding row

            def loss(y, weights=weights, handle=handle):
                return jnp.sum(jax_ep.combine(y, handle, topk_weights=weights,
                                              backend=backend))

            d_y = jax.grad(loss)(recv.with_zero_padding().x)
            grads.append(jnp.where(past[:, None], d_y, 1.0))  # past the count, else 1
        return grads

    for d_y in to_numpy(sharded(per_shard, num_ranks)(x, idx, w, bad)):
        bits = d_y.view(np.uint32)
        assert ((bits == 0) | (d_y == 1.0)).all(), "a cotangent past the count is not +0"


def _with_a_nan(rng, shape, H):
    x = rng.standard_normal(shape + (H,)).astype(np.float32)
    x.reshape(-1, H)[0, int(rng.integers(H))] = np.nan  # one NaN in the first row's block
    return x


@pytest.mark.parametrize("H", [128, 1024, 7168])
def test_fp8_quantize_a_block_with_a_nan_is_nan(H):
    """docs/contract.md ("FP8"): a NaN makes its block's scale NaN and every value of the
    block NaN, at every H; the other blocks are as without it."""
    from jax_ep import fp8
    from jax_ep.tools import reference

    rng = np.random.default_rng()
    x = _with_a_nan(rng, (3,), H)
    q, s = (np.asarray(a) for a in jax.jit(fp8.quantize)(x))
    want_q, want_s = reference.quantize(x)
    first = int(np.flatnonzero(np.isnan(x[0]))[0]) // 128
    assert np.isnan(s[0, first]) and np.isnan(q[0, first * 128:(first + 1) * 128]
                                              .astype(np.float32)).all()
    nan_block = np.zeros(s.shape, bool)
    nan_block[0, first] = True
    np.testing.assert_array_equal(s[~nan_block], want_s[~nan_block])
    assert np.isnan(want_s[0, first])  # the reference follows the same rule
    blocks = lambda a: a.astype(np.float32).reshape(3, H // 128, 128)  # noqa: E731
    np.testing.assert_array_equal(blocks(q)[~nan_block], blocks(want_q)[~nan_block])


@pytest.mark.parametrize("backend", ["xla", pytest.param("cuda", marks=_EXT)])
def test_low_latency_fp8_cast_of_a_nan_block(backend):
    """The low-latency in-kernel cast follows the same rule as jax_ep.fp8.quantize."""
    from jax_ep import fp8, virtual

    rng = np.random.default_rng()
    R, T, K, E, H = 2, 5, 2, 4, 256
    x = _with_a_nan(rng, (R, T), H).astype(ml_dtypes.bfloat16)
    idx = np.tile(np.arange(K, dtype=np.int32), (R, T, 1))  # every token to experts 0, 1
    recv, _ = virtual.low_latency_dispatch(x, idx, num_experts=E, use_fp8=True,
                                           backend=backend)
    q, s = (np.asarray(a) for a in jax.jit(fp8.quantize)(x[0, 0]))
    got_q, got_s = np.asarray(recv.x)[0, 0, 0], np.asarray(recv.scales)[0, 0, 0]
    np.testing.assert_array_equal(np.isnan(got_s), np.isnan(s))
    np.testing.assert_array_equal(got_s[~np.isnan(s)], s[~np.isnan(s)])
    np.testing.assert_array_equal(np.isnan(got_q.astype(np.float32)),
                                  np.isnan(q.astype(np.float32)))
    finite = ~np.isnan(q.astype(np.float32))
    np.testing.assert_array_equal(got_q.astype(np.float32)[finite], q.astype(np.float32)[finite])


@pytest.mark.parametrize("backend", ["xla", pytest.param("cuda", marks=_EXT)])
def test_virtual_ranks_with_no_tokens(backend):
    """T = 0 on virtual ranks, as in shard_map: empty rows and the padding of a given
    capacity, zero counts (never uninitialized), eager and jitted."""
    from jax_ep import virtual

    R, K, E, H = 2, 2, 4, 128
    x = np.zeros((R, 0, H), np.float32)
    idx, w = np.zeros((R, 0, K), np.int32), np.zeros((R, 0, K), np.float32)
    for run in (lambda f, *a, **k: f(*a, **k), lambda f, *a, **k: jax.jit(
            lambda *a: f(*a, **k))(*a)):
        recv, handle = run(virtual.dispatch, x, idx, w, num_experts=E, capacity=3,
                           backend=backend)
        assert recv.x.shape == (R, 3, H) and not np.asarray(recv.num_tokens).any()
        assert (np.asarray(recv.topk_idx) == -1).all()
        out = run(virtual.combine, recv.x, handle, backend=backend)
        assert out.shape == (R, 0, H)
        ll, ll_handle = run(virtual.low_latency_dispatch, x.astype(ml_dtypes.bfloat16), idx,
                            num_experts=E, backend=backend)
        assert ll.x.shape == (R, E // R, 0, H)
        np.testing.assert_array_equal(np.asarray(ll.count), 0)
        np.testing.assert_array_equal(np.asarray(ll.num_invalid), 0)


def test_capacity_factor_of_no_tokens_is_zero():
    """The contract's formula at T = 0 gives a capacity of 0 (it gave 1)."""
    for expert_major in (False, True):
        assert jax_ep.capacity_from_factor(1.5, num_ranks=2, num_tokens=0, top_k=2,
                                           num_experts=4, expert_major=expert_major) == 0
