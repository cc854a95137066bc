"""Dispatch along a handle (`jax_ep.dispatch(x2, handle=h)`): another array of the same tokens
into the rows of an earlier dispatch, against the NumPy reference of a dispatch of it with the
same routing (jax_ep.tools.reference), bit for bit; its gradient against the reference's backward
(the unweighted combine); the FP8 pair, widths and dtypes of every kind, both layouts, the
aligned layout, capacity cuts, skewed and masked routings, and the errors that name what is
wrong."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import sharded, to_numpy
from test_dispatch import _assert_bitwise

import jax_ep
from jax_ep import fp8, quant
from jax_ep.tools import reference
from jax_ep.tools.bench.routings import KINDS, make_routing


def _routing(rng, R, T, K, E, kind):
    return make_routing(rng, num_ranks=R, num_tokens=T, top_k=K, num_experts=E, kind=kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_ranks", [1, 3, 4])
@pytest.mark.parametrize("expert_major", [False, True], ids=["rank_major", "expert_major"])
def test_rows_match_a_dispatch_of_the_same_routing(kind, num_ranks, expert_major):
    """x2 (another width and dtype) lands where a dispatch of x2 with the same routing puts
    it, zero past the count, and the first dispatch's results are unchanged."""
    rng = np.random.default_rng()
    R, T, K, E, H, H2 = num_ranks, 11, 3, 2 * num_ranks * 3, 24, 10
    idx, w = _routing(rng, R, T, K, E, kind)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    x2 = rng.standard_normal((R, T, H2)).astype(np.float32)
    capacity = max(1, R * T * (K if expert_major else 1) // 3) if kind == "hot_expert" else None

    def per_shard(x, x2, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, capacity=capacity,
                                       expert_major=expert_major, on_overflow="drop")
        return recv.with_zero_padding().x, jax_ep.dispatch(x2, handle=handle)

    first, along = to_numpy(sharded(per_shard, R)(x, x2, idx, w))
    kw = dict(num_experts=E, capacity=capacity, expert_major=expert_major)
    _assert_bitwise(first, reference.dispatch(x, idx, w, **kw)["x"], "the first dispatch")
    _assert_bitwise(along, reference.dispatch(x2, idx, w, **kw)["x"], "x2 along the handle")


@pytest.mark.parametrize("expert_major", [False, True])
def test_gradient_is_the_unweighted_combine(expert_major):
    """d x2 = the unweighted combine of the rows' cotangent (reference.dispatch_vjp), under
    jit(grad) in shard_map."""
    rng = np.random.default_rng()
    R, T, K, E, H = 4, 9, 2, 8, 16
    idx, w = _routing(rng, R, T, K, E, "empty_ranks")
    x = rng.standard_normal((R, T, H)).astype(np.float32)
    x2 = rng.standard_normal((R, T, 8)).astype(np.float32)
    cap = reference.dispatch(x, idx, w, num_experts=E, expert_major=expert_major)["x"].shape[1]
    g = rng.standard_normal((R, cap, 8)).astype(np.float32)

    def per_shard(x, x2, idx, w, g):
        _, handle = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=expert_major)
        return jax.grad(lambda x2: jnp.sum(jax_ep.dispatch(x2, handle=handle) * g))(x2)

    got = to_numpy(sharded(per_shard, R)(x, x2, idx, w, g))
    dw = np.zeros((R, cap) if expert_major else (R, cap, K), np.float32)
    want, _ = reference.dispatch_vjp(g, dw, idx, num_experts=E, expert_major=expert_major)
    _assert_bitwise(got, want, "d x2")


def test_fp8_pair_widths_and_dtypes():
    """The FP8 pair travels as a pair; bfloat16, float16 and a float32 width of 2 (8 bytes)
    as they are."""
    rng = np.random.default_rng()
    R, T, K, E = 2, 7, 2, 4
    idx, w = _routing(rng, R, T, K, E, "duplicates")
    x = rng.standard_normal((R, T, 256)).astype(np.float32)
    pair = fp8.quantize(jnp.asarray(x.reshape(R * T, 256)))
    pair = tuple(np.asarray(a).reshape(R, T, -1) for a in pair)
    others = {"bfloat16": x[..., :24].astype(ml_dtypes.bfloat16),
              "float16": x[..., :40].astype(np.float16),
              "narrow": x[..., :2]}

    def per_shard(x, pair, others, idx, w):
        _, handle = jax_ep.dispatch(x, idx, w, num_experts=E)
        return (jax_ep.dispatch(pair, handle=handle),
                {k: jax_ep.dispatch(v, handle=handle) for k, v in others.items()})

    got_pair, got = to_numpy(sharded(per_shard, R)(x, pair, others, idx, w))
    want = reference.dispatch(pair, idx, w, num_experts=E)
    _assert_bitwise(got_pair[0], want["x"], "x_fp8 along the handle")
    _assert_bitwise(got_pair[1], want["scales"], "scales along the handle")
    for key, value in others.items():
        _assert_bitwise(got[key], reference.dispatch(value, idx, w, num_experts=E)["x"], key)


@pytest.mark.parametrize("format", ["mxfp8", "nvfp4"])
def test_a_quantized_array_arrives_as_one(format):
    """A Quantized x2 arrives as the Quantized that a dispatch of it returns, bit for bit."""
    rng = np.random.default_rng()
    R, T, K, E, H = 3, 6, 2, 6, 64
    idx, w = _routing(rng, R, T, K, E, "uniform")
    x = rng.standard_normal((R, T, H)).astype(np.float32)

    def per_shard(x, idx, w):
        q = quant.quantize(x, format)
        recv, handle = jax_ep.dispatch(q, idx, w, num_experts=E)
        return recv.with_zero_padding().x, jax_ep.dispatch(q, handle=handle)

    want, got = to_numpy(sharded(per_shard, R)(x, idx, w))
    assert got.format == want.format == format
    for i, (g, v) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        _assert_bitwise(g, v, f"leaf {i} of the Quantized rows")


def test_aligned_layout():
    """An aligned expert-major handle puts x2's entries where it put the first dispatch's."""
    rng = np.random.default_rng()
    R, T, K, E = 2, 13, 3, 8
    idx, w = _routing(rng, R, T, K, E, "hot_expert")
    x = rng.standard_normal((R, T, 16)).astype(np.float32)

    def per_shard(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=True,
                                       expert_alignment=4)
        return recv.x, jax_ep.dispatch(x * 2, handle=handle)

    first, along = to_numpy(sharded(per_shard, R)(x, idx, w))
    _assert_bitwise(along, first * 2, "x * 2 along the aligned handle")


def test_errors_name_what_is_wrong():
    rng = np.random.default_rng()
    R, T, K, E = 2, 5, 2, 4
    idx, w = _routing(rng, R, T, K, E, "uniform")
    x = rng.standard_normal((R, T, 8)).astype(np.float32)

    def run(call):
        def per_shard(x, idx, w):
            _, handle = jax_ep.dispatch(x, idx, w, num_experts=E)
            return call(x, idx, handle)

        return sharded(per_shard, R)(x, idx, w)

    with pytest.raises(ValueError, match=r"x has 4 rows but the handle's dispatch had 5"):
        run(lambda x, idx, h: jax_ep.dispatch(x[:4], handle=h))
    with pytest.raises(ValueError, match=r"leave num_experts out \(the handle's is 4; got 8\)"):
        run(lambda x, idx, h: jax_ep.dispatch(x, handle=h, num_experts=8))
    with pytest.raises(ValueError, match=r"leave topk_idx out \(the handle holds the routing\)"):
        run(lambda x, idx, h: jax_ep.dispatch(x, idx, handle=h))
    with pytest.raises(ValueError, match=r"leave axis_name out \(the handle's is 'ep'"):
        run(lambda x, idx, h: jax_ep.dispatch(x, handle=h, axis_name="data"))
    with pytest.raises(TypeError, match=r"handle must be the DispatchHandle"):
        run(lambda x, idx, h: jax_ep.dispatch(x, handle=(h,)))
    with pytest.raises(TypeError, match=r"pass the routing \(topk_idx, topk_weights and "):
        run(lambda x, idx, h: jax_ep.dispatch(x, idx))
    # Agreeing layout arguments are accepted.
    run(lambda x, idx, h: jax_ep.dispatch(x, handle=h, num_experts=E, axis_name="ep",
                                          expert_major=False))


def test_a_handle_from_another_axis_size():
    """A handle whose dispatch ran over another number of ranks of its axis is refused (here
    one relabelled by hand: arrays of another group size would not even shard)."""
    rng = np.random.default_rng()
    R, T, K, E = 2, 4, 2, 4
    idx, w = _routing(rng, R, T, K, E, "uniform")
    x = rng.standard_normal((R, T, 8)).astype(np.float32)

    def per_shard(x, idx, w):
        _, handle = jax_ep.dispatch(x, idx, w, num_experts=E)
        return jax_ep.dispatch(x, handle=dataclasses.replace(handle, num_ranks=4))

    with pytest.raises(ValueError, match=r"over 4 ranks of axis 'ep', which has 2 here: use "
                       r"it in the same shard_map"):
        sharded(per_shard, R)(x, idx, w)
