"""EP as any mesh axis: backend="cuda" inside shard_map over meshes with other axes, each
coordinate of the other axes its own EP group (cuda/ep_group.h, jax_ep/_ep_groups.py).

Every group gets its own inputs, and each must exchange only within itself: the results equal
the portable backend's bit for bit, 20 runs each, on meshes with the EP axis first, in the
middle and last, over stores, puts and nodes. The contract's tests also run on two groups through
$JAX_EP_TEST_MESH (tests/harness.py).
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import sharded, to_numpy
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from test_exchange_order import other_access  # noqa: F401 (a fixture)
from test_host_peers import host_peers  # noqa: F401 (a fixture)
from test_virtual import assert_bitwise

import jax_ep
from jax_ep import _ffi

pytestmark = pytest.mark.skipif(_ffi.EXT is None, reason="compiled extension missing")
RUNS = 20  # every program's exchanges, again and again: bit for bit each time

MESHES = {  # axes and sizes; the EP axis is "ep"
    "data x ep": (("data", "ep"), (2, 4)),
    "ep x data": (("ep", "data"), (4, 2)),
    "ep in the middle": (("data", "ep", "fsdp"), (2, 2, 2)),
    "ep last of three": (("data", "fsdp", "ep"), (2, 2, 2)),
    "ep first of three": (("ep", "data", "fsdp"), (3, 2, 1)),
}


def make_mesh(axes, sizes):
    devices = np.array(jax.devices()[:int(np.prod(sizes))]).reshape(sizes)
    return Mesh(devices, axes, axis_types=(AxisType.Explicit,) * len(axes))


def on_mesh(mesh, per_device):
    """`per_device(*per_device_args)` on every device of `mesh`, compiled once; args and
    results are stacked [*mesh.devices.shape, ...]."""
    axes = mesh.axis_names
    lead = (None,) * len(axes)

    def body(*args):
        out = per_device(*jax.tree.map(lambda a: a[(0,) * len(axes)], args))
        return jax.tree.map(lambda a: jnp.asarray(a)[lead], out)

    spec = PartitionSpec(*axes)
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))

    def run(*args):
        with jax.set_mesh(mesh):
            return to_numpy(program(*(jax.device_put(a, NamedSharding(mesh, spec))
                                      for a in args)))

    return run


def assert_trees_bitwise(got, want, what=""):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        assert_bitwise(g, w, what + jax.tree_util.keystr(path))


def exchanges(backend, E, cap):
    """A dispatch (expert-major, capacity cuts), a weighted combine, the gradients of the
    dispatch, and a low-latency round trip."""
    kw = dict(num_experts=E, expert_major=True, capacity=cap, on_overflow="drop",
              on_invalid="mask", backend=backend)

    def per_device(x, idx, w, g):
        recv, handle = jax_ep.dispatch(x, idx, w, **kw)
        out = jax_ep.combine(recv.with_zero_padding().x, handle,
                             topk_weights=recv.topk_weights, backend=backend)

        def loss(x, w):
            r, _ = jax_ep.dispatch(x, idx, w, **kw)
            return jnp.sum(r.with_zero_padding().x * g[:1]) + jnp.sum(r.topk_weights)

        dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
        ll, ll_handle = jax_ep.low_latency_dispatch(x.astype(jnp.bfloat16), idx, num_experts=E,
                                                    on_invalid="mask", backend=backend)
        ll_out = jax_ep.low_latency_combine(ll.x, idx, jnp.where(idx >= 0, w, 0), ll_handle,
                                            backend=backend)
        return dict(x=recv.with_zero_padding().x, n=recv.num_tokens, out=out, dx=dx, dw=dw,
                    ll=ll_out)

    return per_device


def inputs(rng, shape, T, K, E, H):
    """Different routing and rows on every device: masked choices, a hot expert (the last),
    T not a power of two."""
    idx = rng.integers(-1, E, size=(*shape, T, K)).astype(np.int32)
    idx[..., 0, :] = E - 1  # a hot expert
    return (rng.standard_normal((*shape, T, H)).astype(np.float32), idx,
            rng.standard_normal((*shape, T, K)).astype(np.float32),
            rng.standard_normal((*shape, T, H)).astype(np.float32))


def assert_groups_match_portable_backend(axes, sizes):
    mesh = make_mesh(axes, sizes)
    R = dict(zip(axes, sizes, strict=True))["ep"]
    T, K, E, H = 13, 3, 4 * R, 128
    args = inputs(np.random.default_rng(), sizes, T, K, E, H)
    cap = R * T  # cuts some entries of the expert-major layout
    want = on_mesh(mesh, exchanges("xla", E, cap))(*args)
    run = on_mesh(mesh, exchanges("cuda", E, cap))
    for i in range(RUNS):
        assert_trees_bitwise(run(*args), want, f"run {i}")


@pytest.mark.parametrize("name", MESHES)
def test_each_group_exchanges_within_itself(name):
    assert_groups_match_portable_backend(*MESHES[name])


@pytest.mark.parametrize("name", ["data x ep", "ep in the middle"])
def test_groups_over_puts_and_nodes(other_access, name):  # noqa: F811 (the fixture)
    assert_groups_match_portable_backend(*MESHES[name])


def test_moe_layer_on_a_data_x_ep_mesh():
    """The README's MoE step on a (data 2, ep 4) mesh: the cuda backend gives the portable
    backend's output and statistics."""
    from flax import nnx

    from jax_ep.nn import MoE, RouterConfig

    mesh = make_mesh(("data", "ep"), (2, 4))
    router = RouterConfig(num_experts=16, top_k=2, score="sigmoid", num_groups=4, top_groups=2)
    x = jax.random.normal(jax.random.key(3), (8, 24, 256))
    step = nnx.jit(lambda m, x: m(x))
    results = {}
    with jax.set_mesh(mesh):
        for backend in ("xla", "cuda"):
            moe = MoE(256, 512, router, mesh=mesh, num_shared_experts=1, backend=backend,
                      rngs=nnx.Rngs(0))
            results[backend] = [to_numpy(step(moe, x)) for _ in range(RUNS)]
    for i, got in enumerate(results["cuda"]):
        assert_trees_bitwise(got, results["xla"][0], f"run {i}")


def test_a_mesh_of_several_groups_needs_its_concrete_mesh():
    """Inside shard_map only the abstract mesh is known; the groups' devices come from the
    mesh of jax.set_mesh, and without it the op says so before anything runs."""
    mesh = make_mesh(("data", "ep"), (2, 4))
    spec = PartitionSpec("data", "ep")

    def body(x, idx, w):
        recv, _ = jax_ep.dispatch(x[0, 0], idx[0, 0], w[0, 0], num_experts=8, backend="cuda")
        return recv.num_tokens[None, None]

    x, idx, w, _ = inputs(np.random.default_rng(), (2, 4), 5, 2, 8, 128)
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, idx, w)]
    with pytest.raises(ValueError, match=r"axes \{'data': 2\} beside the EP axis 'ep'.*"
                                         r"jax.set_mesh\(mesh\)"):
        program(*placed)


def test_two_programs_on_other_devices_at_once():
    """Two 1-D programs of the same R on disjoint devices, dispatched from two threads at once:
    their groups are keyed by their devices, so they never share buffers or flags."""
    R, T, K, E, H = 4, 9, 2, 8, 128
    rng = np.random.default_rng()
    meshes = [make_mesh(("ep",), (R,)), Mesh(np.array(jax.devices()[R:2 * R]), ("ep",),
                                             axis_types=(AxisType.Explicit,))]
    args = [inputs(rng, (R,), T, K, E, H) for _ in meshes]
    want = [on_mesh(m, exchanges("xla", E, R * T))(*a) for m, a in zip(meshes, args,
                                                                        strict=True)]
    programs = [on_mesh(m, exchanges("cuda", E, R * T)) for m in meshes]
    got = [None, None]

    def run(i):
        got[i] = [programs[i](*args[i]) for _ in range(RUNS)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        for run_out in got[i]:
            assert_trees_bitwise(run_out, want[i], f"program {i}")


def test_the_harness_runs_the_contract_on_two_groups(monkeypatch):
    """$JAX_EP_TEST_MESH runs `sharded` programs on two EP groups (tests/harness.py); a
    dispatch there gives the one-group results."""
    R, T, K, E, H = 4, 6, 2, 8, 128
    x, idx, w, _ = inputs(np.random.default_rng(), (R,), T, K, E, H)

    def per_shard(x, idx, w):
        recv, _ = jax_ep.dispatch(x, idx, w, num_experts=E, on_invalid="mask", backend="cuda")
        return recv.with_zero_padding().x

    alone = to_numpy(sharded(per_shard, R)(x, idx, w))
    monkeypatch.setenv("JAX_EP_TEST_MESH", "ep,data")
    assert_bitwise(to_numpy(sharded(per_shard, R)(x, idx, w)), alone, "first group")
