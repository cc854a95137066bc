"""Bad input: every case raises a clear error that names the argument (never a crash).

Static problems are raised at trace time as ValueError/TypeError; value problems (ids out of
range, capacity) through jax_ep.checked (test_dispatch.py, test_low_latency.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import sharded

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
        _dispatch(), lambda x, i, w: (x, i, w.astype(np.float16)), TypeError,
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
    with pytest.raises(ValueError, match=r"topk_weights must be float32 \[12\]"):
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
