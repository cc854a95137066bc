"""get_dispatch_layout on both backends (pure JAX, and the custom call's CPU handler)
against the NumPy reference, plus backend selection."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from harness import forget_failed_exchange, mesh, sharded, to_numpy
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_ep
from jax_ep import backends
from jax_ep.tools import reference
from jax_ep.tools.bench.routings import KINDS, make_routing

FIELDS = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "num_invalid")


def _layout(backend, num_ranks, idx, num_experts):
    def per_shard(idx):
        return jax_ep.get_dispatch_layout(idx, num_experts=num_experts, backend=backend)

    return to_numpy(sharded(per_shard, num_ranks)(idx))


@settings(max_examples=10, deadline=None)
@given(
    backend=st.sampled_from(["xla", "cuda"]),
    num_ranks=st.sampled_from([1, 2, 4, 8]),
    num_tokens=st.integers(1, 37),
    top_k=st.sampled_from([1, 2, 6, 8]),
    experts_per_rank=st.integers(1, 7),
    kind=st.sampled_from(KINDS),
    invalid=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_reference(
    backend, num_ranks, num_tokens, top_k, experts_per_rank, kind, invalid, seed
):
    rng = np.random.default_rng(seed)
    num_experts = num_ranks * experts_per_rank
    top_k = min(top_k, num_experts)
    idx, _ = make_routing(rng, num_ranks=num_ranks, num_tokens=num_tokens, top_k=top_k,
                          num_experts=num_experts, kind=kind)
    if invalid:  # ids past the end and below -1 are counted, never used
        idx[rng.random(idx.shape) < 0.1] = num_experts
        idx[rng.random(idx.shape) < 0.1] = -3
    got = _layout(backend, num_ranks, idx, num_experts)
    want = reference.dispatch_layout(idx, num_experts=num_experts)
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(got, field), want[field], err_msg=field)


def test_backends_agree_on_skew():
    rng = np.random.default_rng()
    idx, _ = make_routing(rng, num_ranks=8, num_tokens=50, top_k=8, num_experts=64,
                          kind="hot_expert")
    a = _layout("xla", 8, idx, 64)
    b = _layout("cuda", 8, idx, 64)
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_cuda_backend_lowers_to_the_custom_call(platform):
    """The "cuda" backend is our custom call with its attributes, for CPU and for CUDA (the
    CUDA lowering is produced on this CPU-only jaxlib; the GPU runs the same module)."""

    def per_shard(idx):
        return jax_ep.get_dispatch_layout(idx, num_experts=12, backend="cuda").num_tokens_per_rank

    m = mesh(4)
    fn = jax.jit(jax.shard_map(per_shard, mesh=m, in_specs=jax.P("ep"), out_specs=jax.P("ep")))
    arg = jax.ShapeDtypeStruct((20, 3), np.int32, sharding=jax.NamedSharding(m, jax.P("ep")))
    with jax.set_mesh(m):
        text = fn.trace(arg).lower(lowering_platforms=(platform,)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    ours = [line for line in calls if "@jax_ep_dispatch_layout" in line]
    assert len(ours) == 1, calls
    assert "num_experts = 12 : i64" in ours[0] and "num_ranks = 4 : i64" in ours[0], ours[0]
    assert "tensor<5x3xi32>" in ours[0]  # one shard of topk_idx per device


def test_auto_backend_resolution(monkeypatch):
    if jax_ep.runtime.is_initialized():
        pytest.skip("jax_ep.initialize() has run (a JAX_EP_BACKEND=cuda run): auto is cuda")
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    assert backends.resolve("auto") == "xla"  # nothing initialized
    monkeypatch.setenv(backends.ENV_VAR, "cuda")
    assert backends.resolve("auto") == "cuda"
    monkeypatch.setenv(backends.ENV_VAR, "mpi")
    with pytest.raises(ValueError, match=r"JAX_EP_BACKEND='mpi' is not one of"):
        backends.resolve("auto")


def test_named_backend_never_falls_back():
    rng = np.random.default_rng()
    idx, w = make_routing(rng, num_ranks=2, num_tokens=4, top_k=2, num_experts=4)
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)

    def per_shard(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=4, backend="cuda")[0].x

    if jax_ep.runtime.is_initialized():
        pytest.skip("jax_ep.initialize() has run (a JAX_EP_BACKEND=cuda run): host peers work")
    # Without jax_ep.initialize() the cuda backend cannot exchange between CPU devices: an
    # error, not the xla path.
    with pytest.raises(Exception, match=r"needs jax_ep.initialize\(\) first"):
        jax.block_until_ready(sharded(per_shard, 2)(x, idx, w))
    forget_failed_exchange()
