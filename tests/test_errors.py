"""Bad input: every case raises a clear error that names the argument (never a crash).

Static problems are raised at trace time as ValueError/TypeError; value problems (ids out of
range, capacity) through jax_ep.checked (test_dispatch.py, test_low_latency.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import checked, sharded

import jax_ep

R, T, K, E, H = 2, 6, 2, 4, 128


def _inputs():
    rng = np.random.default_rng()
    idx = rng.integers(0, E, size=(R, T, K)).astype(np.int32)
    w = rng.random((R, T, K)).astype(np.float32)
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    return x, idx, w


def _call(fn, *args):
    return jax.block_until_ready(sharded(fn, R)(*args))


def _dispatch(**kw):
    def fn(x, idx, w):
        return jax_ep.dispatch(x, idx, w, **{"num_experts": E, **kw})[0].x

    return fn


def _k4(x, i, w):
    return x, np.concatenate([i, i], -1) % 2, np.concatenate([w, w], -1)


# name: (per-shard function, transform of (x, idx, w), exception type, message pattern)
CASES = {
    "x rank 3": (
        _dispatch(), lambda x, i, w: (x[:, :, None], i, w), ValueError,
        r"x must be \[T, H\]"),
    "x int dtype": (
        _dispatch(), lambda x, i, w: (x.astype(np.int32), i, w), TypeError,
        r"x must be \[T, H\] with a floating"),
    "x rows != T": (
        _dispatch(), lambda x, i, w: (x[:, :-1], i, w), ValueError,
        r"x has 5 rows but topk_idx has 6"),
    "topk_idx float": (
        _dispatch(), lambda x, i, w: (x, i.astype(np.float32), w), TypeError,
        r"topk_idx must be int32 \[T, K\].*astype\(jnp.int32\)"),
    "topk_idx rank 1": (
        _dispatch(), lambda x, i, w: (x, i[:, :, 0], w), ValueError,
        r"topk_idx must be int32 \[T, K\]"),
    "topk_weights shape": (
        _dispatch(), lambda x, i, w: (x, i, w[:, :, :1]), ValueError,
        r"topk_weights must be float32 \[T, K\] = \[6, 2\]"),
    "topk_weights dtype": (
        _dispatch(), lambda x, i, w: (x, i, w.astype(np.int32)), TypeError,
        r"topk_weights must be float32"),
    "E % R != 0": (
        _dispatch(num_experts=5), None, ValueError,
        r"num_experts \(5\) must be a multiple of the size of mesh axis 'ep' \(2\)"),
    "num_experts not int": (
        _dispatch(num_experts=4.0), None, ValueError,
        r"num_experts must be a positive Python int"),
    "K > E": (
        _dispatch(num_experts=2), _k4, ValueError,
        r"K=4 choices per token; K must be between 1 and min\(32, num_experts=2\)"),
    "axis not in mesh": (
        _dispatch(axis_name="experts"), None, ValueError,
        r"axis_name 'experts' is not a mesh axis in scope"),
    "capacity zero": (
        _dispatch(capacity=0), None, ValueError, r"capacity must be a positive Python int"),
    "on_overflow bad": (
        _dispatch(on_overflow="ignore"), None, ValueError,
        r"on_overflow must be one of \['error', 'drop'\]"),
    "on_invalid bad": (
        _dispatch(on_invalid="clip"), None, ValueError,
        r"on_invalid must be one of \['error', 'mask'\]"),
    "expert_major not bool": (
        _dispatch(expert_major="yes"), None, TypeError, r"expert_major must be a bool"),
    "backend unknown": (
        _dispatch(backend="nccl"), None, ValueError,
        r"backend must be 'auto' or one of \['xla', 'cuda'\]"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_dispatch_bad_input(name):
    fn, transform, exc, pattern = CASES[name]
    args = _inputs()
    if transform is not None:
        args = transform(*args)
    with pytest.raises(exc, match=pattern):
        _call(fn, *args)


def test_k_larger_than_32():
    x, _, _ = _inputs()
    idx = np.zeros((R, T, 33), np.int32)
    w = np.zeros((R, T, 33), np.float32)

    def fn(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=64)[0].x

    with pytest.raises(ValueError, match=r"K=33 choices per token; K must be between 1"):
        _call(fn, x, idx, w)


def test_fp8_pair_errors():
    x, idx, w = _inputs()
    q = x.astype(jnp.float8_e4m3fn)
    s = np.ones((R, T, H // 128), np.float32)

    def with_pair(q, s, idx, w):
        return jax_ep.dispatch((q, s), idx, w, num_experts=E)[0].x

    with pytest.raises(ValueError, match=r"scales must be float32 \[6, 1\]"):
        _call(with_pair, q, s[:, :, :0], idx, w)
    with pytest.raises(TypeError, match=r"x\[0\] \(x_fp8\) must be float8_e4m3fn"):
        _call(with_pair, x, s, idx, w)
    with pytest.raises(ValueError, match=r"x must be an array \[T, H\] or the pair"):
        _call(lambda q, s, idx, w: jax_ep.dispatch((q, s, s), idx, w, num_experts=E)[0].x,
              q, s, idx, w)


def test_fp8_hidden_not_multiple_of_128():
    with pytest.raises(ValueError, match=r"hidden size of x \(100\) must be a multiple of 128"):
        jax_ep.fp8.quantize(jnp.zeros((4, 100)))


def test_combine_errors():
    x, idx, w = _inputs()

    def wrong_rows(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E)
        return jax_ep.combine(recv.x[:-1], handle)

    def wrong_weights(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E)
        return jax_ep.combine(recv.x, handle, topk_weights=recv.topk_weights)

    def wrong_handle(x, idx, w):
        recv, _ = jax_ep.dispatch(x, idx, w, num_experts=E)
        return jax_ep.combine(recv.x, recv)

    with pytest.raises(ValueError, match=r"y must have one row per dispatched row, \[12, H\]"):
        _call(wrong_rows, x, idx, w)
    with pytest.raises(ValueError, match=r"topk_weights must be float32 \[12\].*Rank-major rows "
                                         r"carry a token's K weights.*combine\(y, handle\) "
                                         r"without topk_weights"):
        _call(wrong_weights, x, idx, w)
    with pytest.raises(TypeError, match=r"handle must be the DispatchHandle"):
        _call(wrong_handle, x, idx, w)


def test_low_latency_errors():
    x, idx, w = _inputs()

    def float32_x(x, idx):
        return jax_ep.low_latency_dispatch(x, idx, num_experts=E)[0].x

    def bad_hidden(x, idx):
        return jax_ep.low_latency_dispatch(x[:, :100], idx, num_experts=E)[0].x

    def bad_y(x, idx, w):
        recv, handle = jax_ep.low_latency_dispatch(x, idx, num_experts=E)
        return jax_ep.low_latency_combine(recv.x[:, :-1], idx, w, handle)

    with pytest.raises(TypeError, match=r"x must be bfloat16 \[T, H\].*astype\(jnp.bfloat16\)"):
        _call(float32_x, x, idx)
    xb = x.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match=r"hidden size of x \(100\) must be a multiple of 128"):
        _call(bad_hidden, xb, idx)
    with pytest.raises(ValueError, match=r"y must be bfloat16 \[E_local, R\*T, H\] = \[2, 12, H\]"):
        _call(bad_y, xb, idx, w)


def test_layout_errors():
    _, idx, _ = _inputs()
    with pytest.raises(ValueError, match=r"axis_name 'ep' is not a mesh axis in scope"):
        jax_ep.get_dispatch_layout(jnp.asarray(idx[0]), num_experts=E)
    with pytest.raises(ValueError, match=r"num_experts \(3\) must be a multiple"):
        _call(lambda i: jax_ep.get_dispatch_layout(i, num_experts=3).num_invalid, idx)


# --- Values the configuration classes and the runtime used to accept, or refuse opaquely ---


def test_router_config_refuses_non_ints_and_a_bad_scaling():
    from jax_ep.nn import RouterConfig

    with pytest.raises(TypeError, match="RouterConfig.top_k must be an int; got 2.0"):
        RouterConfig(num_experts=8, top_k=2.0)
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="routed_scaling must be a positive finite"):
            RouterConfig(num_experts=8, top_k=2, routed_scaling=bad)


def test_moe_refuses_a_bad_bias_rate_and_a_load_of_another_size():
    from flax import nnx

    from jax_ep.nn import MoE, RouterConfig

    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
    config = RouterConfig(num_experts=16, top_k=2)
    for bad in (float("nan"), -1e-3):
        with pytest.raises(ValueError, match="MoE: bias_rate must be a finite number >= 0"):
            MoE(16, 12, config, mesh=mesh, bias_rate=bad, backend="xla", rngs=nnx.Rngs(0))
    model = MoE(16, 12, config, mesh=mesh, backend="xla", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"load must be \[num_experts\] = \[16\].*float32 \[7\]"):
        model.update_bias(jnp.ones(7))


def test_capacity_factor_reads_numpy_floats_as_written():
    """np.float32(1.1) is 1.1, as the user wrote it (it gave 221 entries where 1.1 gives 220)."""
    for factor in (1.1, np.float32(1.1), np.float64(1.1), np.float16(1.1)):
        got = jax_ep.capacity_from_factor(factor, num_ranks=2, num_tokens=100, top_k=2,
                                          num_experts=4, expert_major=True)
        assert got == 220, (factor, got)


def test_buffer_config_checks_every_field():
    from jax_ep.runtime import BufferConfig

    with pytest.raises(ValueError, match=r"top_k must be at most min\(32, num_experts=8\)"):
        BufferConfig(top_k=40, num_experts=8, num_ranks=2).check()
    with pytest.raises(ValueError, match=r"low_latency_tokens must be an int in \[0, .*2.5"):
        BufferConfig(low_latency_tokens=2.5, num_ranks=2).check()
    with pytest.raises(ValueError, match=r"capacity must be an int in \[1, 2\^31\)"):
        BufferConfig(capacity=1.5, num_ranks=2).check()


def test_initialize_refuses_a_config_of_another_type_and_bad_timeouts(monkeypatch):
    with pytest.raises(TypeError, match="config must be a jax_ep.runtime.BufferConfig"):
        jax_ep.initialize("big")
    for name in ("JAX_EP_TIMEOUT_S", "JAX_EP_START_TIMEOUT_S", "JAX_EP_EXIT_TIMEOUT_S"):
        for bad in ("abc", "-1", "0", "nan", "inf"):
            monkeypatch.setenv(name, bad)
            with pytest.raises(ValueError, match=rf"\${name}='{bad}' is not a positive number"):
                jax_ep.initialize()
        monkeypatch.delenv(name)


def test_a_bad_exit_timeout_set_later_keeps_the_default(monkeypatch, capsys):
    """Set after initialize() checked it: finalize at exit says so and waits 10 s, instead of
    an exception at exit."""
    from jax_ep import runtime

    monkeypatch.setattr(runtime, "_state", {"pretend": "initialized"})
    monkeypatch.setattr(runtime, "finalize", lambda: None)
    monkeypatch.setenv("JAX_EP_EXIT_TIMEOUT_S", "abc")
    assert runtime._finalize_at_exit()
    assert "is not a positive number of seconds" in capsys.readouterr().err


def test_checked_says_the_shard_maps_need_their_mesh():
    mesh = jax.make_mesh((R,), ("ep",), devices=jax.devices()[:R],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    x, idx, w = _inputs()

    def step(x, idx, w):
        return jax.shard_map(_dispatch(), in_specs=jax.P("ep"), out_specs=jax.P("ep"))(
            x, idx, w)

    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"must name their mesh: pass "
                                                            r"jax.shard_map\(\.\.\., mesh=mesh\)"):
        jax_ep.checked(step)(x.reshape(R * T, H), idx.reshape(R * T, K), w.reshape(R * T, K))


def test_wrong_rank_of_topk_idx_says_the_shape_not_a_cast():
    x, idx, w = _inputs()
    with pytest.raises(ValueError, match=r"topk_idx must be int32 \[T, K\]") as info:
        _call(lambda x, idx, w: jax_ep.dispatch(x, idx[:, 0], w, num_experts=E)[0].x, x, idx, w)
    assert "astype" not in str(info.value)
    with pytest.raises(TypeError, match=r"Cast with topk_idx.astype\(jnp.int32\)"):
        _call(lambda x, idx, w: jax_ep.dispatch(x, idx.astype(jnp.int16), w,
                                                num_experts=E)[0].x, x, idx, w)


def test_low_latency_hidden_size_message_without_fp8():
    x, idx, _ = _inputs()
    x = np.zeros((R, T, 100), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"multiple of 128 for the low-latency ops") as info:
        _call(lambda x, idx: jax_ep.low_latency_dispatch(x, idx, num_experts=E)[0].x, x, idx)
    assert "FP8 or not" in str(info.value) and "dispatch in bf16" not in str(info.value)


def test_environment_values_follow_one_case_rule(monkeypatch):
    """`PUT` is `put` for every variable (JAX_EP_XLA_TRANSPORT=RAGGED was refused)."""
    from jax_ep import backends, runtime
    from jax_ep.backends import xla

    monkeypatch.setenv("JAX_EP_PEER_ACCESS", " PUT ")
    assert runtime.peer_access() == "put"
    monkeypatch.setenv(xla.TRANSPORT_ENV_VAR, "RAGGED")
    assert xla.transport() == "ragged"
    monkeypatch.setenv(backends.ENV_VAR, "Xla")
    assert backends.resolve("auto") == "xla"
    monkeypatch.setenv(xla.TRANSPORT_ENV_VAR, "rag")
    with pytest.raises(ValueError, match=r"\$JAX_EP_XLA_TRANSPORT='rag' is not one of"):
        xla.transport()


def test_low_latency_combine_checks_the_routing_of_its_handle():
    """A handle of another dispatch: with low-latency combine, whose topk_idx the handle's
    routing must match, a value check under jax_ep.checked (invalid ids read as -1)."""
    x, idx, w = _inputs()
    x = x.astype(jnp.bfloat16)
    other = np.roll(idx, 1, axis=1)
    invalid = np.where(np.arange(K) == 0, E + 3, idx).astype(np.int32)  # an id out of range

    def per_shard(x, idx, w, combine_idx):
        recv, handle = jax_ep.low_latency_dispatch(x, idx, num_experts=E, on_invalid="mask")
        return jax_ep.low_latency_combine(recv.x, combine_idx, w, handle)

    run = checked(per_shard, R)
    run(x, invalid, w, invalid)
    run(x, invalid, w, np.where(invalid < E, invalid, -1).astype(np.int32))
    with pytest.raises(ValueError, match="topk_idx differs from the routing of the dispatch"):
        run(x, idx, w, other)
