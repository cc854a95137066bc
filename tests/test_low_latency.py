"""Low-latency dispatch/combine (whole and split forms) against the NumPy reference.

Covers every routing kind incl. duplicate choices (one message per token and expert), R in
{1, 2, 4, 8}, BF16 and FP8 (in-op cast), and the split send/recv forms giving the same bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from harness import checked, sharded, to_numpy
from test_dispatch import _assert_bitwise
from test_virtual import nan_padding

import jax_ep
from jax_ep.tools import reference
from jax_ep.tools.bench.routings import KINDS, make_routing


def _case(rng, num_ranks, kind, num_tokens=11, top_k=4, experts_per_rank=3, hidden=256):
    num_experts = num_ranks * experts_per_rank
    idx, w = make_routing(rng, num_ranks=num_ranks, num_tokens=num_tokens,
                          top_k=min(top_k, num_experts), num_experts=num_experts, kind=kind)
    x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(ml_dtypes.bfloat16)
    y_shape = (num_ranks, experts_per_rank, num_ranks * num_tokens, hidden)
    y = rng.standard_normal(y_shape).astype(ml_dtypes.bfloat16)
    return num_experts, idx, w, x, y


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_matches_reference(kind, num_ranks, use_fp8):
    rng = np.random.default_rng()
    num_experts, idx, w, x, y = _case(rng, num_ranks, kind)
    want = reference.low_latency_dispatch(x, idx, num_experts=num_experts, use_fp8=use_fp8)
    y = nan_padding(y.astype(np.float32), want["count"]).astype(y.dtype)

    def per_shard(x, idx, w, y):
        recv, handle = jax_ep.low_latency_dispatch(x, idx, num_experts=num_experts,
                                                   use_fp8=use_fp8)
        return recv.with_zero_padding(), jax_ep.low_latency_combine(y, idx, w, handle)

    recv, out = to_numpy(sharded(per_shard, num_ranks)(x, idx, w, y))
    _assert_bitwise(recv.x, want["x"], "low-latency x")
    _assert_bitwise(recv.count, want["count"], "low-latency count")
    _assert_bitwise(recv.num_invalid, want["num_invalid"], "low-latency num_invalid")
    if use_fp8:
        _assert_bitwise(recv.scales, want["scales"], "low-latency scales")
    else:
        assert recv.scales is None
    want_out = reference.low_latency_combine(y, idx, w, num_experts=num_experts)
    _assert_bitwise(out, want_out, "low-latency combine")


def test_split_forms_equal_whole_ops():
    rng = np.random.default_rng()
    num_experts, idx, w, x, y = _case(rng, 4, "duplicates")

    def whole(x, idx, w, y):
        recv, handle = jax_ep.low_latency_dispatch(x, idx, num_experts=num_experts)
        return recv.with_zero_padding().x, jax_ep.low_latency_combine(y, idx, w, handle)

    def split(x, idx, w, y):
        pending = jax_ep.low_latency_dispatch_send(x, idx, num_experts=num_experts)
        other_work = (x.astype(np.float32) ** 2).sum()  # stands for compute between halves
        recv, handle = jax_ep.low_latency_dispatch_recv(pending)
        combining = jax_ep.low_latency_combine_send(y, idx, w, handle)
        out = jax_ep.low_latency_combine_recv(combining) + 0 * other_work.astype(y.dtype)
        return recv.with_zero_padding().x, out

    a = to_numpy(sharded(whole, 4)(x, idx, w, y))
    b = to_numpy(sharded(split, 4)(x, idx, w, y))
    for got, want in zip(b, a, strict=True):
        _assert_bitwise(got, want, "split vs whole")


def test_round_trip_with_identity_experts():
    """Identity experts: the combine returns sum_k w_k * x (bf16 rounding only)."""
    rng = np.random.default_rng()
    num_experts, idx, w, x, _ = _case(rng, 8, "masked", hidden=128)

    def per_shard(x, idx, w):
        recv, handle = jax_ep.low_latency_dispatch(x, idx, num_experts=num_experts)
        return jax_ep.low_latency_combine(recv.x, idx, w, handle)

    out = to_numpy(sharded(per_shard, 8)(x, idx, w)).astype(np.float64)
    weight = np.where(idx >= 0, w, 0).sum(-1, keepdims=True).astype(np.float64)
    np.testing.assert_allclose(out, weight * x.astype(np.float64), rtol=1e-2, atol=1e-2)


def test_invalid_ids_are_counted_and_checked_by_default():
    rng = np.random.default_rng()
    num_experts, idx, w, x, _ = _case(rng, 2, "uniform")
    idx[1, 0, 0] = 99

    def per_shard(x, idx):
        return jax_ep.low_latency_dispatch(x, idx, num_experts=num_experts)[0].num_invalid

    np.testing.assert_array_equal(to_numpy(sharded(per_shard, 2)(x, idx)), [0, 1])
    with pytest.raises(ValueError, match=r"at mapped index 1: .*topk_idx holds 1 expert id\(s\)"):
        checked(per_shard, 2)(x, idx)
