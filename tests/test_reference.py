"""Checks of the NumPy reference (jax_ep.tools.reference) against hand-computed cases.

Expected values are written out as literals, worked by hand from docs/contract.md. Random
inputs only enter identities that hold exactly (adjoint identities on integer-valued data).
"""

import importlib.util
import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest

try:
    from jax_ep.tools import reference as ref
except ImportError:  # the package is not importable: load the module from its file
    _path = pathlib.Path(__file__).resolve().parents[1] / "jax_ep" / "reference.py"
    _spec = importlib.util.spec_from_file_location("jax_ep_reference", _path)
    ref = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = ref
    _spec.loader.exec_module(ref)

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
f32 = np.float32

# ---------------------------------------------------------------------------------------------
# The hand-worked case: R=2, T=3, K=2, E=4 (E_local=2: rank 0 holds experts 0, 1; rank 1
# holds experts 2, 3).
#
#   rank 0: t0 [0, 3]   -> rank 0 (local 0) and rank 1 (local 1)
#           t1 [-1, 7]  -> nowhere; 7 is invalid
#           t2 [1, 1]   -> rank 0, local 1 twice (duplicate choice)
#   rank 1: t0 [2, -1]  -> rank 1 (local 0)
#           t1 [3, 0]   -> rank 1 (local 1) and rank 0 (local 0)
#           t2 [2, 3]   -> rank 1 (local 0 and 1)
# ---------------------------------------------------------------------------------------------
E = 4
IDX = np.array(
    [
        [[0, 3], [-1, 7], [1, 1]],
        [[2, -1], [3, 0], [2, 3]],
    ],
    dtype=np.int32,
)
W = np.array(
    [
        [[0.5, 0.25], [9.0, 9.5], [0.125, 0.375]],
        [[0.75, 9.0], [1.5, 2.5], [3.0, 4.0]],
    ],
    dtype=np.float32,
)
H = 4


def _x(dtype=np.float32):
    """Token (s, t) holds 10*s + t + [0, 0.25, 0.5, 0.75]."""
    x = np.zeros((2, 3, H), dtype=np.float32)
    for s in range(2):
        for t in range(3):
            x[s, t] = 10 * s + t + np.array([0, 0.25, 0.5, 0.75])
    return x.astype(dtype)


def _eq(got, want):
    """Exact equality, including dtype and shape."""
    want = np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(
        np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8)
    )


def _i32(a):
    return np.array(a, dtype=np.int32)


def _f32(a):
    return np.array(a, dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


def test_dispatch_layout_hand_case():
    out = ref.dispatch_layout(IDX, num_experts=E)
    _eq(out["num_tokens_per_rank"], _i32([[2, 1], [1, 3]]))
    _eq(out["num_tokens_per_expert"], _i32([[1, 2, 0, 1], [1, 0, 2, 2]]))
    _eq(
        out["is_token_in_rank"],
        np.array(
            [
                [[True, True], [False, False], [True, False]],
                [[False, True], [True, True], [False, True]],
            ]
        ),
    )
    _eq(out["num_invalid"], _i32([1, 0]))


def test_invalid_ids_of_every_kind_are_counted():
    idx = np.array([[[4, -2], [-1, 100]], [[-7, 3], [-1, -1]]], dtype=np.int32)
    out = ref.dispatch_layout(idx, num_experts=E)
    _eq(out["num_invalid"], _i32([3, 1]))
    _eq(out["num_tokens_per_expert"], _i32([[0, 0, 0, 0], [0, 0, 0, 1]]))
    _eq(out["num_tokens_per_rank"], _i32([[0, 0], [0, 1]]))


# ---------------------------------------------------------------------------------------------
# Rank-major dispatch
# ---------------------------------------------------------------------------------------------


def test_dispatch_rank_major_hand_case():
    x = _x()
    out = ref.dispatch(x, IDX, W, num_experts=E)
    assert set(out) == {
        "x", "topk_idx", "topk_weights", "num_tokens", "tokens_per_expert", "num_dropped",
        "num_invalid",
    }  # fmt: skip
    z = np.zeros(H, np.float32)
    # Rank 0 receives (0,0), (0,2), (1,1); rank 1 receives (0,0), (1,0), (1,1), (1,2).
    _eq(out["x"], np.stack([
        [x[0, 0], x[0, 2], x[1, 1], z, z, z],
        [x[0, 0], x[1, 0], x[1, 1], x[1, 2], z, z],
    ]))  # fmt: skip
    _eq(out["topk_idx"], _i32([
        [[0, -1], [1, 1], [-1, 0], [-1, -1], [-1, -1], [-1, -1]],
        [[-1, 1], [0, -1], [1, -1], [0, 1], [-1, -1], [-1, -1]],
    ]))  # fmt: skip
    _eq(out["topk_weights"], _f32([
        [[0.5, 0], [0.125, 0.375], [0, 2.5], [0, 0], [0, 0], [0, 0]],
        [[0, 0.25], [0.75, 0], [1.5, 0], [3.0, 4.0], [0, 0], [0, 0]],
    ]))  # fmt: skip
    _eq(out["num_tokens"], _i32([3, 4]))
    _eq(out["tokens_per_expert"], _i32([[2, 2], [2, 3]]))
    _eq(out["num_dropped"], _i32([0, 0]))
    _eq(out["num_invalid"], _i32([1, 0]))


def test_dispatch_copies_bf16_rows_bit_for_bit():
    rng = np.random.default_rng()
    bits = rng.integers(0, 2**16, size=(2, 3, H), dtype=np.uint16)
    x = bits.view(BF16)  # arbitrary bit patterns, NaNs and negative zeros included
    out = ref.dispatch(x, IDX, W, num_experts=E)
    assert out["x"].dtype == BF16
    got = out["x"].view(np.uint16)
    want = np.zeros((2, 6, H), np.uint16)
    for d, rows in enumerate([[(0, 0), (0, 2), (1, 1)], [(0, 0), (1, 0), (1, 1), (1, 2)]]):
        for i, (s, t) in enumerate(rows):
            want[d, i] = bits[s, t]
    np.testing.assert_array_equal(got, want)


def test_dispatch_fp8_pair_is_copied_with_its_scales():
    rng = np.random.default_rng()
    bits = rng.integers(0, 256, size=(2, 3, 128), dtype=np.uint8)
    q = bits.view(FP8)
    scales = _f32([[[1.0], [2.0], [3.0]], [[4.0], [5.0], [6.0]]])
    out = ref.dispatch((q, scales), IDX, W, num_experts=E)
    assert out["x"].dtype == FP8
    np.testing.assert_array_equal(out["x"].view(np.uint8)[0, :3], bits[[0, 0, 1], [0, 2, 1]])
    np.testing.assert_array_equal(out["x"].view(np.uint8)[0, 3:], 0)
    _eq(out["scales"], _f32([
        [[1.0], [3.0], [5.0], [0], [0], [0]],
        [[1.0], [4.0], [5.0], [6.0], [0], [0]],
    ]))  # fmt: skip


def test_dispatch_rank_major_capacity_overflow():
    x = _x()
    out = ref.dispatch(x, IDX, W, num_experts=E, capacity=2)
    _eq(out["x"], np.stack([[x[0, 0], x[0, 2]], [x[0, 0], x[1, 0]]]))
    _eq(out["topk_idx"], _i32([[[0, -1], [1, 1]], [[-1, 1], [0, -1]]]))
    _eq(out["topk_weights"], _f32([[[0.5, 0], [0.125, 0.375]], [[0, 0.25], [0.75, 0]]]))
    _eq(out["num_tokens"], _i32([2, 2]))
    _eq(out["num_dropped"], _i32([1, 2]))
    _eq(out["tokens_per_expert"], _i32([[1, 2], [1, 1]]))


# ---------------------------------------------------------------------------------------------
# Expert-major dispatch
# ---------------------------------------------------------------------------------------------


def test_dispatch_expert_major_hand_case():
    x = _x()
    out = ref.dispatch(x, IDX, W, num_experts=E, expert_major=True)
    z = np.zeros(H, np.float32)
    # Default capacity R*T*min(K, E_local) = 12.
    # Rank 0 entries (j, row, k): (0,0,0) (1,1,0) (1,1,1) (0,2,1) -> sorted by j:
    #   (0,0,0)=token (0,0), (0,2,1)=token (1,1), (1,1,0)=token (0,2), (1,1,1)=token (0,2).
    # Rank 1 entries: (1,0,1) (0,1,0) (1,2,0) (0,3,0) (1,3,1) -> sorted by j:
    #   (0,1,0)=(1,0), (0,3,0)=(1,2), (1,0,1)=(0,0), (1,2,0)=(1,1), (1,3,1)=(1,2).
    _eq(out["x"], np.stack([
        [x[0, 0], x[1, 1], x[0, 2], x[0, 2]] + [z] * 8,
        [x[1, 0], x[1, 2], x[0, 0], x[1, 1], x[1, 2]] + [z] * 7,
    ]))  # fmt: skip
    _eq(out["topk_idx"], _i32([[0, 0, 1, 1] + [-1] * 8, [0, 0, 1, 1, 1] + [-1] * 7]))
    _eq(out["topk_weights"], _f32([
        [0.5, 2.5, 0.125, 0.375] + [0] * 8,
        [0.75, 3.0, 0.25, 1.5, 4.0] + [0] * 7,
    ]))  # fmt: skip
    _eq(out["group_sizes"], _i32([[2, 2], [2, 3]]))
    _eq(out["tokens_per_expert"], _i32([[2, 2], [2, 3]]))
    _eq(out["num_tokens"], _i32([4, 5]))
    _eq(out["num_dropped"], _i32([0, 0]))
    _eq(out["num_invalid"], _i32([1, 0]))


def test_dispatch_expert_major_capacity_overflow_keeps_sorted_prefix():
    x = _x()
    out = ref.dispatch(x, IDX, W, num_experts=E, capacity=3, expert_major=True)
    _eq(out["x"], np.stack([[x[0, 0], x[1, 1], x[0, 2]], [x[1, 0], x[1, 2], x[0, 0]]]))
    _eq(out["topk_idx"], _i32([[0, 0, 1], [0, 0, 1]]))
    _eq(out["topk_weights"], _f32([[0.5, 2.5, 0.125], [0.75, 3.0, 0.25]]))
    _eq(out["group_sizes"], _i32([[2, 1], [2, 1]]))
    _eq(out["num_tokens"], _i32([3, 3]))
    _eq(out["num_dropped"], _i32([1, 2]))


# ---------------------------------------------------------------------------------------------
# Combine
# ---------------------------------------------------------------------------------------------


def test_combine_rank_major_hand_case_weighted_and_unweighted():
    # y row = 100*d + i + 1 (all channels); rows past the count hold garbage that must be
    # ignored.
    y = np.full((2, 6, H), 777.0, np.float32)
    for d, n in enumerate([3, 4]):
        for i in range(n):
            y[d, i] = 100 * d + i + 1
    out = ref.combine(y, IDX, num_experts=E)
    # (0,0): rank0 row0 + rank1 row0 = 1 + 101; (0,1): nowhere; (0,2): rank0 row1 = 2;
    # (1,0): rank1 row1 = 102; (1,1): rank0 row2 + rank1 row2 = 3 + 103; (1,2): rank1 row3.
    want = np.repeat(_f32([[102, 0, 2], [102, 106, 104]])[..., None], H, axis=2)
    _eq(out, want)

    wts = _f32([[2, 0.5, -1, 5, 5, 5], [4, 8, 0.25, 3, 5, 5]])
    out = ref.combine(y, IDX, num_experts=E, weights=wts)
    want = _f32([[2 * 1 + 4 * 101, 0, 0.5 * 2], [8 * 102, -1 * 3 + 0.25 * 103, 3 * 104]])
    _eq(out, np.repeat(want[..., None], H, axis=2))


def test_combine_sums_in_rank_order_in_float32():
    # R=3, E=3, one token on rank 0 choosing one expert on every rank (in scrambled k order).
    idx = np.array([[[2, 0, 1]], [[-1, -1, -1]], [[-1, -1, -1]]], dtype=np.int32)
    # Row of the token on rank d is row 0. Channel c holds the three addends in rank order.
    cols = _f32([[1e8, 1, -1e8], [1e8, -1e8, 1], [1, 1e8, -1e8], [-1e8, 1e8, 1]])
    y = np.zeros((3, 3, 4), np.float32)
    for d in range(3):
        y[d, 0] = cols[:, d]
    out = ref.combine(y, idx, num_experts=3)
    # ((0 + a) + b) + c in float32: 1e8 + 1 == 1e8 in float32.
    _eq(out[0, 0], _f32([0, 1, 0, 1]))
    _eq(out[1:], np.zeros((2, 1, 4), np.float32))


def test_combine_bf16_accumulates_in_float32_and_rounds_once():
    idx = np.array([[[2, 0, 1]], [[-1, -1, -1]], [[-1, -1, -1]]], dtype=np.int32)
    y = np.zeros((3, 3, 1), BF16)
    y[0, 0], y[1, 0], y[2, 0] = 1.0, 2.0**-8, 2.0**-8
    out = ref.combine(y, idx, num_experts=3)
    # bfloat16 accumulation would give 1 + 2^-8 -> 1 (tie to even) twice; float32 gives
    # 1 + 2^-7, exact in bfloat16.
    _eq(out, np.array([[[1.0078125]], [[0]], [[0]]], dtype=BF16))


def test_combine_expert_major_hand_case():
    # Entries as in test_dispatch_expert_major_hand_case; y[entry] = entry value, weights.
    y = np.full((2, 12, 1), 999.0, np.float32)
    y[0, :4, 0] = [1, 2, 3, 4]  # (0,0) (1,1) (0,2) (0,2)
    y[1, :5, 0] = [5, 6, 7, 8, 9]  # (1,0) (1,2) (0,0) (1,1) (1,2)
    out = ref.combine(y, IDX, num_experts=E, expert_major=True)
    _eq(out[..., 0], _f32([[1 + 7, 0, 3 + 4], [5, 2 + 8, 6 + 9]]))

    wts = np.zeros((2, 12), np.float32)
    wts[0, :4] = [2, 4, 0.5, 0.25]
    wts[1, :5] = [-1, 3, 0.5, 2, 1]
    out = ref.combine(y, IDX, num_experts=E, expert_major=True, weights=wts)
    want = [[2 * 1 + 0.5 * 7, 0, 0.5 * 3 + 0.25 * 4], [-1 * 5, 4 * 2 + 2 * 8, 3 * 6 + 1 * 9]]
    _eq(out[..., 0], _f32(want))


def test_combine_expert_major_casts_each_rank_partial_to_y_dtype():
    # R=2, E=4, one token choosing experts 0, 1 (rank 0) and 2 (rank 1).
    idx = np.array([[[0, 1, 2]], [[-1, -1, -1]]], dtype=np.int32)
    y = np.zeros((2, 2, 1), BF16)  # capacity 2 entries per rank
    y[0, 0], y[0, 1] = 1.0, 2.0**-8  # rank 0 partial: 1 + 2^-8 -> bfloat16 1.0
    y[1, 0] = 2.0**-8  # rank 1 partial: 2^-8
    out = ref.combine(y, idx, num_experts=E, capacity=2, expert_major=True)
    # Then 0 + 1.0 + 2^-8 -> bfloat16 1.0 (a single float32 sum would give 1 + 2^-7).
    _eq(out, np.array([[[1.0]], [[0.0]]], dtype=BF16))


def test_combine_dropped_rows_contribute_nothing():
    y = np.ones((2, 2, H), np.float32)
    out = ref.combine(y, IDX, num_experts=E, capacity=2)
    # Kept: rank0 (0,0), (0,2); rank1 (0,0), (1,0). (1,1) and (1,2) dropped everywhere.
    _eq(out[..., 0], _f32([[2, 0, 1], [1, 0, 0]]))
    y = np.ones((2, 3, H), np.float32)
    out = ref.combine(y, IDX, num_experts=E, capacity=3, expert_major=True)
    # Kept entries: rank0 (0,0) (1,1) (0,2); rank1 (1,0) (1,2) (0,0).
    _eq(out[..., 0], _f32([[2, 0, 1], [1, 1, 1]]))


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


def test_dispatch_vjp_hand_case():
    dx_recv = np.zeros((2, 6, 1), np.float32)
    dx_recv[0, :3, 0] = [1, 2, 3]
    dx_recv[1, :4, 0] = [10, 20, 30, 40]
    dx_recv[:, 4:] = 555.0  # beyond the count: no token reads these rows
    dw_recv = np.arange(24, dtype=np.float32).reshape(2, 6, 2) + 1
    dx, dw = ref.dispatch_vjp(dx_recv, dw_recv, IDX, num_experts=E)
    _eq(dx[..., 0], _f32([[1 + 10, 0, 2], [20, 3 + 30, 40]]))
    # Rank 0 rows: (0,0) slot k0 -> dw_recv[0,0,0]=1; (0,2) k0,k1 -> 3, 4; (1,1) k1 -> 6.
    # Rank 1 rows: (0,0) k1 -> dw_recv[1,0,1]=14; (1,0) k0 -> 15; (1,1) k0 -> 17;
    # (1,2) k0,k1 -> 19, 20.
    _eq(dw, _f32([[[1, 14], [0, 0], [3, 4]], [[15, 0], [17, 6], [19, 20]]]))

    dw_recv = np.arange(24, dtype=np.float32).reshape(2, 12) + 1
    dx_recv = np.zeros((2, 12, 1), np.float32)
    dx_recv[0, :4, 0] = [1, 2, 3, 4]
    dx_recv[1, :5, 0] = [5, 6, 7, 8, 9]
    dx, dw = ref.dispatch_vjp(dx_recv, dw_recv, IDX, num_experts=E, expert_major=True)
    _eq(dx[..., 0], _f32([[1 + 7, 0, 3 + 4], [5, 2 + 8, 6 + 9]]))
    # Entries: rank 0 (0,0,k0) (1,1,k1) (0,2,k0) (0,2,k1); rank 1 (1,0,k0) (1,2,k0)
    # (0,0,k1) (1,1,k0) (1,2,k1); dw_recv rank 0 = 1.., rank 1 = 13..
    _eq(dw, _f32([[[1, 15], [0, 0], [3, 4]], [[13, 0], [16, 2], [14, 17]]]))


def test_combine_vjp_hand_case():
    dout = np.zeros((2, 3, 1), np.float32)
    dout[..., 0] = [[1, 2, 3], [4, 5, 6]]
    y = np.zeros((2, 6, 1), np.float32)
    y[0, :3, 0] = [10, 20, 30]
    y[1, :4, 0] = [40, 50, 60, 70]
    dy, dw = ref.combine_vjp(dout, y, IDX, num_experts=E)
    assert dw is None
    # Rank 0 rows: (0,0) (0,2) (1,1); rank 1 rows: (0,0) (1,0) (1,1) (1,2).
    _eq(dy[..., 0], _f32([[1, 3, 5, 0, 0, 0], [1, 4, 5, 6, 0, 0]]))
    wts = _f32([[2, 3, 4, 9, 9, 9], [5, 6, 7, 8, 9, 9]])
    dy, dw = ref.combine_vjp(dout, y, IDX, num_experts=E, weights=wts)
    _eq(dy[..., 0], _f32([[2, 9, 20, 0, 0, 0], [5, 24, 35, 48, 0, 0]]))
    _eq(dw, _f32([[10, 60, 150, 0, 0, 0], [40, 200, 300, 420, 0, 0]]))


def _random_case(rng, R, T, K, E_, H_):
    """Random routing with masks, invalid ids and duplicates; integer-valued data."""
    idx = rng.integers(-1, E_ + 2, size=(R, T, K)).astype(np.int32)  # E_, E_+1 invalid
    dup = rng.random((R, T)) < 0.3
    idx[..., -1] = np.where(dup, idx[..., 0], idx[..., -1])
    x = rng.integers(-8, 9, size=(R, T, H_)).astype(np.float32)
    w = rng.integers(-4, 5, size=(R, T, K)).astype(np.float32)
    return idx, x, w


def _dot(a, b):
    return float(np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64)))


@pytest.mark.parametrize("expert_major", [False, True])
@pytest.mark.parametrize("capacity", [None, 3])
def test_dispatch_adjoint_identity(expert_major, capacity):
    rng = np.random.default_rng()
    R, T, K, E_, H_ = 4, 5, 3, 8, 6
    for _ in range(5):
        idx, x, w = _random_case(rng, R, T, K, E_, H_)
        fwd = ref.dispatch(x, idx, w, num_experts=E_, capacity=capacity,
                           expert_major=expert_major)  # fmt: skip
        gx = rng.integers(-8, 9, size=fwd["x"].shape).astype(np.float32)
        gw = rng.integers(-8, 9, size=fwd["topk_weights"].shape).astype(np.float32)
        dx, dw = ref.dispatch_vjp(gx, gw, idx, num_experts=E_, capacity=capacity,
                                  expert_major=expert_major)  # fmt: skip
        assert dx.dtype == np.float32 and dx.shape == x.shape
        assert dw.dtype == np.float32 and dw.shape == w.shape
        assert _dot(fwd["x"], gx) == _dot(x, dx)
        # Masked and invalid weights are ignored by dispatch, so only valid slots count.
        valid = (idx >= 0) & (idx < E_)
        assert _dot(fwd["topk_weights"], gw) == _dot(np.where(valid, w, 0), dw)
        assert np.all(dw[~valid] == 0)


@pytest.mark.parametrize("expert_major", [False, True])
@pytest.mark.parametrize("capacity", [None, 3])
def test_combine_adjoint_identity(expert_major, capacity):
    rng = np.random.default_rng()
    R, T, K, E_, H_ = 4, 5, 3, 8, 6
    for _ in range(5):
        idx, _, _ = _random_case(rng, R, T, K, E_, H_)
        cap = capacity or (R * T * min(K, E_ // R) if expert_major else R * T)
        y = rng.integers(-8, 9, size=(R, cap, H_)).astype(np.float32)
        wts = rng.integers(-4, 5, size=(R, cap)).astype(np.float32)
        g = rng.integers(-8, 9, size=(R, T, H_)).astype(np.float32)
        kw = dict(num_experts=E_, capacity=capacity, expert_major=expert_major)
        out = ref.combine(y, idx, weights=wts, **kw)
        dy, dw = ref.combine_vjp(g, y, idx, weights=wts, **kw)
        assert dy.shape == y.shape and dw.shape == wts.shape
        assert _dot(out, g) == _dot(y, dy) == _dot(wts, dw)
        out = ref.combine(y, idx, **kw)
        dy, dw = ref.combine_vjp(g, y, idx, **kw)
        assert dw is None
        assert _dot(out, g) == _dot(y, dy)
        # Unweighted, the backward of combine is the dispatch of the cotangent.
        _eq(dy, ref.dispatch(g, idx, np.zeros((R, T, K), np.float32), **kw)["x"])


# ---------------------------------------------------------------------------------------------
# Low latency
# ---------------------------------------------------------------------------------------------


def _ll_x():
    """bfloat16 [2, 3, 128]: token (s, t) holds 10*s + t + 1 in every channel."""
    c = _f32([[1, 2, 3], [11, 12, 13]])
    return np.repeat(c[..., None], 128, axis=2).astype(BF16)


def test_low_latency_dispatch_hand_case():
    x = _ll_x()
    out = ref.low_latency_dispatch(x, IDX, num_experts=E)
    # One message per (token, expert): expert 0 <- (0,0) (1,1); expert 1 <- (0,2) once;
    # expert 2 <- (1,0) (1,2); expert 3 <- (0,0) (1,1) (1,2).
    _eq(out["count"], _i32([[2, 1], [2, 3]]))
    _eq(out["num_invalid"], _i32([1, 0]))
    assert out["x"].shape == (2, 2, 6, 128) and out["x"].dtype == BF16
    want = _f32([
        [[1, 12, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0]],
        [[11, 13, 0, 0, 0, 0], [1, 12, 13, 0, 0, 0]],
    ])  # fmt: skip
    _eq(out["x"], np.repeat(want[..., None], 128, axis=3).astype(BF16))
    assert "scales" not in out


def test_low_latency_dispatch_fp8_quantizes_each_row():
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 3, 256)).astype(BF16)
    out = ref.low_latency_dispatch(x, IDX, num_experts=E, use_fp8=True)
    assert out["x"].dtype == FP8 and out["scales"].shape == (2, 2, 6, 2)
    q, s = ref.quantize(x)
    for (d, j, slot), (src_s, t) in {
        (0, 0, 0): (0, 0), (0, 0, 1): (1, 1), (0, 1, 0): (0, 2), (1, 0, 0): (1, 0),
        (1, 0, 1): (1, 2), (1, 1, 0): (0, 0), (1, 1, 1): (1, 1), (1, 1, 2): (1, 2),
    }.items():  # fmt: skip
        _eq(out["x"][d, j, slot], q[src_s, t])
        _eq(out["scales"][d, j, slot], s[src_s, t])
    _eq(out["x"][0, 0, 2:], np.zeros((4, 256), FP8))
    _eq(out["scales"][1, 1, 3:], np.zeros((3, 2), np.float32))


def test_low_latency_combine_hand_case():
    # y = the dispatched rows times (expert + 1).
    disp = ref.low_latency_dispatch(_ll_x(), IDX, num_experts=E)["x"].astype(np.float32)
    y = (disp * _f32([1, 2, 3, 4]).reshape(2, 2, 1, 1)).astype(BF16)
    out = ref.low_latency_combine(y, IDX, W, num_experts=E)
    # (0,0): 0.5*1*1 + 0.25*4*1; (0,1): nowhere (weights 9, 9.5 ignored);
    # (0,2): duplicate expert 1, same slot: 0.125*2*3 + 0.375*2*3; (1,0): 0.75*3*11;
    # (1,1): 1.5*4*12 + 2.5*1*12; (1,2): 3*3*13 + 4*4*13 = 325 -> bfloat16 324 (tie to even).
    want = _f32([[1.5, 0, 3.0], [24.75, 102, 324]])
    _eq(out, np.repeat(want[..., None], 128, axis=2).astype(BF16))


def test_low_latency_combine_sums_choices_in_k_order():
    idx = np.zeros((1, 2, 3), np.int32)  # R=1, E=1: both tokens pick expert 0 three times
    w = _f32([[[1e8, 1, -1e8], [1e8, -1e8, 1]]])
    y = np.ones((1, 1, 2, 128), BF16)
    out = ref.low_latency_combine(y, idx, w, num_experts=1)
    _eq(out[0, :, 0], np.array([0, 1], BF16))


# ---------------------------------------------------------------------------------------------
# FP8
# ---------------------------------------------------------------------------------------------


def test_quantize_exact_when_amax_is_448_times_power_of_two():
    # float32(448) * float32(1/448) == 1 exactly, so a block whose amax is 448 * 2^m has scale
    # 2^m and every value 2^m * (an e4m3 number) is kept exactly.
    base = np.zeros(128, np.float32)
    base[:9] = [448, -448, 1, 0.5, -3.5, 240, 2.0**-9, -(2.0**-6), 0]
    x = np.concatenate([base * 2.0**m for m in (-3, 0, 5)]).astype(np.float32)
    q, s = ref.quantize(x)
    assert q.dtype == FP8 and s.dtype == np.float32
    _eq(s, _f32([2.0**-3, 1.0, 2.0**5]))
    _eq(q, np.tile(base, 3).astype(FP8))
    _eq(ref.dequantize(q, s), x)


def test_quantize_hand_values():
    x = np.zeros((2, 128), np.float32)
    x[0, :5] = [1.0, 0.5, 0.3, -0.3, 0.001]  # amax 1
    # row 1 is all zero: amax floored to 1e-4
    q, s = ref.quantize(x)
    c = f32(1) / f32(448)
    _eq(s, np.array([[c], [f32(1e-4) * c]], np.float32))
    # 1/scale = 447.99997 in float32: 1 -> 448, 0.5 -> 224, 0.3 -> 134.4 -> 128,
    # 0.001 -> 0.448 -> 0.4375 (step 2^-5 in [0.25, 0.5)).
    want = np.zeros((2, 128), np.float32)
    want[0, :5] = [448, 224, 128, -128, 0.4375]
    _eq(q, want.astype(FP8))


def test_quantize_multiplies_by_the_rounded_reciprocal():
    # Here x * float32(1/scale) == -200 exactly, a tie between e4m3 values -192 and -208 that
    # rounds to even (-192), while x / scale == -200.00002 would round to -208.
    amax = f32(float.fromhex("0x1.6e45d2p+0"))
    v = f32(float.fromhex("-0x1.47077ep-1"))
    x = np.zeros(128, np.float32)
    x[0], x[1] = amax, v
    q, s = ref.quantize(x)
    _eq(s, np.array([amax * (f32(1) / f32(448))], np.float32))
    assert q[1].astype(np.float32) == -192.0


def test_quantize_round_trip_error_bound():
    rng = np.random.default_rng()
    H_ = 1024
    # Blocks of very different magnitudes, with tiny values that land in e4m3 subnormals.
    mag = 10.0 ** rng.uniform(-6, 4, size=(16, H_ // 128, 1))
    x = rng.standard_normal((16, H_ // 128, 128)) * mag
    x *= np.where(rng.random(x.shape) < 0.2, 1e-3, 1.0)
    x = x.reshape(16, H_).astype(np.float32)
    for dtype in (np.float32, BF16):
        xd = x.astype(dtype)
        q, s = ref.quantize(xd)
        xf = xd.astype(np.float32)
        deq = ref.dequantize(q, s)
        assert deq.dtype == np.float32
        scale = np.repeat(s, 128, axis=-1)
        # With v = x / scale: e4m3 rounds |v| >= 2^-6 (normal) to within half an ulp, at most
        # 2^-4 |v|, and subnormals to within half their step 2^-9; the float32 products add
        # a few units of 2^-24 relative.
        bound = np.maximum(np.abs(xf) * 2.0**-4, scale * 2.0**-10) + np.abs(xf) * 2.0**-20
        err = np.abs(xf.astype(np.float64) - deq.astype(np.float64))
        assert np.all(err <= bound)
        assert np.max(err / bound) > 0.5  # the bound is not vacuous
        # Every block's largest magnitude maps to +-448 (amax above the floor).
        amax = np.abs(xf).reshape(16, -1, 128).max(-1)
        big = amax > 1e-4
        qmax = np.abs(q.astype(np.float32)).reshape(16, -1, 128).max(-1)
        np.testing.assert_array_equal(qmax[big], 448.0)


def test_dequantize_out_dtype():
    q = np.array([[1.5, -2.0] + [0.0] * 126], np.float32).astype(FP8)
    s = _f32([[0.5]])
    out = ref.dequantize(q, s, out_dtype=BF16)
    assert out.dtype == BF16
    _eq(out[0, :2], np.array([0.75, -1.0], BF16))


# ---------------------------------------------------------------------------------------------
# Input checks and sizes
# ---------------------------------------------------------------------------------------------


def test_bad_inputs_raise_value_error():
    x = _x()
    with pytest.raises(ValueError, match="num_experts"):
        ref.dispatch_layout(IDX, num_experts=3)
    with pytest.raises(ValueError, match="topk_idx"):
        ref.dispatch_layout(IDX[0], num_experts=E)
    with pytest.raises(ValueError, match="topk_weights"):
        ref.dispatch(x, IDX, W[:, :2], num_experts=E)
    with pytest.raises(ValueError, match="x"):
        ref.dispatch(x[:, :2], IDX, W, num_experts=E)
    with pytest.raises(ValueError, match="y"):
        ref.combine(np.zeros((2, 5, H), np.float32), IDX, num_experts=E)
    with pytest.raises(ValueError, match="weights"):
        ref.combine(np.zeros((2, 6, H), np.float32), IDX, num_experts=E,
                    weights=np.zeros((2, 5), np.float32))  # fmt: skip
    with pytest.raises(ValueError, match="scales"):
        q = np.zeros((2, 3, 128), FP8)
        ref.dispatch((q, np.zeros((2, 3, 2), np.float32)), IDX, W, num_experts=E)
    with pytest.raises(ValueError, match="128"):
        ref.quantize(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match="128"):
        ref.low_latency_dispatch(np.zeros((2, 3, 64), BF16), IDX, num_experts=E)


def test_benchmark_sized_inputs_run():
    rng = np.random.default_rng()
    R, T, K, H_, E_ = 8, 64, 8, 256, 64
    idx = rng.integers(-1, E_, size=(R, T, K)).astype(np.int32)
    x = rng.standard_normal((R, T, H_)).astype(BF16)
    w = rng.random((R, T, K), dtype=np.float32)
    for expert_major in (False, True):
        out = ref.dispatch(x, idx, w, num_experts=E_, expert_major=expert_major)
        assert np.all(out["num_dropped"] == 0)
        y = ref.combine(out["x"], idx, num_experts=E_, expert_major=expert_major)
        assert y.shape == (R, T, H_) and y.dtype == BF16
    ll = ref.low_latency_dispatch(x, idx, num_experts=E_, use_fp8=True)
    out = ref.low_latency_combine(
        ref.dequantize(ll["x"], ll["scales"], BF16), idx, w, num_experts=E_
    )
    assert out.shape == (R, T, H_) and out.dtype == BF16
