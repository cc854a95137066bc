"""The per-shard "cuda" backend (jax_ep.backends.cuda) on this CPU-only machine.

With one rank (R = 1) its custom calls need no peers, so the CPU handlers run them: forward
results and gradients through the shared custom_vjp must equal the portable backend's bit for
bit. With R > 1 the exchange needs jax_ep.initialize() (host peers on CPU, tested in
test_host_peers.py): without it the call fails with an error that says so, and the programs
still lower for CUDA (the custom calls, their attributes and the V = 1 shapes of one rank per
device).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import forget_failed_exchange, sharded, to_numpy
from test_virtual import assert_bitwise, routing

import jax_ep
from jax_ep import _ffi

pytestmark = pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")


def _normal_program(backend, expert_major, E, capacity):
    def per_shard(x, idx, w, y_scale):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, capacity=capacity,
                                       expert_major=expert_major, on_overflow="drop",
                                       on_invalid="mask", backend=backend)
        # Expert-major: weight each entry; rank-major: unweighted rows.
        weights = recv.topk_weights if expert_major else None
        y = recv.x * y_scale
        out = jax_ep.combine(y, handle, topk_weights=weights, backend=backend)
        return recv.with_zero_padding(), out

    return per_shard


@pytest.mark.parametrize("expert_major", [False, True])
def test_one_rank_matches_portable_backend(expert_major):
    rng = np.random.default_rng()
    T, K, E, H = 23, 4, 6, 16
    idx, w = routing(rng, 1, T, K, E, "duplicates", invalid=True)
    x = rng.standard_normal((1, T, H)).astype(np.float32)
    scale = rng.standard_normal((1,)).astype(np.float32)
    capacity = int(rng.integers(T // 2, T * K))
    got, want = (
        to_numpy(sharded(_normal_program(b, expert_major, E, capacity), 1)(x, idx, w, scale))
        for b in ("cuda", "xla")
    )
    for (path, g), w_ in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                             jax.tree.leaves(want), strict=True):
        assert_bitwise(g, w_, jax.tree_util.keystr(path))


def gradient_program(backend, E, expert_major, **placement):
    """Per shard (x, w, idx, target) -> gradients of a dispatch/combine loss w.r.t. x, w;
    `placement`: the ops' num_sms and stream."""
    def per_shard(x, w, idx, target):
        def loss(x, w):
            recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E,
                                           expert_major=expert_major, backend=backend,
                                           **placement)
            weights = recv.topk_weights if expert_major else None
            out = jax_ep.combine(jnp.tanh(recv.x), handle, topk_weights=weights,
                                 backend=backend, **placement)
            return jnp.sum((out - target) ** 2)

        return jax.grad(loss, argnums=(0, 1))(x, w)

    return per_shard


@pytest.mark.parametrize("expert_major", [False, True])
def test_one_rank_gradients_match_portable_backend(expert_major):
    rng = np.random.default_rng()
    T, K, E, H = 11, 3, 5, 8
    idx, w = routing(rng, 1, T, K, E, "masked")
    x = rng.standard_normal((1, T, H)).astype(np.float32)
    target = rng.standard_normal((1, T, H)).astype(np.float32)

    def gradients(backend):
        program = gradient_program(backend, E, expert_major)
        return to_numpy(sharded(program, 1)(x, w, idx, target))

    (gx, gw), (want_x, want_w) = gradients("cuda"), gradients("xla")
    # The backward data movement is bitwise (test_virtual.py); the arithmetic around it is
    # XLA's, which may fuse (FMA) and reduce (the weights' dot products) differently next to
    # a custom call than next to a gather, so the last bits can differ.
    np.testing.assert_allclose(gx, want_x, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gw, want_w, rtol=1e-5, atol=1e-5)


def test_placement_moves_the_kernels_not_the_results():
    """`num_sms` and `stream` say where the kernels run (forward and backward): on the CPU
    the handlers run as before (the stream's call is an ordinary call there), so the values
    and gradients are those of the default placement, bit for bit."""
    rng = np.random.default_rng()
    T, K, E, H = 13, 3, 5, 8
    idx, w = routing(rng, 1, T, K, E, "hot_expert")
    x = rng.standard_normal((1, T, H)).astype(np.float32)
    target = rng.standard_normal((1, T, H)).astype(np.float32)

    def gradients(**placement):
        program = gradient_program("cuda", E, True, **placement)
        return to_numpy(sharded(program, 1)(x, w, idx, target))

    want = gradients(num_sms=None)
    for placement in ({"num_sms": 1, "stream": 1}, {"stream": 0}, {"num_sms": 2}):
        for g, w_ in zip(gradients(**placement), want, strict=True):
            assert_bitwise(g, w_, f"gradient with {placement}")


@pytest.mark.parametrize("expert_major", [False, True])
def test_combine_cotangent_is_zero_in_the_padding(expert_major):
    """The rows of y past the count get an exact zero cotangent (docs/contract.md, "Padding")
    although the received rows there are unspecified."""
    rng = np.random.default_rng()
    T, K, E, H = 13, 3, 4, 8
    idx, w = routing(rng, 1, T, K, E, "masked")
    x = rng.standard_normal((1, T, H)).astype(np.float32)

    def per_shard(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=expert_major,
                                       backend="cuda")
        weights = recv.topk_weights if expert_major else None

        def loss(y, weights):
            out = jax_ep.combine(y, handle, topk_weights=weights, backend="cuda")
            return jnp.sum(out ** 2)

        d_y, d_w = jax.grad(loss, argnums=(0, 1))(recv.x, weights)
        return d_y, d_w, recv.num_tokens

    d_y, d_w, kept = to_numpy(sharded(per_shard, 1)(x, idx, w))
    assert kept[0] < d_y.shape[1]  # there is padding
    assert np.isfinite(d_y).all()
    assert (d_y[0, kept[0]:] == 0).all() and d_y[0, :kept[0]].any()
    if expert_major:
        assert (d_w[0, kept[0]:] == 0).all()


@pytest.mark.parametrize("use_fp8", [False, True])
def test_one_rank_low_latency_matches_portable_backend(use_fp8):
    rng = np.random.default_rng()
    T, K, E, H = 9, 3, 4, 256
    idx, w = routing(rng, 1, T, K, E, "duplicates")
    x = rng.standard_normal((1, T, H)).astype(ml_dtypes.bfloat16)

    def program(backend):
        def per_shard(x, idx, w):
            pending = jax_ep.low_latency_dispatch_send(x, idx, num_experts=E, use_fp8=use_fp8,
                                                       backend=backend)
            recv, handle = jax_ep.low_latency_dispatch_recv(pending)
            y = recv.x.astype(jnp.bfloat16)
            out = jax_ep.low_latency_combine(y, idx, w, handle, backend=backend)
            return recv.with_zero_padding(), out

        return to_numpy(sharded(per_shard, 1)(x, idx, w))

    for g, w_ in zip(jax.tree.leaves(program("cuda")), jax.tree.leaves(program("xla")),
                     strict=True):
        assert_bitwise(g, w_, "low-latency")


def test_several_ranks_on_cpu_say_what_is_needed():
    if jax_ep.runtime.is_initialized():
        pytest.skip("jax_ep.initialize() has run (a JAX_EP_BACKEND=cuda run): host peers work")
    rng = np.random.default_rng()
    idx, w = routing(rng, 2, 4, 2, 4, "uniform")
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)
    assert not jax_ep.runtime.is_initialized()
    with pytest.raises(Exception, match=r"between devices needs jax_ep.initialize\(\) first"):
        to_numpy(sharded(_normal_program("cuda", False, 4, None), 2)(
            x, idx, w, np.ones(2, np.float32)))
    forget_failed_exchange()


TARGETS = ("jax_ep_dispatch", "jax_ep_combine", "jax_ep_ll_dispatch_send",
           "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv")


def _lower_every_op_for_cuda(R, expert_major, **placement):
    """The HLO text of every per-shard op at R ranks, lowered for CUDA."""
    T, K, E, H = 6, 3, 8, 128
    mesh = jax.make_mesh((R,), ("ep",), devices=jax.devices()[:R])
    spec = jax.sharding.PartitionSpec("ep")

    def per_shard(x, idx, w):
        recv, handle = jax_ep.dispatch(x, idx, w, num_experts=E, expert_major=expert_major,
                                       on_overflow="drop", on_invalid="mask", backend="cuda",
                                       **placement)
        out = jax_ep.combine(recv.x, handle, backend="cuda", **placement)
        ll, ll_handle = jax_ep.low_latency_dispatch(x, idx, num_experts=E, on_invalid="mask",
                                                    backend="cuda", **placement)
        return out + jax_ep.low_latency_combine(ll.x, idx, w, ll_handle, backend="cuda",
                                                **placement)

    fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec))
    sharding = jax.sharding.NamedSharding(mesh, spec)
    args = (jax.ShapeDtypeStruct((R * T, H), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((R * T, K), jnp.int32, sharding=sharding),
            jax.ShapeDtypeStruct((R * T, K), jnp.float32, sharding=sharding))
    with jax.set_mesh(mesh):
        return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")


@pytest.mark.parametrize("expert_major", [False, True])
def test_several_ranks_lower_for_cuda(expert_major):
    R = 4
    hlo = _lower_every_op_for_cuda(R, expert_major)
    for target in TARGETS:
        assert f'custom_call_target="{target}"' in hlo, target
    # The normal-mode ops bound their SMs by default; the low-latency ones do not.
    assert len(re.findall(rf"num_sms = {jax_ep.DEFAULT_NUM_SMS} ", hlo)) == 2
    # One rank per device: the operands stack V = 1 rank, the attributes name all R.
    assert "bf16[1,6,128]" in hlo, hlo[:2000]
    assert "num_ranks=4" in hlo.replace(" ", "") or "num_ranks = 4" in hlo
    # The receive half of low-latency dispatch updates the send's buffers in place.
    assert "output_to_operand_aliasing" in hlo


def _computations(hlo: str) -> dict[str, str]:
    """HLO text's computations: name -> body."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([^\s(]+)[^{]*\{$", line)
        if header:
            name = header.group(1)
            bodies[name] = ""
        elif name is not None:
            bodies[name] += line + "\n"
    return bodies


def test_stream_puts_every_custom_call_in_a_call_on_that_stream():
    """With `stream=N` each exchange custom call sits alone in a computation that is called
    with XLA's stream annotation N (compute_on2's lowering), which XLA turns into an
    asynchronous call on GPU stream N; without a stream there is no annotation."""
    hlo = _lower_every_op_for_cuda(2, True, stream=3, num_sms=7)
    bodies = _computations(hlo)
    placed = 0
    for name, body in bodies.items():
        targets = re.findall(r'custom_call_target="(jax_ep_\w+)"', body)
        if not targets:
            continue
        assert len(targets) == 1, f"{name} holds {targets}"
        assert "num_sms = 7 " in body, body
        calls = [line for b in bodies.values() for line in b.splitlines()
                 if f"to_apply={name}," in line]
        assert calls and all('_xla_stream_annotation="3"' in c for c in calls), (name, calls)
        placed += 1
    assert placed == len(TARGETS)
    assert "_xla_stream_annotation" not in _lower_every_op_for_cuda(2, True)
