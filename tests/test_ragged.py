"""The portable backend's ragged transport (jax_ep/backends/ragged.py).

- its CPU model of `ragged_all_to_all` against a NumPy reading of the documented semantics;
- the transport's choice ($JAX_EP_XLA_TRANSPORT, else by platform);
- both transports give the same bits (the whole contract suite also runs through the ragged
  one in CI: `JAX_EP_XLA_TRANSPORT=ragged pytest tests/test_dispatch.py ...`);
- the ragged transport moves exactly the routed rows (its counts against the routing's);
- the GPU and TPU lowerings hold `ragged_all_to_all` with the expected shapes, and no
  all_gather of the tokens.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import mesh, sharded, to_numpy
from test_dispatch import _assert_bitwise

import jax_ep
from jax_ep.backends import ragged, xla
from jax_ep.tools.bench import suite, wire
from jax_ep.tools.bench.routings import make_routing


def _placements(rng, sizes, length):
    """Offsets of chunks of `sizes` in a buffer of `length`: random order, random gaps."""
    order = rng.permutation(len(sizes))
    gaps = rng.multinomial(length - sum(sizes), np.ones(len(sizes) + 1) / (len(sizes) + 1))
    offsets, at = np.zeros(len(sizes), np.int32), 0
    for gap, i in zip(gaps, order, strict=False):  # one gap more than chunks
        at += gap
        offsets[i] = at
        at += sizes[i]
    return offsets


@pytest.mark.parametrize("num_ranks", [1, 3, 4])
def test_model_follows_the_documented_semantics(num_ranks):
    rng = np.random.default_rng()
    length, out_len, width = 13, 17, 3
    sizes = rng.integers(0, 4, (num_ranks, num_ranks))  # sizes[s, d]: rows s sends d
    operand = rng.standard_normal((num_ranks, length, width)).astype(np.float32)
    output = rng.standard_normal((num_ranks, out_len, width)).astype(np.float32)
    in_off = np.stack([_placements(rng, sizes[s], length) for s in range(num_ranks)])
    at_dest = np.stack([_placements(rng, sizes[:, d], out_len) for d in range(num_ranks)])
    out_off = at_dest.T  # out_off[s, d]: where s's rows land on d

    want = output.copy()
    for s in range(num_ranks):
        for d in range(num_ranks):
            n = sizes[s, d]
            want[d, out_off[s, d]:out_off[s, d] + n] = operand[s, in_off[s, d]:in_off[s, d] + n]

    def per_shard(operand, output, in_off, send, out_off, recv):
        return ragged.ragged_all_to_all(operand, output, in_off, send, out_off, recv,
                                        axis_name="ep")

    got = sharded(per_shard, num_ranks)(operand, output, in_off.astype(np.int32),
                                        sizes.astype(np.int32), out_off.astype(np.int32),
                                        sizes.T.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_transport_choice(monkeypatch):
    monkeypatch.delenv(xla.TRANSPORT_ENV_VAR, raising=False)
    assert xla.transport() == ("all_gather" if jax.default_backend() == "cpu" else "ragged")
    assert xla.transport(num_ranks=1) == "all_gather"  # one rank: nothing crosses
    for name in xla.TRANSPORTS:
        monkeypatch.setenv(xla.TRANSPORT_ENV_VAR, name)
        assert xla.transport() == xla.transport(num_ranks=1) == name
    monkeypatch.setenv(xla.TRANSPORT_ENV_VAR, "nccl")
    with pytest.raises(ValueError, match=r"JAX_EP_XLA_TRANSPORT='nccl' is not one of"):
        xla.transport()


def _program(num_experts, capacity, expert_major, use_fp8=False):
    """dispatch + both combines + their gradients, and the low-latency round trip."""

    def per_shard(x, idx, w, ll_x):
        data = jax_ep.fp8.quantize(x) if use_fp8 else x

        def loss(x, w):
            recv, handle = jax_ep.dispatch(
                data if use_fp8 else x, idx, w, num_experts=num_experts, capacity=capacity,
                expert_major=expert_major, on_overflow="drop", backend="xla")
            y = recv.x.astype(jnp.float32) * 1.5
            weights = recv.topk_weights if expert_major else None
            out = jax_ep.combine(y, handle, topk_weights=weights, backend="xla")
            return jnp.sum(out * out), (recv.with_zero_padding(), out)

        (_, (recv, out)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
        ll_recv, ll_handle = jax_ep.low_latency_dispatch(
            ll_x, idx, num_experts=num_experts, use_fp8=use_fp8, backend="xla")
        ll_y = ll_recv.with_zero_padding().x
        if use_fp8:
            ll_y = jax_ep.fp8.dequantize(ll_y, ll_recv.with_zero_padding().scales,
                                         out_dtype=jnp.bfloat16)
        ll_out = jax_ep.low_latency_combine(ll_y, idx, w, ll_handle, backend="xla")
        return recv, out, grads, ll_recv.with_zero_padding(), ll_out

    return per_shard


@pytest.mark.parametrize("num_ranks,num_tokens,top_k,num_experts,kind,capacity,expert_major", [
    (4, 37, 3, 12, "hot_expert", None, False),
    (4, 37, 3, 12, "duplicates", 30, False),
    (3, 21, 4, 9, "masked", None, True),
    (4, 37, 3, 12, "duplicates", 40, True),
    (8, 19, 5, 16, "empty_ranks", 23, True),
])
def test_transports_agree_bitwise(monkeypatch, num_ranks, num_tokens, top_k, num_experts,
                                  kind, capacity, expert_major):
    rng = np.random.default_rng()
    idx, w = make_routing(rng, num_ranks=num_ranks, num_tokens=num_tokens, top_k=top_k,
                          num_experts=num_experts, kind=kind)
    x = rng.standard_normal((num_ranks, num_tokens, 128)).astype(np.float32)
    ll_x = x.astype(ml_dtypes.bfloat16)
    results = {}
    for name in xla.TRANSPORTS:
        monkeypatch.setenv(xla.TRANSPORT_ENV_VAR, name)
        program = _program(num_experts, capacity, expert_major, use_fp8=kind == "masked")
        results[name] = to_numpy(sharded(program, num_ranks)(x, idx, w, ll_x))
    leaves = jax.tree_util.tree_leaves_with_path(results["all_gather"])
    for (path, want), got in zip(leaves, jax.tree.leaves(results["ragged"]), strict=True):
        _assert_bitwise(got, want, jax.tree_util.keystr(path))


def test_ragged_moves_exactly_the_routed_rows(monkeypatch):
    """The rows each rank sends (the exchange's sizes) are the routing's (token, rank)
    pairs, the count jax_ep.tools.bench.wire reports; self-sends are local copies."""
    monkeypatch.setenv(xla.TRANSPORT_ENV_VAR, "ragged")
    rng = np.random.default_rng()
    num_ranks, num_tokens, top_k, num_experts = 4, 45, 5, 20
    idx, w = make_routing(rng, num_ranks=num_ranks, num_tokens=num_tokens, top_k=top_k,
                          num_experts=num_experts, kind="hot_expert")
    x = rng.standard_normal((num_ranks, num_tokens, 8)).astype(np.float32)

    def per_shard(x, idx, w):
        _, handle = jax_ep.dispatch(x, idx, w, num_experts=num_experts, backend="xla")
        return handle.ragged.counts

    counts = np.asarray(sharded(per_shard, num_ranks)(x, idx, w))[0]
    dest = np.where(idx >= 0, idx // (num_experts // num_ranks), -1)
    want = np.array([[np.sum(np.any(dest[s] == d, axis=1)) for d in range(num_ranks)]
                     for s in range(num_ranks)])
    np.testing.assert_array_equal(counts, want)
    off_diagonal = (want.sum() - np.trace(want)) / num_ranks
    assert wire.rows_to_others(idx, num_experts) == off_diagonal


def test_wire_bytes_at_deepep_shapes():
    """Normal mode at DeepEP's intranode shapes (EP8, 4096 tokens, H 7168, top-8 of 256):
    the ragged transport sends within 1.05x the routed minimum, the all_gather one far more."""
    rng = np.random.default_rng(0)
    idx, _ = make_routing(rng, num_ranks=8, num_tokens=4096, top_k=8, num_experts=256,
                          kind="uniform")
    row = 7168 * 2
    floor = wire.minimum(idx, 256, row, False, "dispatch")
    for direction in ("dispatch", "combine"):
        assert wire.normal(idx, 256, row, "ragged", direction) <= 1.05 * floor
        assert wire.normal(idx, 256, row, "all_gather", direction) > 1.3 * floor


def _lowered(platform, fn, num_ranks, *args):
    m = mesh(num_ranks)
    with jax.set_mesh(m):
        program = jax.jit(suite.stacked_shard_map(fn, m))
        exported = jax.export.export(
            program, platforms=[platform],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")],
        )(*suite.put(m, args))
    return exported.mlir_module()


def _ragged_calls(text):
    """(operand type, output type) of each ragged_all_to_all in a StableHLO module."""
    calls = re.findall(r"custom_call @ragged_all_to_all\(.*?\).*?: \((.*?)\) ->", text)
    return [tuple(t.strip() for t in c.split(", ")[:2]) for c in calls]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_gpu_and_tpu_lowerings_hold_ragged_all_to_all(monkeypatch, platform):
    monkeypatch.setenv(xla.TRANSPORT_ENV_VAR, "ragged")
    R, T, K, E, H, capacity = 4, 16, 3, 8, 256, 40
    rng = np.random.default_rng()
    idx, w = make_routing(rng, num_ranks=R, num_tokens=T, top_k=K, num_experts=E,
                          kind="uniform")
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)

    def normal(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, capacity=capacity,
                                       backend="xla")
        return jax_ep.combine(recv.x, handle, backend="xla")

    def low_latency(x, idx, w):
        recv, handle = jax_ep.low_latency_dispatch(x, idx, num_experts=E, backend="xla")
        return jax_ep.low_latency_combine(recv.x, idx, w, handle, backend="xla")

    packed = T * min(K, R)  # a rank sends each token at most once to each of <= K ranks
    text = _lowered(platform, normal, R, x, idx, w)
    assert _ragged_calls(text) == [
        (f"tensor<{packed}x{2 * K + 1}xi32>", f"tensor<{capacity}x{2 * K + 1}xi32>"),  # routing
        (f"tensor<{packed}x{H}xbf16>", f"tensor<{capacity}x{H}xbf16>"),  # rows to the experts
        (f"tensor<{capacity}x{H}xbf16>", f"tensor<{packed}x{H}xbf16>"),  # and back
    ]
    # Only the counts go to every rank: no all_gather of rows.
    gathers = re.findall(r"all_gather.*?-> tensor<(.*?)>", text)
    assert gathers and all(g.endswith("xi32") and H not in map(int, re.findall(r"\d+", g))
                           for g in gathers), gathers

    text = _lowered(platform, low_latency, R, x, idx, w)
    assert _ragged_calls(text) == [
        (f"tensor<{packed}x{K + 1}xi32>", f"tensor<{R * T}x{K + 1}xi32>"),
        (f"tensor<{packed}x{H}xbf16>", f"tensor<{R * T}x{H}xbf16>"),
        (f"tensor<{R * T * min(K, E // R)}x{H}xbf16>", f"tensor<{T * K}x{H}xbf16>"),
    ]


@pytest.mark.parametrize("expert_major", [False, True])
def test_capacity_factor(expert_major):
    R, T, K, E = 4, 50, 6, 16
    # Uniform routing: a token misses a rank's 4 experts with chance C(12, 6) / C(16, 6).
    average = T * K if expert_major else R * T * (1 - 924 / 8008)
    for factor in (0.5, 1.0, 1.1):
        got = jax_ep.capacity_from_factor(factor, num_ranks=R, num_tokens=T, top_k=K,
                                          num_experts=E, expert_major=expert_major)
        assert got == int(np.ceil(factor * average - 1e-9))
    worst = R * T * (min(K, E // R) if expert_major else 1)
    assert jax_ep.capacity_from_factor(100.0, num_ranks=R, num_tokens=T, top_k=K,
                                       num_experts=E, expert_major=expert_major) == worst

    rng = np.random.default_rng()
    idx, w = make_routing(rng, num_ranks=R, num_tokens=T, top_k=K, num_experts=E,
                          kind="uniform")
    x = rng.standard_normal((R, T, 8)).astype(np.float32)
    want = jax_ep.capacity_from_factor(1.1, num_ranks=R, num_tokens=T, top_k=K,
                                       num_experts=E, expert_major=expert_major)

    def per_shard(x, idx, w):
        recv, _ = jax_ep.dispatch(x, idx, w, num_experts=E, capacity_factor=1.1,
                                  expert_major=expert_major, on_overflow="drop")
        return recv.x

    assert np.asarray(sharded(per_shard, R)(x, idx, w)).shape[1] == want


def test_capacity_factor_errors():
    def per_shard(x, idx, w, **kw):
        return jax_ep.dispatch(x, idx, w, num_experts=8, **kw)[0].x

    x, idx, w = np.zeros((2, 4, 8), np.float32), np.zeros((2, 4, 2), np.int32), np.zeros(
        (2, 4, 2), np.float32)
    with pytest.raises(ValueError, match="capacity or capacity_factor, not both"):
        sharded(lambda *a: per_shard(*a, capacity=4, capacity_factor=1.0), 2)(x, idx, w)
    for bad in (0.0, -1.0, float("nan"), "1.5", True):
        with pytest.raises(ValueError, match="capacity_factor must be a positive finite"):
            sharded(lambda *a, bad=bad: per_shard(*a, capacity_factor=bad), 2)(x, idx, w)
