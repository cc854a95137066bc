"""Backward passes: dispatch's VJP is combine, combine's VJP is dispatch (docs/contract.md).

Checked three ways: against the reference VJPs on random cotangents, against finite
differences (jax.test_util.check_grads) of a loss through dispatch -> experts -> combine,
and under jax.jit(jax.grad(...)) inside shard_map on every R.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import mesh, sharded, to_numpy
from jax.test_util import check_grads

import jax_ep
from jax_ep.tools import reference
from jax_ep.tools.bench.routings import make_routing


def _routing(rng, num_ranks, kind="masked", num_tokens=7, top_k=3, experts_per_rank=2):
    num_experts = num_ranks * experts_per_rank
    idx, w = make_routing(rng, num_ranks=num_ranks, num_tokens=num_tokens,
                          top_k=min(top_k, num_experts), num_experts=num_experts, kind=kind)
    return num_experts, idx, w


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("expert_major", [False, True], ids=["rank_major", "expert_major"])
@pytest.mark.parametrize("capacity", [None, 5])
def test_vjps_match_reference(num_ranks, expert_major, capacity):
    rng = np.random.default_rng()
    num_experts, idx, w = _routing(rng, num_ranks, kind="duplicates")
    hidden = 12
    x = rng.standard_normal((num_ranks, 7, hidden)).astype(np.float32)
    kw = dict(num_experts=num_experts, capacity=capacity, expert_major=expert_major)
    want = reference.dispatch(x, idx, w, **kw)
    cap = want["x"].shape[1]
    g_x = rng.standard_normal(want["x"].shape).astype(np.float32)
    g_w = rng.standard_normal(want["topk_weights"].shape).astype(np.float32)
    y = rng.standard_normal((num_ranks, cap, hidden)).astype(np.float32)
    yw = rng.random((num_ranks, cap)).astype(np.float32)
    g_out = rng.standard_normal((num_ranks, 7, hidden)).astype(np.float32)

    def per_shard(x, idx, w, g_x, g_w, y, yw, g_out):
        def forward(x, w):
            recv, handle = jax_ep.dispatch(
                x, idx, w, capacity=capacity, expert_major=expert_major, on_overflow="drop",
                num_experts=num_experts,
            )
            return (recv.x, recv.topk_weights), handle

        (_, pull_dispatch, handle) = jax.vjp(forward, x, w, has_aux=True)
        d_x, d_w = pull_dispatch((g_x, g_w))
        _, pull_combine = jax.vjp(lambda y, yw: jax_ep.combine(y, handle, topk_weights=yw), y, yw)
        d_y, d_yw = pull_combine(g_out)
        return d_x, d_w, d_y, d_yw

    d_x, d_w, d_y, d_yw = to_numpy(
        sharded(per_shard, num_ranks)(x, idx, w, g_x, g_w, y, yw, g_out)
    )
    want_dx, want_dw = reference.dispatch_vjp(g_x, g_w, idx, **kw)
    np.testing.assert_allclose(d_x, want_dx, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(d_w, want_dw)
    want_dy, want_dyw = reference.combine_vjp(g_out, y, idx, weights=yw, **kw)
    np.testing.assert_allclose(d_y, want_dy, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(d_yw, want_dyw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("expert_major", [False, True], ids=["rank_major", "expert_major"])
def test_finite_differences(expert_major):
    """A scalar loss through dispatch, a nonlinear per-row expert and combine."""
    rng = np.random.default_rng()
    num_ranks = 4
    num_experts, idx, w = _routing(rng, num_ranks, kind="uniform", num_tokens=5)
    x = rng.standard_normal((num_ranks, 5, 8)).astype(np.float32)

    def loss_per_shard(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=num_experts,
                                       expert_major=expert_major)
        h = jnp.tanh(recv.x) * (1.0 + recv.topk_weights.sum(-1, keepdims=True)
                                if not expert_major else 1.0)
        weights = recv.topk_weights if expert_major else None
        out = jax_ep.combine(h, handle, topk_weights=weights)
        return jax.lax.psum(jnp.sum(out * out), "ep")

    m = mesh(num_ranks, explicit=False)
    per_rank = jax.shard_map(
        lambda x, idx, w: loss_per_shard(x[0], idx[0], w[0])[None],
        mesh=m, in_specs=jax.P("ep"), out_specs=jax.P("ep"),
    )

    @jax.jit  # check_grads evaluates the loss many times: compile it once
    def loss(x, w):
        return per_rank(x, idx, w)[0]

    with jax.set_mesh(m):
        check_grads(loss, (x, w), order=1, modes=("rev",), atol=5e-2, rtol=5e-2, eps=1e-3)


def test_grad_under_jit_of_every_rank_count():
    """jax.jit(jax.grad) of a shard_map'ed MoE-like loss runs and matches R = 1."""
    rng = np.random.default_rng()
    num_tokens, hidden, num_experts = 8, 16, 8
    x = rng.standard_normal((8 * num_tokens, hidden)).astype(np.float32)
    idx, w = make_routing(rng, num_ranks=1, num_tokens=8 * num_tokens, top_k=2,
                          num_experts=num_experts)
    scale = rng.standard_normal((num_experts,)).astype(np.float32)
    results = []
    for num_ranks in (1, 2, 4, 8):
        per = 8 * num_tokens // num_ranks
        xs = x.reshape(num_ranks, per, hidden)
        idxs = idx.reshape(num_ranks, per, 2)
        ws = w.reshape(num_ranks, per, 2)
        scales = scale.reshape(num_ranks, num_experts // num_ranks)

        def per_shard(x, idx, w, s):
            def loss(x, w):
                recv, handle = jax_ep.dispatch(x, idx, w, num_experts=num_experts,
                                               expert_major=True)
                y = recv.x * s[jnp.maximum(recv.topk_idx, 0)][:, None]
                out = jax_ep.combine(y, handle, topk_weights=recv.topk_weights)
                return jax.lax.psum(jnp.sum(jnp.sin(out)), "ep")

            return jax.grad(loss, argnums=(0, 1))(x, w)

        gx, gw = to_numpy(sharded(per_shard, num_ranks)(xs, idxs, ws, scales))
        results.append((gx.reshape(-1, hidden), gw.reshape(-1, 2)))
    for gx, gw in results[1:]:
        np.testing.assert_allclose(gx, results[0][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gw, results[0][1], rtol=1e-5, atol=1e-6)
