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


def test_the_adapter_has_maxtexts_names_and_return():
    """jax_ep.nn.maxtext.RoutedMoE: MaxText's parameter tree (gate.kernel, gate.bias, wi_0,
    wi_1, wo), the same outputs as jax_ep.nn.MoE on the same parameters, and MaxText's return
    (output, lb_loss, bias_updates) checked against NumPy."""
    from flax import nnx

    from jax_ep.nn import MoE
    from jax_ep.nn.maxtext import RoutedMoE

    R, T, H, F, E, K = 4, 6, 16, 24, 8, 2
    config = RouterConfig(num_experts=E, top_k=K, normalize_topk=True)
    mesh = jax.make_mesh((R,), ("ep",), devices=jax.devices()[:R])
    weight, rate = 0.01, 1e-3
    seed = int(np.random.default_rng().integers(1 << 30))
    x = np.random.default_rng().standard_normal((2, R * T // 2, H)).astype(np.float32)
    with jax.set_mesh(mesh):
        layer = RoutedMoE(H, F, config, mesh=mesh, load_balance_loss_weight=weight,
                          bias_rate=rate, rngs=nnx.Rngs(seed))
        plain = MoE(H, F, config, mesh=mesh, rngs=nnx.Rngs(seed))
        shapes = jax.tree.map(lambda a: a.shape, nnx.to_pure_dict(nnx.state(layer)))
        assert shapes == {"gate": {"kernel": (H, E), "bias": (E,)}, "wi_0": (E, H, F),
                          "wi_1": (E, H, F), "wo": (E, F, H)}, shapes
        assert nnx.state(layer, nnx.Param)["wi_0"].get_metadata()["out_sharding"] == (
            "exp", "embed_no_exp", "mlp")
        out, lb_loss, bias_updates = layer(jnp.asarray(x))
        want, stats = plain(jnp.asarray(x))
    np.testing.assert_array_equal(out, want)  # the same program on the same parameters

    # NumPy: the choices' load, the balance loss and the bias's step.
    kernel = np.asarray(layer.gate.kernel[...], np.float64)
    logits = x.reshape(-1, H).astype(np.float64) @ kernel
    scores = np.exp(logits - logits.max(1, keepdims=True))
    scores /= scores.sum(1, keepdims=True)
    chosen = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    load = np.bincount(chosen.ravel(), minlength=E).astype(np.float64)
    np.testing.assert_array_equal(stats.load, load)
    balance = E * np.sum(load / load.sum() * scores.mean(0))
    np.testing.assert_allclose(lb_loss, weight * balance, rtol=1e-5)
    np.testing.assert_allclose(bias_updates, rate * np.sign(load.mean() - load), atol=1e-9)
    layer.update_bias(stats.load)  # moves MaxText's gate.bias by bias_updates
    np.testing.assert_allclose(layer.gate.bias[...], bias_updates, atol=1e-9)

    with jax.set_mesh(mesh):
        quiet = RoutedMoE(H, F, config, mesh=mesh, rngs=nnx.Rngs(seed))
        assert quiet(jnp.asarray(x))[1:] == (None, None)  # weight 0, rate 0: as MaxText
        try:
            RoutedMoE(H, F, config, mesh=mesh, num_shared_experts=1, rngs=nnx.Rngs(0))
        except ValueError as error:
            assert "RoutedAndSharedMoE" in str(error)
        else:
            raise AssertionError("shared experts were accepted")
