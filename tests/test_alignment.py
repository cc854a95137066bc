"""Expert alignment (docs/contract.md, "Expert alignment") against a NumPy model written from
the contract: every local expert's entries start at a multiple of A rows, padding rows are
zero with topk_idx -1 and weight 0, capacity cuts in the unaligned order; combine and the
gradients as without alignment; on every path the run takes ($JAX_EP_BACKEND, transports,
host peers, the CPU grid) and on virtual ranks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import checked, sharded, to_numpy
from test_fuzz import assert_same, draw_routing, model_combine, model_normal

import jax_ep
from jax_ep import _ffi, quant, virtual

F32 = np.float32


def model_aligned(x, idx, w, E: int, capacity: int, A: int):
    """Per receiver: the aligned layout built from the contract's full entry list."""
    R, T, K = idx.shape
    El = E // R
    full = model_normal(x, idx, w, E, R * T * K, expert_major=True)
    out = []
    for d in range(R):
        n = full[d]["num_tokens"]
        ids = full[d]["topk_idx"][:n]
        rx = np.zeros((capacity, x.shape[-1]), x.dtype)
        ridx = np.full((capacity,), -1, np.int32)
        rw = np.zeros((capacity,), F32)
        source = [None] * capacity
        kept = np.zeros(El, np.int32)
        start = 0
        for j in range(El):
            mine = np.flatnonzero(ids == j)
            for i, e in enumerate(mine):
                if start + i < capacity:
                    row = start + i
                    rx[row], ridx[row], rw[row] = full[d]["x"][e], j, full[d]["topk_weights"][e]
                    source[row] = full[d]["source"][e]
                    kept[j] += 1
            start += -(-len(mine) // A) * A
        sizes = -(-kept // A) * A
        out.append(dict(x=rx, topk_idx=ridx, topk_weights=rw, tokens_per_expert=kept,
                        group_sizes=sizes, num_tokens=int(sizes.sum()),
                        num_dropped=n - int(kept.sum()), source=source))
    return out


def model_aligned_combine(want, ys, weights, R, T):
    """combine of the aligned rows: the contract's expert-major sum over the kept entries."""
    received = [dict(source=[s for s in want[d]["source"] if s is not None]) for d in range(R)]
    kept = [[i for i, s in enumerate(want[d]["source"]) if s is not None] for d in range(R)]
    return model_combine(received, [ys[d][kept[d]] for d in range(R)],
                         [weights[d][kept[d]] for d in range(R)], R, T, expert_major=True)


def run_aligned(R, x, idx, w, E, A, capacity):
    """dispatch with alignment, experts y = x * 0.5, combine weighted by the entries'."""
    def per_shard(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=True,
                                       expert_alignment=A, capacity=capacity,
                                       on_overflow="drop", on_invalid="mask")
        y = (recv.x.astype(jnp.float32) * 0.5).astype(x.dtype)
        return recv, jax_ep.combine(y, handle, topk_weights=recv.topk_weights)

    return to_numpy(sharded(per_shard, R)(x, idx, w))


@pytest.mark.parametrize("A", [2, 3, 8])
def test_dispatch_and_combine_against_the_model(A):
    rng = np.random.default_rng()
    for _ in range(3):
        R = int(rng.choice([1, 2, 3]))
        E, T, K = R * int(rng.integers(1, 5)), int(rng.integers(1, 19)), int(rng.integers(1, 4))
        K = min(K, E)
        H = int(rng.choice([8, 24]))
        idx, w = draw_routing(rng, R, T, K, E)
        x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
        default = jax_ep.alignment.with_padding(R * T * min(K, E // R), E // R, A)
        capacity = int(rng.choice([default, A * int(rng.integers(1, default // A + 1))]))
        want = model_aligned(x, idx, w, E, capacity, A)
        recv, out = run_aligned(R, x, idx, w, E, A, capacity)
        what = f"R {R} T {T} K {K} E {E} A {A} capacity {capacity}"
        for d in range(R):
            for key in ("x", "topk_idx", "topk_weights", "tokens_per_expert", "group_sizes"):
                assert_same(getattr(recv, key)[d], want[d][key], f"{what}: rank {d} {key}")
            for key in ("num_tokens", "num_dropped"):
                assert int(getattr(recv, key)[d]) == want[d][key], (what, d, key)
            assert np.all(want[d]["group_sizes"] % A == 0)
        ys = [(want[d]["x"].astype(F32) * F32(0.5)).astype(ml_dtypes.bfloat16)
              for d in range(R)]
        weights = [want[d]["topk_weights"] for d in range(R)]
        assert_same(out, model_aligned_combine(want, ys, weights, R, T), f"{what}: combine")


def test_feeds_ragged_dot_and_grads_match_unaligned():
    """The aligned groups feed ragged_dot; with nothing cut, the output and every gradient
    equal those without alignment, bit for bit."""
    rng = np.random.default_rng()
    R, T, K, E, H, A = 2, 11, 3, 6, 16, 4
    idx, w = draw_routing(rng, R, T, K, E)
    x = rng.standard_normal((R, T, H)).astype(F32)
    experts = rng.standard_normal((E // R, H, H)).astype(F32) / 4

    def run(A):
        def per_shard(x, w, idx):
            def loss(x, w):
                recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=True,
                                               expert_alignment=A, on_invalid="mask")
                y = jax.lax.ragged_dot(recv.x, experts, recv.group_sizes)
                out = jax_ep.combine(y, handle, topk_weights=recv.topk_weights)
                return jnp.sum(out * out), out

            (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
            return out, grads

        return to_numpy(sharded(per_shard, R)(x, w, idx))

    for a, b in zip(jax.tree.leaves(run(None)), jax.tree.leaves(run(A)), strict=True):
        assert_same(b, a, "aligned vs unaligned")


def test_quantized_rows_move_bit_for_bit():
    rng = np.random.default_rng()
    R, T, K, E, H, A = 2, 7, 2, 4, 128, 8
    idx, w = draw_routing(rng, R, T, K, E)
    x = rng.standard_normal((R, T, H)).astype(F32)

    def per_shard(x, idx, w):
        q = quant.quantize(x, "mxfp8")
        recv, _ = jax_ep.dispatch(q, idx, w, num_experts=E, expert_major=True,
                                  expert_alignment=A, on_invalid="mask")
        plain, _ = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=True,
                                   expert_alignment=A, on_invalid="mask")
        return quant.dequantize(recv.x), quant.dequantize(quant.quantize(plain.x, "mxfp8"))

    got, want = to_numpy(sharded(per_shard, R)(x, idx, w))
    assert_same(got, want, "mxfp8 rows")


def test_errors_name_the_fix():
    idx = np.zeros((1, 4, 2), np.int32)
    w = np.ones((1, 4, 2), F32)
    x = np.ones((1, 4, 8), F32)

    def call(**kw):
        def per_shard(x, idx, w):
            return jax_ep.dispatch(x, idx, w, num_experts=2, **kw)[0].x
        return sharded(per_shard, 1)(x, idx, w)

    with pytest.raises(ValueError, match="pass expert_major=True"):
        call(expert_alignment=4)
    with pytest.raises(ValueError, match=r"multiple of expert_alignment=4.*capacity=8"):
        call(expert_major=True, expert_alignment=4, capacity=6)
    with pytest.raises(ValueError, match="expert_alignment must be a positive"):
        call(expert_major=True, expert_alignment=0)

    def overflow(x, idx, w):  # 8 entries, each expert padded to 8: 16 rows needed
        return jax_ep.dispatch(x, idx, w, num_experts=2, expert_major=True, expert_alignment=8,
                               capacity=8)[0].num_dropped
    with pytest.raises(ValueError, match="needs at least 16 rows"):
        checked(overflow, 1)(x, np.tile(np.array([0, 1], np.int32), (1, 4, 1)), w)


def test_no_tokens():
    def per_shard(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=4, expert_major=True,
                                       expert_alignment=4)
        return recv.with_zero_padding(), jax_ep.combine(recv.x, handle)

    recv, out = to_numpy(sharded(per_shard, 2)(np.zeros((2, 0, 8), F32),
                                               np.zeros((2, 0, 2), np.int32),
                                               np.zeros((2, 0, 2), F32)))
    assert recv.x.shape == (2, 8, 8) and out.shape == (2, 0, 8)  # 2 experts' padding: 8 rows
    assert not recv.group_sizes.any() and not recv.num_tokens.any()
    assert (recv.topk_idx == -1).all()


@pytest.mark.parametrize("backend", ["xla", "cuda"])
def test_virtual_ranks(backend):
    if backend == "cuda" and _ffi.EXT is None:
        pytest.skip("the extension is not built")
    rng = np.random.default_rng()
    R, T, K, E, H, A = 3, 9, 2, 6, 24, 4
    idx, w = draw_routing(rng, R, T, K, E)
    x = rng.standard_normal((R, T, H)).astype(F32)
    recv, handle = virtual.dispatch(x, idx, w, num_experts=E, expert_major=True,
                                    expert_alignment=A, backend=backend)
    capacity = recv.x.shape[1]
    want = model_aligned(x, idx, w, E, capacity, A)
    for d in range(R):
        for key in ("x", "topk_idx", "topk_weights", "group_sizes"):
            assert_same(np.asarray(getattr(recv, key)[d]), want[d][key], f"rank {d} {key}")
    out = virtual.combine(recv.x, handle, topk_weights=recv.topk_weights, backend=backend)
    ys = [want[d]["x"] for d in range(R)]
    weights = [want[d]["topk_weights"] for d in range(R)]
    assert_same(np.asarray(out), model_aligned_combine(want, ys, weights, R, T), "combine")
