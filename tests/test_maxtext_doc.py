"""docs/maxtext.md's sketch of MaxText's routed experts on jax_ep, run as written against a
dense layer (every expert on every token, masked by the router), with MaxText's renormalized
softmax weights and no drops."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep.nn import RouterConfig, router

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "maxtext.md"


def test_the_sketch_matches_a_dense_layer():
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102 (the doc's own code)
    routed_experts = scope["routed_experts"]
    R, T, H, F, E, K = 4, 6, 16, 24, 8, 2
    config = RouterConfig(num_experts=E, top_k=K, normalize_topk=True)
    rng = np.random.default_rng()
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    router_w = rng.standard_normal((H, E)).astype(np.float32)
    w_gate, w_up = (rng.standard_normal((E, H, F)).astype(np.float32) * 0.3 for _ in "gu")
    w_down = rng.standard_normal((E, F, H)).astype(np.float32) * 0.3
    mesh = jax.make_mesh((R,), ("ep",), devices=jax.devices()[:R])
    specs = (P("ep"), P(), P("ep"), P("ep"), P("ep"))
    run = jax.jit(jax.shard_map(
        lambda *a: routed_experts(*a, config=config, factor=float(R)), mesh=mesh,  # no drops
        in_specs=specs, out_specs=P("ep")))
    got = run(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(
        (x, router_w, w_gate, w_up, w_down), specs, strict=True)))

    idx, weights, _ = router.select(jnp.asarray(x) @ router_w, config)
    gate = np.zeros((R * T, E), np.float64)
    np.put_along_axis(gate, np.asarray(idx), np.asarray(weights, np.float64), axis=1)
    h = np.einsum("th,ehf->tef", x, w_gate, dtype=np.float64)
    h = h / (1 + np.exp(-h)) * np.einsum("th,ehf->tef", x, w_up, dtype=np.float64)
    want = np.einsum("tef,efh,te->th", h, w_down.astype(np.float64), gate)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
