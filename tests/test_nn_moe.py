"""jax_ep.nn.MoE against a dense MoE (every expert on every token, masked by the router),
forward and gradients, on 1, 2, 4 and 8 CPU devices; and the routing rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ep.nn import MoE, RouterConfig, default_sharding_rules, router


def dense_moe(p: dict, x, config: RouterConfig, expert_x=None):
    """The same layer without any communication: all experts on all tokens. `p` holds the
    layer's parameters as plain arrays (router, expert_bias, w_gate, w_up, w_down, shared);
    `expert_x`, if given, is what the routed experts see instead of x."""
    tokens = x.reshape(-1, x.shape[-1])
    inputs = tokens if expert_x is None else expert_x.reshape(tokens.shape)
    idx, weights, _ = router.select(tokens @ p["router"], config, p["expert_bias"])
    gate = jnp.zeros((tokens.shape[0], config.num_experts)).at[
        jnp.arange(tokens.shape[0])[:, None], idx].add(weights)
    h = jax.nn.silu(jnp.einsum("th,ehf->tef", inputs, p["w_gate"])) * jnp.einsum(
        "th,ehf->tef", inputs, p["w_up"])
    y = jnp.einsum("tef,efh,te->th", h, p["w_down"], gate)
    g, u, d = p["shared"]
    y = y + (jax.nn.silu(tokens @ g) * (tokens @ u)) @ d
    return y.reshape(x.shape)


def plain_params(model: MoE) -> dict:
    """The layer's parameters as host arrays, outside any mesh."""
    get = lambda v: np.asarray(jax.device_get(v[...]))  # noqa: E731
    return {"router": get(model.router), "expert_bias": get(model.expert_bias),
            "w_gate": get(model.w_gate), "w_up": get(model.w_up), "w_down": get(model.w_down),
            "shared": [get(w) for w in model.shared]}


def make(ep: int, data: int = 1, **router_kw):
    mesh = jax.make_mesh((data, ep), ("data", "ep"), devices=jax.devices()[: data * ep])
    cfg = RouterConfig(**{"num_experts": 8, "top_k": 2, **router_kw})
    return MoE(16, 12, cfg, mesh=mesh, num_shared_experts=1, backend="xla",
               rngs=nnx.Rngs(0)), mesh


# A rank alone, 8 ranks, and one of the meshes between, drawn from the test's seed.
@pytest.mark.parametrize("ep, data", [(1, 1), (8, 1), pytest.param(None, None, id="drawn")])
def test_matches_dense_forward_and_gradients(ep, data):
    if ep is None:
        ep, data = [(2, 1), (4, 1), (2, 2), (4, 2)][np.random.default_rng().integers(4)]
    model, mesh = make(ep, data, score="sigmoid", num_groups=4, top_groups=2,
                       routed_scaling=2.5)
    x = np.asarray(jax.random.normal(jax.random.key(1), (4, 8, 16)))
    p = plain_params(model)

    def dense_loss(p, x):
        return jnp.sum(jnp.sin(dense_moe(p, x, model.config)))

    want = dense_moe(p, x, model.config)
    w_p, w_x = jax.grad(dense_loss, argnums=(0, 1))(p, x)
    with jax.set_mesh(mesh):
        got = nnx.jit(lambda m, x: m(x)[0])(model, x)
        g_model, g_x = nnx.jit(nnx.grad(lambda m, x: jnp.sum(jnp.sin(m(x)[0])),
                                        argnums=(0, 1)))(model, x)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(g_x, w_x, rtol=1e-4, atol=1e-5)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(g_model[name][...], w_p[name], rtol=1e-4,
                                   atol=1e-5, err_msg=name)
    for i, want_w in enumerate(w_p["shared"]):
        np.testing.assert_allclose(g_model["shared"][i][...], want_w, rtol=1e-4, atol=1e-5,
                                   err_msg="shared")


def test_topk_weights_renormalized_as_maxtext_routes():
    """normalize_topk: each token's chosen weights divided by their sum, for softmax scores
    the softmax over the top-k logits (MaxText's default), checked in float64."""
    rng = np.random.default_rng()
    logits = rng.standard_normal((37, 12)).astype(np.float32)
    for score in ("softmax", "sigmoid"):
        cfg = RouterConfig(num_experts=12, top_k=3, score=score, normalize_topk=True,
                           routed_scaling=1.5)
        idx, w, _ = router.select(jnp.asarray(logits), cfg)
        idx = np.asarray(idx)
        assert (np.sort(idx, 1) == np.sort(np.argsort(-logits, 1)[:, :3], 1)).all()
        top = np.take_along_axis(logits.astype(np.float64), idx, 1)
        e = np.exp(top) if score == "softmax" else 1 / (1 + np.exp(-top))
        np.testing.assert_allclose(w, 1.5 * e / e.sum(1, keepdims=True), rtol=1e-6)
    _, w, s = router.select(jnp.asarray(logits), RouterConfig(num_experts=12, top_k=3))
    assert float(jnp.max(jnp.sum(w, 1))) < 1  # softmax, not renormalized: the scores
    with pytest.raises(TypeError, match="normalize_topk must be True, False or None"):
        RouterConfig(num_experts=4, top_k=2, normalize_topk=1)


def test_any_router_plugs_in():
    """router_fn chooses instead of the config's rule (here MaxText's renormalized softmax,
    its weights in bfloat16, upcast): the layer equals the dense layer of that rule."""
    maxtext = RouterConfig(num_experts=8, top_k=2, normalize_topk=True)

    def router_fn(logits):
        idx, weights, _ = router.select(logits, maxtext)
        return idx, weights.astype(jnp.bfloat16)

    model, mesh = make(2)
    model.router_fn = router_fn
    x = np.asarray(jax.random.normal(jax.random.key(1), (4, 8, 16)))
    p = plain_params(model)
    with jax.set_mesh(mesh):
        got, stats = nnx.jit(lambda m, x: m(x))(model, x)
    want = dense_moe(p, x, maxtext)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)  # weights rounded to bf16
    assert not np.allclose(want, dense_moe(p, x, model.config), rtol=1e-2, atol=1e-2)
    assert float(stats.load.sum()) == 32 * 2
    model.router_fn = lambda logits: (logits[:, :3].astype(jnp.int32), logits[:, :3])
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"router_fn must return "
                                           r"\(topk_idx int \[16, 2\]"):
        nnx.jit(lambda m, x: m(x))(model, x)
    with pytest.raises(TypeError, match="router_fn must be a function"):
        MoE(16, 12, maxtext, mesh=mesh, router_fn="top2", rngs=nnx.Rngs(0))


def test_stats_and_bias_update_move_toward_balance():
    model, mesh = make(2)
    model.bias_rate = 0.05
    # Skewed tokens: most logits favour the same experts.
    x = jax.random.normal(jax.random.key(2), (64, 16)) + 3.0 * model.router[...][:, 0]

    @nnx.jit
    def step(model, x):
        _, stats = model(x)
        model.update_bias(stats.load)
        return stats

    with jax.set_mesh(mesh):
        first = step(model, x)
        assert float(first.load.sum()) == 64 * 2 and int(first.dropped) == 0
        assert float(first.aux_loss) > 1.0  # skewed
        for _ in range(30):
            stats = step(model, x)
    assert float(stats.load.max()) < float(first.load.max())  # the hottest expert lost load
    assert float(stats.aux_loss) < float(first.aux_loss)


def test_backends_give_the_same_training_trajectory():
    """Three optimizer steps with the cuda backend (its CPU handlers; one rank per EP group
    here), also overlapped (its dispatch and combine on a stream of their own), and with the
    xla backend: the same losses."""
    import optax

    losses = {}
    for backend, overlap in (("cuda", False), ("cuda", True), ("xla", False)):
        mesh = jax.make_mesh((8, 1), ("data", "ep"))
        model = MoE(16, 12, RouterConfig(num_experts=4, top_k=2), mesh=mesh,
                    num_shared_experts=1, backend=backend, overlap=overlap, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        x = jax.random.normal(jax.random.key(5), (32, 16))

        @nnx.jit
        def step(model, optimizer, x):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x)[0] ** 2))(model)
            optimizer.update(model, grads)
            return loss

        with jax.set_mesh(mesh):
            losses[backend, overlap] = [float(step(model, optimizer, x)) for _ in range(3)]
    want = losses["xla", False]
    np.testing.assert_allclose(losses["cuda", False], want, rtol=1e-6)
    np.testing.assert_allclose(losses["cuda", True], want, rtol=1e-6)
    assert want[2] < want[0]


def test_expert_alignment_leaves_results_unchanged():
    """Aligned groups (with padding between them) give the packed layer's output and
    gradients, within float32 rounding: jax.lax.ragged_dot over differently padded groups may
    sum in another order on some CPUs (neither XLA nor the contract promises its order); the
    exchange itself is bit for bit (tests/test_alignment.py). An e4m3 wire or none, drawn
    from the test's seed."""
    wire_format = ("e4m3", None)[int(np.random.default_rng().integers(2))]
    x = np.asarray(jax.random.normal(jax.random.key(3), (2, 8, 128)))
    results = []
    for alignment in (None, 8):
        mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
        model = MoE(128, 12, RouterConfig(num_experts=8, top_k=3), mesh=mesh,
                    expert_alignment=alignment, wire_format=wire_format, backend="xla",
                    rngs=nnx.Rngs(0))
        with jax.set_mesh(mesh):
            y = nnx.jit(lambda m, x: m(x)[0])(model, x)
            g = nnx.jit(nnx.grad(lambda m, x: jnp.sum(jnp.sin(m(x)[0]))))(model, x)
        results.append((y, g["w_up"][...], g["router"][...]))
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_masked_tokens_go_nowhere():
    model, mesh = make(4)
    x = np.asarray(jax.random.normal(jax.random.key(9), (2, 16, 16)))
    mask = np.ones((2, 16), bool)
    mask[1, 5:] = False  # padding
    p = plain_params(model)
    with jax.set_mesh(mesh):
        y, stats = nnx.jit(lambda m, x, k: m(x, k))(model, x, mask)
    assert float(stats.load.sum()) == mask.sum() * 2
    g, u, d = p["shared"]
    shared = (jax.nn.silu(x @ g) * (x @ u)) @ d
    np.testing.assert_allclose(y[~mask], shared[~mask], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y[mask], dense_moe(p, x, model.config)[mask], rtol=2e-5,
                               atol=2e-5)
    with pytest.raises(ValueError, match="mask"):
        model(x, mask[:, :3])


def test_group_limit_and_bias_rules():
    cfg = RouterConfig(num_experts=8, top_k=2, num_groups=4, top_groups=1, score="sigmoid")
    logits = jax.random.normal(jax.random.key(3), (32, 8))
    idx, w, s = router.select(logits, cfg)
    assert np.all(idx[:, 0] // 2 == idx[:, 1] // 2)  # both choices in one group
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-6)  # sigmoid weights normalized
    bias = jnp.zeros(8).at[7].set(10.0)
    idx_b, w_b, _ = router.select(logits, RouterConfig(num_experts=8, top_k=2), bias)
    assert np.all(np.any(idx_b == 7, axis=1))  # the bias steers the choice ...
    scores = jax.nn.softmax(logits)
    np.testing.assert_allclose(w_b, jnp.take_along_axis(scores, idx_b, 1))  # ... not weights


@pytest.mark.parametrize("kw, message", [
    ({"top_k": 9}, "top_k"), ({"num_groups": 3}, "num_groups"),
    ({"num_groups": 4, "top_groups": 1, "top_k": 3}, "top_groups"), ({"score": "relu"}, "score"),
])
def test_router_config_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**{"num_experts": 8, "top_k": 2, **kw})


def test_redundant_experts_balance_ranks_and_leave_results_unchanged():
    """EPLB in the layer: replicas of hot experts even out the ranks' loads; outputs and
    gradients equal the layer without replicas (replicas share their expert's weights)."""
    mesh = jax.make_mesh((2, 4), ("data", "ep"))
    cfg = RouterConfig(num_experts=8, top_k=2, num_groups=4, top_groups=2)
    plain = MoE(16, 12, cfg, mesh=mesh, backend="xla", rngs=nnx.Rngs(0))
    replicated = MoE(16, 12, cfg, mesh=mesh, backend="xla", redundant_experts=4,
                     rngs=nnx.Rngs(0))
    # Skewed tokens: most of them prefer the same experts.
    x = jax.random.normal(jax.random.key(5), (96, 16)) + 2.5 * plain.router[...][:, 3]
    loss = lambda m, x: jnp.sum(jnp.sin(m(x)[0]))  # noqa: E731
    with jax.set_mesh(mesh):
        forward = nnx.jit(lambda m, x: m(x))
        want, stats = forward(plain, x)
        replicated.rebalance(stats.load)
        got, stats_r = forward(replicated, x)
        g_plain = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(plain, x)
        g_rep = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(replicated, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(stats_r.load, stats.load)  # logical load is unchanged
    assert int(stats.rank_load.sum()) == int(stats_r.rank_load.sum()) == int(stats.load.sum())
    before = float(stats.rank_load.max() / stats.rank_load.mean())
    after = float(stats_r.rank_load.max() / stats_r.rank_load.mean())
    print(f"EP rank load max/mean: {before:.2f} without replicas, {after:.2f} with 4")
    assert before > 1.3 and after < before - 0.2
    np.testing.assert_allclose(g_rep[1], g_plain[1], rtol=1e-4, atol=1e-6)
    for name in ("router", "w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(g_rep[0][name][...], g_plain[0][name][...], rtol=1e-4,
                                   atol=1e-6, err_msg=name)
    with pytest.raises(ValueError, match="multiple of the EP axis size"):
        MoE(16, 12, cfg, mesh=mesh, redundant_experts=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no redundant experts"):
        plain.rebalance(stats.load)


def test_logical_axis_names_are_settable():
    """logical_axes renames the logical axes the parameters carry (MaxText's names here): the
    metadata and the rules use them, sharding_rules names them so, and the placement is the
    one their rules give."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "ep"))
    cfg = RouterConfig(num_experts=8, top_k=2)
    names = {"expert": "exp", "embed": "embed_no_exp"}
    model = MoE(16, 12, cfg, mesh=mesh, logical_axes=names, sharding_rules=(("mlp", "data"),),
                num_shared_experts=1, rngs=nnx.Rngs(0))
    assert model.w_gate.get_metadata()["out_sharding"] == ("exp", "embed_no_exp", "mlp")
    assert dict(model.sharding_rules) == {"exp": "ep", "embed_no_exp": None, "mlp": "data"}
    with jax.set_mesh(mesh):
        spec = nnx.get_partition_spec(nnx.state(model, nnx.Param))["w_gate"].get_value()
    assert spec == P("ep", None, "data") == model.w_gate[...].sharding.spec
    for bad, match in (({"experts": "x"}, "logical_axes maps the layer's axes"),
                       ({"embed": "mlp"}, "gives two of the layer's axes one name")):
        with pytest.raises(ValueError, match=match):
            MoE(16, 12, cfg, mesh=mesh, logical_axes=bad, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="names the logical axis 'embed'; the layer's axes"):
        MoE(16, 12, cfg, mesh=mesh, logical_axes=names, sharding_rules=(("embed", "data"),),
            rngs=nnx.Rngs(0))


def test_parameters_carry_their_ep_sharding_for_flax():
    """nnx.get_partition_spec / get_named_sharding (Flax's sharding metadata, logical axes
    mapped by the layer's rules) give the experts' EP placement, the arrays are placed so, and
    the NNX guide's jitted init keeps it."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "ep"))
    cfg = RouterConfig(num_experts=8, top_k=2)

    def create():
        return MoE(16, 12, cfg, mesh=mesh, num_shared_experts=1, rngs=nnx.Rngs(0))

    @nnx.jit
    def create_sharded():  # the NNX sharding guide's recipe
        model = create()
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state,
                                                           nnx.get_partition_spec(state)))
        return model

    want = {"router": P(None, None), "w_gate": P("ep", None, None),
            "w_up": P("ep", None, None), "w_down": P("ep", None, None)}
    with jax.set_mesh(mesh):
        for model in (create(), create_sharded()):
            state = nnx.state(model, nnx.Param)
            specs = nnx.get_partition_spec(state)
            named = nnx.get_named_sharding(state, mesh)
            for name, spec in want.items():
                assert specs[name].get_value() == spec, name
                assert named[name].get_value() == jax.NamedSharding(mesh, spec), name
                assert model.__getattribute__(name)[...].sharding.spec == spec, name
            assert specs["shared"][0].get_value() == P(None, None)
            assert model.w_gate.out_sharding == ("expert", "embed", "mlp")


def test_experts_sharded_further_over_another_axis():
    """sharding_rules (("mlp", "tp"),) stores the FFN dimension over "tp" as well: the same
    forward and gradients as the dense layer, and gradients placed like their parameters."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2, 2), ("data", "ep", "tp"))
    cfg = RouterConfig(num_experts=8, top_k=3, score="sigmoid", num_groups=4, top_groups=2)
    model = MoE(16, 12, cfg, mesh=mesh, num_shared_experts=1, backend="xla",
                sharding_rules=(("mlp", "tp"),), rngs=nnx.Rngs(3))
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    assert specs["w_gate"].get_value() == P("ep", None, "tp")
    assert specs["w_down"].get_value() == P("ep", "tp", None)
    assert specs["shared"][2].get_value() == P("tp", None)
    assert model.w_down[...].sharding.spec == P("ep", "tp", None)
    x = np.asarray(jax.random.normal(jax.random.key(4), (3, 8, 16)))
    p = plain_params(model)
    w_p = jax.grad(lambda p: jnp.sum(jnp.sin(dense_moe(p, x, cfg))))(p)
    with jax.set_mesh(mesh):
        got = nnx.jit(lambda m, x: m(x)[0])(model, x)
        grads = nnx.jit(nnx.grad(lambda m: jnp.sum(jnp.sin(m(x)[0]))))(model)
    np.testing.assert_allclose(got, dense_moe(p, x, cfg), rtol=2e-5, atol=2e-5)
    for name in ("w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(grads[name][...], w_p[name], rtol=1e-4, atol=1e-5)
        assert grads[name][...].sharding.spec == specs[name].get_value(), name


def test_param_dtype_apart_from_compute_dtype():
    """float32 parameters computed in bfloat16: parameters and their gradients stay
    float32, the output is bfloat16 and close to the float32 layer's."""
    mesh = jax.make_mesh((1, 4), ("data", "ep"), devices=jax.devices()[:4])
    cfg = RouterConfig(num_experts=8, top_k=2)
    layers = {dtype: MoE(16, 12, cfg, mesh=mesh, num_shared_experts=1, backend="xla",
                         dtype=dtype, rngs=nnx.Rngs(0)) for dtype in (None, jnp.bfloat16)}
    x = jax.random.normal(jax.random.key(6), (32, 16))
    with jax.set_mesh(mesh):
        want = nnx.jit(lambda m, x: m(x)[0])(layers[None], x)
        got = nnx.jit(lambda m, x: m(x)[0])(layers[jnp.bfloat16], x)
        grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x)[0].astype(jnp.float32))))(
            layers[jnp.bfloat16])
    assert layers[jnp.bfloat16].w_gate[...].dtype == jnp.float32
    assert want.dtype == jnp.float32 and got.dtype == jnp.bfloat16
    assert grads["w_gate"][...].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.05)
    half = MoE(16, 12, cfg, mesh=mesh, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert half.w_up[...].dtype == jnp.bfloat16


@pytest.mark.parametrize("rules, match", [
    ((("expert", "data"),), "pass ep_axis='data'"),
    ((("mlp", "nope"),), "not a mesh axis"),
    ((("mlp", "ep"),), "not a mesh axis other than the EP axis"),
    ((("heads", "data"),), "logical axis 'heads'"),
    ((("mlp", "data"), ("embed", "data")), "only one of a weight's dimensions"),
    ((("mlp", "data"),), "cannot be sharded over mesh axis 'data' of size 2"),
])
def test_bad_sharding_rules_are_named(rules, match):
    mesh = jax.make_mesh((2, 4), ("data", "ep"))
    with pytest.raises(ValueError, match=match):
        MoE(16, 13, RouterConfig(num_experts=8, top_k=2), mesh=mesh, sharding_rules=rules,
            rngs=nnx.Rngs(0))


def test_linen_wrapper_in_a_linen_model():
    """jax_ep.nn.linen.MoE inside a Linen model, initialized and trained under jit on a
    (data, ep) mesh of auto axes (as MaxText makes them): logically partitioned parameters
    placed over the EP axis, the dense layer's output and gradients, and the bias update
    through apply."""
    from flax import linen as nn
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from jax_ep.nn import linen as ep_linen

    mesh = jax.make_mesh((2, 4), ("data", "ep"), axis_types=(AxisType.Auto,) * 2)
    cfg = RouterConfig(num_experts=8, top_k=2, score="sigmoid")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(16, name="proj")(x)
            y, stats = ep_linen.MoE(16, 12, cfg, mesh=mesh, num_shared_experts=1,
                                    backend="xla", name="moe")(h)
            return h + y, stats

    model = Block()
    x = jax.random.normal(jax.random.key(0), (4, 8, 16))
    with jax.set_mesh(mesh):
        # MaxText's recipe: the logical specs of an abstract init, mapped by the rules.
        abstract = jax.eval_shape(model.init, jax.random.key(1), x)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh,
                                                default_sharding_rules("ep"))
        variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(1), x)
        y, stats = jax.jit(model.apply)(variables, x)
        grads = jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(model.apply(v, x)[0]))))(
            variables)
    boxes = variables["params"]["moe"]
    assert isinstance(boxes["w_gate"], nn.LogicallyPartitioned)
    specs = nn.get_partition_spec(variables)["params"]["moe"]
    assert specs["w_gate"] == P("expert", "embed", "mlp")
    assert nn.logical_to_mesh(specs, boxes["w_gate"].rules)["w_gate"] == P("ep", None, None)
    assert boxes["w_down"].value.sharding.spec == P("ep", None, None)

    p = {name: np.asarray(boxes[name].value) for name in ("router", "w_gate", "w_up",
                                                           "w_down")}
    p["shared"] = [np.asarray(boxes["shared"][i].value) for i in range(3)]
    p["expert_bias"] = np.asarray(variables["ExpertBias"]["moe"]["expert_bias"])
    proj = jax.device_get(variables["params"]["proj"])
    h = np.asarray(x @ proj["kernel"] + proj["bias"])
    np.testing.assert_allclose(y, h + dense_moe(p, h, cfg), rtol=2e-5, atol=2e-5)
    want = jax.grad(lambda p: jnp.sum(jnp.sin(h + dense_moe(p, h, cfg))))(p)
    for name in ("router", "w_gate", "w_down"):
        np.testing.assert_allclose(grads["params"]["moe"][name].value, want[name],
                                   rtol=1e-4, atol=1e-5, err_msg=name)

    layer = ep_linen.MoE(16, 12, cfg, mesh=mesh, backend="xla", bias_rate=0.1)
    with jax.set_mesh(mesh):
        state = layer.init(jax.random.key(2), h)
        _, stats = layer.apply(state, h)
        _, updated = layer.apply(state, stats.load, nnx_method="update_bias",
                                 mutable=["ExpertBias"])
    np.testing.assert_allclose(updated["ExpertBias"]["expert_bias"],
                               router.updated_bias(jnp.zeros(8), stats.load, 0.1))
    with pytest.raises(TypeError, match="pass no rngs"):
        ep_linen.MoE(16, 12, cfg, mesh=mesh, rngs=nnx.Rngs(0))


def test_deepseek_v3_configuration():
    """jax_ep.nn.configs.deepseek_v3: DeepSeek-V3's routing at scaled-down widths, its layer
    equal to the dense layer over 8 EP ranks (32 experts each), every token on 8 experts of
    at most 4 groups."""
    from jax_ep.nn import configs

    cfg = configs.deepseek_v3()
    r = cfg.router
    assert (r.num_experts, r.top_k, r.num_groups, r.top_groups) == (256, 8, 8, 4)
    assert (r.score, r.routed_scaling, cfg.num_shared_experts) == ("sigmoid", 2.5, 1)
    assert configs.deepseek_v3(hidden=7168, ffn_hidden=2048).hidden == 7168
    mesh = jax.make_mesh((1, 8), ("data", "ep"))
    model = cfg.layer(mesh=mesh, rngs=nnx.Rngs(1), backend="xla")
    x = np.asarray(jax.random.normal(jax.random.key(7), (48, cfg.hidden)))
    p = plain_params(model)
    with jax.set_mesh(mesh):
        y, stats = nnx.jit(lambda m, x: m(x))(model, x)
    np.testing.assert_allclose(y, dense_moe(p, x, r), rtol=2e-5, atol=2e-5)
    assert float(stats.load.sum()) == 48 * 8
    idx = np.asarray(router.select(x @ p["router"], r, p["expert_bias"])[0])
    assert max(len(set(row // 32)) for row in idx) <= 4  # groups of 32 experts


def test_float32_partials_reach_the_combine(monkeypatch):
    """MoE(partial_dtype=jnp.float32) hands it to jax_ep.combine (whose rule
    tests/test_dispatch.py checks bit for bit); in bfloat16 the layer stays the dense one's
    within bfloat16's rounding."""
    import jax_ep

    seen = []
    combine = jax_ep.combine

    def spy(*args, **kwargs):
        seen.append(kwargs.get("partial_dtype"))
        return combine(*args, **kwargs)

    monkeypatch.setattr(jax_ep, "combine", spy)
    mesh = jax.make_mesh((1, 4), ("data", "ep"), devices=jax.devices()[:4])
    cfg = RouterConfig(num_experts=8, top_k=2)
    x = jnp.asarray(np.random.default_rng().standard_normal((8, 16)), jnp.float32)
    with jax.set_mesh(mesh):
        model = MoE(16, 12, cfg, mesh=mesh, num_shared_experts=1, backend="xla",
                    dtype=jnp.bfloat16, partial_dtype=jnp.float32, rngs=nnx.Rngs(0))
        y, _ = model(x)
    assert seen == [jnp.float32] and y.dtype == jnp.bfloat16
    p = jax.tree.map(lambda a: np.asarray(a, np.float32) if hasattr(a, "dtype") else a,
                     plain_params(model))
    want = dense_moe(p, np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), cfg)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=5e-2, atol=5e-2)


def test_wire_format_forward_and_gradients():
    """MoE(wire_format=f), f drawn: the routed experts see the tokens rounded to f (the
    dense reference on the rounded tokens matches), gradients stay near the layer's without
    it (as with grad_wire_format=f, whose forward pass is the plain layer's), 'e4m3' is
    fp8_dispatch's rounding (which warns that it is deprecated), and a hidden size that is
    no multiple of the format's block is refused naming it."""
    from jax_ep import quant

    fmt = quant.FORMATS[int(np.random.default_rng().integers(len(quant.FORMATS)))]
    mesh = jax.make_mesh((1, 4), ("data", "ep"), devices=jax.devices()[:4])
    cfg = RouterConfig(num_experts=8, top_k=2)
    layers = [MoE(128, 32, cfg, mesh=mesh, num_shared_experts=1, backend="xla",
                  rngs=nnx.Rngs(0), **kw)
              for kw in ({"wire_format": fmt}, {}, {"wire_format": "e4m3"})]
    with pytest.warns(DeprecationWarning, match="pass wire_format='e4m3'"):
        layers.append(MoE(128, 32, cfg, mesh=mesh, num_shared_experts=1, backend="xla",
                          rngs=nnx.Rngs(0), fp8_dispatch=True))
    layers.append(MoE(128, 32, cfg, mesh=mesh, num_shared_experts=1, backend="xla",
                      rngs=nnx.Rngs(0), grad_wire_format=fmt))
    x = np.asarray(jax.random.normal(jax.random.key(7), (32, 128)))
    rounded = np.asarray(quant.dequantize(quant.quantize(jnp.asarray(x), fmt)))
    want = dense_moe(plain_params(layers[0]), x, cfg, expert_x=rounded)
    with jax.set_mesh(mesh):
        outs = [nnx.jit(lambda m, x: m(x)[0])(layer, x) for layer in layers]
        grads = [nnx.jit(nnx.grad(lambda m, x: jnp.sum(jnp.sin(m(x)[0])), argnums=1))(
            layer, x) for layer in (layers[0], layers[1], layers[4])]
    np.testing.assert_allclose(outs[0], want, rtol=2e-5, atol=2e-5, err_msg=fmt)
    for g in (grads[0], grads[2]):  # tokens on the wire; their gradients on it
        error = np.linalg.norm(g - grads[1]) / np.linalg.norm(grads[1])
        assert 0 < error < 0.2, (fmt, error)
    np.testing.assert_array_equal(outs[4], outs[1])  # the forward pass is the plain one
    np.testing.assert_array_equal(outs[3], outs[2])
    with pytest.raises(ValueError, match="pass wire_format or fp8_dispatch, not both"):
        MoE(128, 32, cfg, mesh=mesh, wire_format="e4m3", fp8_dispatch=True, rngs=nnx.Rngs(0))
    block = quant.BLOCKS[fmt]
    with pytest.raises(ValueError, match=rf"^MoE: wire_format '{fmt}' quantizes blocks of "
                       rf"{block} channels: the hidden size \({block + 8}\) must be a "
                       rf"multiple of {block}\."):
        MoE(block + 8, 12, cfg, mesh=mesh, wire_format=fmt, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="wire_format"):
        MoE(128, 12, cfg, mesh=mesh, wire_format="fp8", rngs=nnx.Rngs(0))
