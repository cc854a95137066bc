"""Normal dispatch and combine against the NumPy reference (jax_ep.tools.reference).

Covers: every routing kind (uniform, hot expert, masks, empty ranks, duplicate choices),
R in {1, 2, 4, 8}, rank-major and expert-major layouts, BF16/float32 and FP8 payloads,
weighted and unweighted combine, capacity overflow ("drop" counts, "error" message),
invalid expert ids, determinism, and random shapes (T, E, K not powers of two) with
hypothesis. Data movement is compared bit for bit; combine too, since its order is fixed.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest
from harness import checked, compiled_text, sharded, to_numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_virtual import nan_padding

import jax_ep
from jax_ep.tools import reference
from jax_ep.tools.bench.routings import KINDS, make_routing

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _assert_bitwise(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    g = got.view(np.uint8) if got.dtype.itemsize == 1 else got.view(f"u{got.dtype.itemsize}")
    w = want.view(np.uint8) if want.dtype.itemsize == 1 else want.view(f"u{want.dtype.itemsize}")
    bad = np.argwhere(g != w)
    assert bad.size == 0, f"{what}: {len(bad)} elements differ, first at {bad[0].tolist()}"


def _run(num_ranks, x, idx, w, y, yw, *, num_experts, capacity=None, expert_major=False):
    """dispatch, then combine of `y` (unweighted and weighted by `yw`) on R devices."""

    def per_shard(x, idx, w, y, yw):
        recv, handle = jax_ep.dispatch(
            x, idx, w, num_experts=num_experts, capacity=capacity, expert_major=expert_major,
            on_overflow="drop",
        )
        return (
            recv.with_zero_padding(),
            jax_ep.combine(y, handle),
            jax_ep.combine(y, handle, topk_weights=yw),
        )

    return to_numpy(sharded(per_shard, num_ranks)(x, idx, w, y, yw))


def check_against_reference(
    rng, *, num_ranks, num_tokens, top_k, num_experts, hidden, kind, dtype=np.float32,
    capacity=None, expert_major=False,
):
    idx, w = make_routing(
        rng, num_ranks=num_ranks, num_tokens=num_tokens, top_k=top_k,
        num_experts=num_experts, kind=kind,
    )
    x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(dtype)
    want = reference.dispatch(
        x, idx, w, num_experts=num_experts, capacity=capacity, expert_major=expert_major
    )
    cap = want["x"].shape[1]
    y = nan_padding(rng.standard_normal((num_ranks, cap, hidden)), want["num_tokens"])
    y = y.astype(dtype)
    yw = rng.random((num_ranks, cap)).astype(np.float32)
    recv, out, out_w = _run(
        num_ranks, x, idx, w, y, yw, num_experts=num_experts, capacity=capacity,
        expert_major=expert_major,
    )
    for key in ("x", "topk_idx", "topk_weights", "num_tokens", "tokens_per_expert",
                "num_dropped", "num_invalid"):
        _assert_bitwise(getattr(recv, key), want[key], f"dispatch {key}")
    if expert_major:
        _assert_bitwise(recv.group_sizes, want["group_sizes"], "dispatch group_sizes")
    kw = dict(num_experts=num_experts, capacity=capacity, expert_major=expert_major)
    _assert_bitwise(out, reference.combine(y, idx, **kw), "combine")
    _assert_bitwise(out_w, reference.combine(y, idx, weights=yw, **kw), "weighted combine")
    return want


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("expert_major", [False, True], ids=["rank_major", "expert_major"])
def test_matches_reference(kind, num_ranks, expert_major):
    rng = np.random.default_rng()
    check_against_reference(
        rng, num_ranks=num_ranks, num_tokens=13, top_k=6, num_experts=3 * num_ranks * 2,
        hidden=40, kind=kind, dtype=ml_dtypes.bfloat16, expert_major=expert_major,
    )


@settings(
    max_examples=12, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    num_ranks=st.sampled_from([1, 2, 4, 8]),
    num_tokens=st.integers(1, 23),
    top_k=st.sampled_from([1, 2, 6, 8]),
    experts_per_rank=st.integers(1, 9),
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from(sorted(DTYPES)),
    expert_major=st.booleans(),
    capacity_fraction=st.sampled_from([None, 0.3, 0.8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_shapes(
    num_ranks, num_tokens, top_k, experts_per_rank, kind, dtype, expert_major,
    capacity_fraction, seed,
):
    num_experts = num_ranks * experts_per_rank
    top_k = min(top_k, num_experts)
    capacity = None
    if capacity_fraction is not None:
        worst = num_ranks * num_tokens * (min(top_k, experts_per_rank) if expert_major else 1)
        capacity = max(1, int(worst * capacity_fraction))
    check_against_reference(
        np.random.default_rng(seed), num_ranks=num_ranks, num_tokens=num_tokens, top_k=top_k,
        num_experts=num_experts, hidden=24, kind=kind, dtype=DTYPES[dtype],
        capacity=capacity, expert_major=expert_major,
    )


@pytest.mark.parametrize("expert_major", [False, True])
def test_half_precision_weights_are_upcast(expert_major):
    """topk_weights in bfloat16 or float16 (a router in the model's dtype) dispatch as their
    float32 values, and their gradient comes back in their dtype."""
    rng = np.random.default_rng()
    R, T, K, E = 2, 7, 3, 6
    idx, w = make_routing(rng, num_ranks=R, num_tokens=T, top_k=K, num_experts=E,
                          kind="uniform")
    x = rng.standard_normal((R, T, 8)).astype(np.float32)
    for dtype in (ml_dtypes.bfloat16, np.float16):
        half = w.astype(dtype)

        def per_shard(x, idx, w):
            recv, _ = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=expert_major)
            grad = jax.grad(lambda w: jax_ep.dispatch(
                x, idx, w, num_experts=E, expert_major=expert_major)[0].topk_weights.sum())(w)
            return recv.with_zero_padding().topk_weights, grad

        got, grad = to_numpy(sharded(per_shard, R)(x, idx.astype(np.int32), half))
        want = reference.dispatch(x, idx, half.astype(np.float32), num_experts=E,
                                  expert_major=expert_major)["topk_weights"]
        _assert_bitwise(got, want, f"{np.dtype(dtype).name} weights")
        assert grad.dtype == dtype and grad.shape == w.shape


def test_drop_reports_exact_count():
    rng = np.random.default_rng()
    want = check_against_reference(
        rng, num_ranks=4, num_tokens=16, top_k=4, num_experts=8, hidden=8, kind="hot_expert",
        capacity=5,
    )
    assert want["num_dropped"].sum() > 0  # the case really overflows


@pytest.mark.parametrize("expert_major", [False, True])
def test_overflow_error_names_capacity_and_needed_size(expert_major):
    rng = np.random.default_rng()
    num_ranks, num_tokens, num_experts = 4, 16, 8
    idx, w = make_routing(rng, num_ranks=num_ranks, num_tokens=num_tokens, top_k=2,
                          num_experts=num_experts, kind="hot_expert")
    x = rng.standard_normal((num_ranks, num_tokens, 8)).astype(np.float32)
    needed = reference.dispatch(x, idx, w, num_experts=num_experts, expert_major=expert_major)
    worst = int((needed["num_tokens"] + needed["num_dropped"]).max())

    def per_shard(x, idx, w):
        recv, _ = jax_ep.dispatch(x, idx, w, num_experts=num_experts, capacity=3,
                                  expert_major=expert_major)
        return recv.x

    # Free in an ordinary program: no host callback, no collective; it runs and counts.
    hlo = compiled_text(per_shard, num_ranks, x, idx, w)
    assert "callback" not in hlo and "all-reduce" not in hlo
    jax.block_until_ready(sharded(per_shard, num_ranks)(x, idx, w))
    # Raised through jax_ep.checked, naming every rank that overflowed.
    with pytest.raises(ValueError, match=rf"capacity=3 is too small: this rank needs {worst} "
                                         rf".*capacity>={worst}") as info:
        checked(per_shard, num_ranks)(x, idx, w)
    over = (needed["num_tokens"] + needed["num_dropped"]) > 3
    assert str(info.value).count("is too small") == over.sum()


def test_fp8_pair_moves_bit_for_bit():
    rng = np.random.default_rng()
    num_ranks, num_tokens, num_experts, hidden = 4, 9, 12, 256
    idx, w = make_routing(rng, num_ranks=num_ranks, num_tokens=num_tokens, top_k=3,
                          num_experts=num_experts, kind="masked")
    x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    q, s = reference.quantize(x)
    want = reference.dispatch((q, s), idx, w, num_experts=num_experts)

    def per_shard(q, s, idx, w):
        recv, _ = jax_ep.dispatch((q, s), idx, w, num_experts=num_experts)
        return recv.with_zero_padding()

    got = to_numpy(sharded(per_shard, num_ranks)(q, s, idx, w))
    _assert_bitwise(got.x, want["x"], "fp8 x")
    _assert_bitwise(got.scales, want["scales"], "fp8 scales")


@pytest.mark.parametrize("on_invalid", ["error", "mask"])
def test_invalid_ids_are_counted_or_raise(on_invalid):
    rng = np.random.default_rng()
    num_ranks, num_tokens, num_experts = 2, 6, 4
    idx, w = make_routing(rng, num_ranks=num_ranks, num_tokens=num_tokens, top_k=2,
                          num_experts=num_experts)
    idx[0, 1, 0] = num_experts  # one past the end
    idx[1, 3, 1] = -7
    x = rng.standard_normal((num_ranks, num_tokens, 8)).astype(np.float32)

    def per_shard(x, idx, w):
        recv, _ = jax_ep.dispatch(x, idx, w, num_experts=num_experts, on_invalid=on_invalid)
        return recv.with_zero_padding()

    if on_invalid == "error":
        with pytest.raises(ValueError, match=r"topk_idx holds 1 expert id\(s\) outside "
                                             r"\[-1, 4\) on this rank") as info:
            checked(per_shard, num_ranks)(x, idx, w)
        assert str(info.value).count("topk_idx holds") == 2  # both ranks
    got = to_numpy(sharded(per_shard, num_ranks)(x, idx, w))
    want = reference.dispatch(x, idx, w, num_experts=num_experts)
    np.testing.assert_array_equal(got.num_invalid, [1, 1])
    _assert_bitwise(got.x, want["x"], "x with invalid ids masked")
    _assert_bitwise(got.topk_idx, want["topk_idx"], "topk_idx with invalid ids masked")


def test_deterministic_bits():
    rng = np.random.default_rng()
    idx, w = make_routing(rng, num_ranks=8, num_tokens=32, top_k=8, num_experts=64)
    x = rng.standard_normal((8, 32, 64)).astype(ml_dtypes.bfloat16)
    y = rng.standard_normal((8, 8 * 32 * 8, 64)).astype(ml_dtypes.bfloat16)
    yw = rng.random((8, 8 * 32 * 8)).astype(np.float32)
    first = _run(8, x, idx, w, y, yw, num_experts=64, expert_major=True)
    second = _run(8, x, idx, w, y, yw, num_experts=64, expert_major=True)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        _assert_bitwise(a, b, "second run")


def test_eager_and_jit_agree():
    rng = np.random.default_rng()
    idx, w = make_routing(rng, num_ranks=2, num_tokens=5, top_k=2, num_experts=6)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)

    def per_shard(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=6)
        return recv.x, jax_ep.combine(recv.x, handle)

    eager = to_numpy(sharded(per_shard, 2, jit=False)(x, idx, w))
    jitted = to_numpy(sharded(per_shard, 2)(x, idx, w))
    for a, b in zip(eager, jitted, strict=True):
        _assert_bitwise(a, b, "eager vs jit")


@pytest.mark.parametrize("expert_major", [False, True])
@pytest.mark.parametrize("num_ranks", [1, 2])
def test_combine_sums_from_positive_zero(num_ranks, expert_major):
    """A single term of -0.0 (a zero row times a negative weight, or a -0.0 row) sums from
    +0.0 to +0.0 (docs/contract.md, "combine"), also where only one term is summed."""
    T, H, E = 3, 8, num_ranks
    idx = np.zeros((num_ranks, T, 1), np.int32)  # every token to expert 0 on rank 0
    w = -np.ones((num_ranks, T, 1), np.float32)
    x = np.zeros((num_ranks, T, H), np.float32)
    x[:, :, H // 2:] = -0.0

    def per_shard(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=expert_major)
        weights = recv.topk_weights if expert_major else recv.topk_weights.sum(axis=1)
        return (jax_ep.combine(recv.x, handle, topk_weights=weights),
                jax_ep.combine(recv.x, handle))

    for out in to_numpy(sharded(per_shard, num_ranks)(x, idx, w)):
        assert not np.signbit(out).any(), out


def test_expert_major_feeds_ragged_dot():
    """The expert-major rows and group sizes drive jax.lax.ragged_dot directly."""
    rng = np.random.default_rng()
    num_ranks, num_tokens, num_experts, hidden, out_dim = 4, 7, 8, 16, 5
    idx, w = make_routing(rng, num_ranks=num_ranks, num_tokens=num_tokens, top_k=3,
                          num_experts=num_experts)
    x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    experts = rng.standard_normal((num_ranks, num_experts // num_ranks, hidden, out_dim))
    experts = experts.astype(np.float32)

    def per_shard(x, idx, w, experts):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=num_experts, expert_major=True)
        y = jax.lax.ragged_dot(recv.x, experts, recv.group_sizes)
        return jax_ep.combine(y, handle, topk_weights=recv.topk_weights)

    got = to_numpy(sharded(per_shard, num_ranks)(x, idx, w, experts))
    all_experts = experts.reshape(num_experts, hidden, out_dim)
    want = np.zeros((num_ranks, num_tokens, out_dim))
    for r in range(num_ranks):
        for t in range(num_tokens):
            for k in range(3):
                if idx[r, t, k] >= 0:
                    want[r, t] += w[r, t, k] * (x[r, t] @ all_experts[idx[r, t, k]])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_expert_major_default_capacity_overflows_only_with_duplicates():
    """E/R = 1, K = 2, every token picks expert 0 twice: rank 0 needs twice the entries the
    default R*T*min(K, E/R) holds. The error says why the default was not enough and what
    always is."""
    num_ranks, num_tokens = 2, 4
    idx = np.zeros((num_ranks, num_tokens, 2), np.int32)
    w = np.ones(idx.shape, np.float32)
    x = np.ones((num_ranks, num_tokens, 8), np.float32)

    def per_shard(x, idx, w):
        recv, _ = jax_ep.dispatch(x, idx, w, num_experts=num_ranks, expert_major=True)
        return recv.x

    default, needed = num_ranks * num_tokens, num_ranks * num_tokens * 2
    with pytest.raises(ValueError) as info:
        checked(per_shard, num_ranks)(x, idx, w)
    message = str(info.value)
    assert f"capacity={default} is too small: this rank needs {needed} expert entries" in message
    assert "unless tokens choose the same expert more than once" in message
    assert f"R*T*K = {num_ranks * num_tokens * 2} always does" in message


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_float32_partials_round_only_the_result(dtype):
    """combine(partial_dtype=jnp.float32), expert-major: each rank's partial travels in
    float32 and only the home's sum is rounded to y's dtype: bit for bit the reference's
    float32 combine of y's values, cast (docs/contract.md), and closer to float64 than the
    default, whose partials are rounded before the sum; the gradient is the default's."""
    rng = np.random.default_rng()
    R, T, K, H = 4, 11, 4, 24
    E = 2 * R
    idx, w = make_routing(rng, num_ranks=R, num_tokens=T, top_k=K, num_experts=E,
                          kind="uniform")
    x = rng.standard_normal((R, T, H)).astype(dtype)
    cap = reference.dispatch(x, idx, w, num_experts=E, expert_major=True)["x"].shape[1]
    y = rng.standard_normal((R, cap, H)).astype(dtype)
    yw = rng.random((R, cap)).astype(np.float32)

    def per_shard(x, idx, w, y, yw):
        _, handle = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=True)

        def loss(y, partial_dtype):
            out = jax_ep.combine(y, handle, topk_weights=yw, partial_dtype=partial_dtype)
            return jax.numpy.sum(out.astype(np.float32) ** 2), out

        (_, f32), grad32 = jax.value_and_grad(loss, has_aux=True)(y, np.float32)
        (_, rounded), grad = jax.value_and_grad(loss, has_aux=True)(y, None)
        return f32, rounded, grad32, grad

    f32, rounded, grad32, grad = to_numpy(sharded(per_shard, R)(x, idx, w, y, yw))
    assert f32.dtype == dtype
    kw = dict(num_experts=E, expert_major=True, weights=yw)
    _assert_bitwise(f32, reference.combine(y.astype(np.float32), idx, **kw).astype(dtype),
                    "float32 partials")
    _assert_bitwise(rounded, reference.combine(y, idx, **kw), "partials in y's dtype")
    exact = reference.combine(y.astype(np.float64), idx, **kw)
    err32, err = (np.abs(a.astype(np.float64) - exact).max() for a in (f32, rounded))
    assert err32 <= err, (err32, err)
    # Each gradient is the default backward of its own output: its cotangent 2 * out sent
    # back along the handle and weighted (within the rounding of that product; comparing
    # the two gradients with each other would bound the partials' rounding instead, which
    # cancellation in a sum makes as large as the partials' step).
    for out, g in ((f32, grad32), (rounded, grad)):
        cotangent = (2 * out.astype(np.float32)).astype(dtype)
        sent = reference.dispatch(cotangent, idx, w, num_experts=E, expert_major=True)["x"]
        want = sent.astype(np.float32) * yw[..., None]
        np.testing.assert_allclose(g.astype(np.float32), want, rtol=1e-2, atol=1e-6)


def test_float32_partials_are_refused_rank_major():
    rng = np.random.default_rng()
    idx, w = make_routing(rng, num_ranks=2, num_tokens=4, top_k=2, num_experts=4)
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)

    def per_shard(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=4)
        return jax_ep.combine(recv.x, handle, partial_dtype=np.float32)

    with pytest.raises(ValueError, match="partial_dtype applies to expert-major combines"):
        sharded(per_shard, 2)(x, idx, w)


@pytest.mark.parametrize("kind", ["uniform", "hot_expert", "duplicates"])
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_source_drop_order_keeps_maxtexts_entries(kind, num_ranks):
    """drop_order="source": an expert-major capacity keeps the first entries by source rank,
    then local expert, token and choice (MaxText's order), laid out by expert as always;
    every result, the combine and both gradients against the reference."""
    rng = np.random.default_rng()
    T, K, H = 9, 3, 20
    E = 2 * num_ranks
    idx, w = make_routing(rng, num_ranks=num_ranks, num_tokens=T, top_k=K, num_experts=E,
                          kind=kind)
    idx[0, 0, 0] = -1  # a masked choice
    x = rng.standard_normal((num_ranks, T, H)).astype(ml_dtypes.bfloat16)
    capacity = int(rng.integers(1, T * K))  # overflows on some ranks
    kw = dict(num_experts=E, capacity=capacity, expert_major=True, drop_order="source")
    want = reference.dispatch(x, idx, w, **kw)
    y = rng.standard_normal(want["x"].shape).astype(np.float32)
    d_out = rng.standard_normal((num_ranks, T, H)).astype(np.float32)
    d_rows = rng.standard_normal(want["x"].shape).astype(np.float32)
    d_weights = rng.standard_normal(want["topk_weights"].shape).astype(np.float32)

    def per_shard(x, idx, w, y, d_out, d_rows, d_weights):
        def forward(x, w, y):
            recv, handle = jax_ep.dispatch(x, idx, w, on_overflow="drop", **kw)
            out = jax_ep.combine(y, handle, topk_weights=recv.topk_weights)
            return recv, out

        (recv, out), vjp = jax.vjp(forward, x, w, y)
        d_recv = jax.tree.map(jax.numpy.zeros_like, recv)
        d_recv = dataclasses.replace(d_recv, x=d_rows.astype(recv.x.dtype),
                                     topk_weights=d_weights)
        return recv.with_zero_padding(), out, vjp((d_recv, d_out))

    recv, out, (gx, gw, gy) = to_numpy(sharded(per_shard, num_ranks)(
        x, idx, w, y, d_out, d_rows, d_weights))
    for key in ("x", "topk_idx", "topk_weights", "num_tokens", "tokens_per_expert",
                "num_dropped", "group_sizes"):
        _assert_bitwise(getattr(recv, key), want[key], f"dispatch {key}")
    yw = want["topk_weights"]
    _assert_bitwise(out, reference.combine(y, idx, weights=yw, **kw), "combine")
    dy, dyw = reference.combine_vjp(d_out, y, idx, weights=yw, **kw)
    np.testing.assert_allclose(gy, dy, rtol=1e-6, atol=1e-6)
    # The dispatch's backward of the received rows' and weights' cotangents (the combine's
    # weights are the received ones, so their cotangent adds to d_weights).
    want_gx, want_gw = reference.dispatch_vjp(d_rows.astype(ml_dtypes.bfloat16),
                                              d_weights + dyw, idx, **kw)
    np.testing.assert_allclose(gx.astype(np.float32), want_gx.astype(np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(gw, want_gw, rtol=1e-5, atol=1e-5)


def test_the_two_drop_orders_keep_different_entries():
    """Source 0's tokens choose rank 0's expert 1, source 1's its expert 0, capacity 2: by
    expert the two entries of expert 0 (source 1) are kept, by source those of source 0."""
    T, K, E, H = 2, 1, 4, 8
    idx = np.array([[[1], [1]], [[0], [0]]], np.int32)
    w = np.ones((2, T, K), np.float32)
    x = np.arange(2 * T * H, dtype=np.float32).reshape(2, T, H)

    def per_shard(order):
        def run(x, idx, w):
            recv, _ = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=True,
                                      capacity=2, on_overflow="drop", drop_order=order)
            return recv.x, recv.topk_idx, recv.num_dropped
        return run

    for order, source, expert in (("expert", 1, 0), ("source", 0, 1)):
        rows, ids, dropped = to_numpy(sharded(per_shard(order), 2)(x, idx, w))
        np.testing.assert_array_equal(rows[0], x[source], err_msg=order)
        np.testing.assert_array_equal(ids[0], [expert, expert], err_msg=order)
        assert dropped[0] == 2, order

    def rank_major(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=E, drop_order="expert")[0].x

    with pytest.raises(ValueError, match="drop_order='expert' orders expert-major entries"):
        sharded(rank_major, 2)(x, idx, w)
