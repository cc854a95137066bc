"""The default ops compile to programs that never wait for the host: no host callback, and
no collective beside the exchange itself (none at all with the cuda backend's custom calls).
Value checks are still there, as checkify checks that `jax_ep.checked` raises."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from harness import checked, compiled_text
from test_host_peers import host_peers  # noqa: F401 (the cuda programs compile against it)

import jax_ep
from jax_ep.nn import MoE, RouterConfig
from jax_ep.tools.bench.routings import make_routing

R, T, K, E, H = 4, 6, 3, 8, 128
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
               "reduce-scatter", "collective-broadcast")


def collectives(hlo: str) -> set[str]:
    return {op for op in COLLECTIVES if re.search(rf"\b{op}(-start)?\(", hlo)}


def host_callbacks(hlo: str) -> list[str]:
    return re.findall(r'custom_call_target="[^"]*callback[^"]*"', hlo)


def inputs():
    rng = np.random.default_rng()
    idx, w = make_routing(rng, num_ranks=R, num_tokens=T, top_k=K, num_experts=E)
    x = rng.standard_normal((R, T, H)).astype(ml_dtypes.bfloat16)
    return x, idx.astype(np.int32), w.astype(np.float32)


def every_op(backend: str, capacity: int | None):
    """Layout, dispatch (both layouts) and combine with their gradients, and the low-latency
    round trip, all with their default checks."""

    def per_shard(x, idx, w):
        kw = dict(num_experts=E, backend=backend)
        layout = jax_ep.get_dispatch_layout(idx, num_experts=E, backend=backend)

        def loss(x, w):
            total = 0.0
            for em in (False, True):
                recv, handle = jax_ep.dispatch(x, idx, w, capacity=capacity, expert_major=em,
                                               **kw)
                out = jax_ep.combine(recv.x, handle, topk_weights=recv.topk_weights
                                     if em else None, backend=backend)
                total = total + jnp.sum(out.astype(jnp.float32))
            return total

        grads = jax.grad(loss, argnums=(0, 1))(x, w)
        recv, handle = jax_ep.low_latency_dispatch(x, idx, **kw)
        out = jax_ep.low_latency_combine(recv.x, idx, w, handle, backend=backend)
        return layout.num_tokens_per_rank, grads, out

    return per_shard


@pytest.mark.parametrize("capacity", [None, 5], ids=["default-capacity", "capacity-5"])
@pytest.mark.parametrize("backend", ["cuda", "xla"])
def test_default_ops_never_wait_for_the_host(backend, capacity):
    hlo = compiled_text(every_op(backend, capacity), R, *inputs())
    assert not host_callbacks(hlo), host_callbacks(hlo)
    if backend == "cuda":  # the exchange is the custom calls: nothing else talks to peers
        assert not collectives(hlo), collectives(hlo)
        # ... and each of them is side-effecting: XLA never drops, duplicates or reorders one.
        exchange = re.findall(r'[^\n]*custom_call_target="jax_ep_(?!dispatch_layout)[^\n]*', hlo)
        assert len(exchange) >= 6, exchange
        assert all("custom_call_has_side_effect=true" in call for call in exchange), exchange


def test_checks_still_raise_through_checked():
    x, idx, w = inputs()
    idx[2, 1, 0] = E + 3
    with pytest.raises(ValueError, match=r"topk_idx holds 1 expert id\(s\) outside \[-1, 8\)"):
        checked(every_op("xla", None), R)(x, idx, w)


def test_moe_layer_never_waits_for_the_host():
    mesh = jax.make_mesh((2, 4), ("data", "ep"))
    config = RouterConfig(num_experts=8, top_k=2)
    model = MoE(16, 12, config, mesh=mesh, num_shared_experts=1, backend="cuda",
                rngs=nnx.Rngs(0))
    # Tokens split over every device, as a training step holds them.
    x = jax.device_put(jax.random.normal(jax.random.key(1), (8, 8, 16)),
                       jax.NamedSharding(mesh, jax.P(("data", "ep"))))
    with jax.set_mesh(mesh):
        lowered = nnx.jit(lambda m, x: m(x)[0]).lower(model, x)
    hlo = lowered.compile().as_text()
    assert not host_callbacks(hlo) and not collectives(hlo), (host_callbacks(hlo),
                                                               collectives(hlo))
