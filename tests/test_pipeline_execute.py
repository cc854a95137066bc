"""jax_ep.pipeline.execute: schedules run with shard_map/ppermute equal the sequential model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ep.pipeline import make_schedule
from jax_ep.pipeline.execute import (
    default_overlapped,
    pipeline_step,
    place_stages,
    stage_grads,
    tick_table,
)

WIDTH, ROWS = 12, 5  # activation [ROWS, WIDTH] per micro-batch; neither a power of two


def stage(p, x):
    return jnp.tanh(x @ p["w"] + p["b"]) + 0.5 * x


def loss(y, target):
    return jnp.mean((y - target) ** 2)


def case(schedule, seed):
    rng = np.random.default_rng(seed)
    S, M = schedule.num_stages, schedule.num_micro_batches
    params = {"w": rng.normal(size=(S, WIDTH, WIDTH)).astype(np.float32) / 3,
              "b": rng.normal(size=(S, WIDTH)).astype(np.float32) / 3}
    x = rng.normal(size=(M, ROWS, WIDTH)).astype(np.float32)
    t = rng.normal(size=(M, ROWS, WIDTH)).astype(np.float32)
    return params, x, t


@jax.jit
def sequential_losses(params, x, t):
    """The reference: every micro-batch through every stage in order, one program."""
    def one(xm, tm):
        h = xm
        for s in range(params["w"].shape[0]):
            h = stage({"w": params["w"][s], "b": params["b"][s]}, h)
        return loss(h, tm)

    return jnp.stack([one(x[m], t[m]) for m in range(x.shape[0])])


def run(schedule, params, x, t, overlapped=None):
    R = schedule.num_ranks
    mesh = jax.make_mesh((R,), ("pp",), devices=jax.devices()[:R])
    step = pipeline_step(stage, loss, schedule, overlapped=overlapped)
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P()),
                               out_specs=(P(), P("pp"))))
    placed = jax.device_put(place_stages(schedule, params), NamedSharding(mesh, P("pp")))
    replicated = NamedSharding(mesh, P())
    losses, grads = fn(placed, jax.device_put(x, replicated), jax.device_put(t, replicated))
    return np.asarray(losses), stage_grads(schedule, jax.device_get(grads))


# Every schedule at 2 and 4 stages; at 8 (its compiles the longest) one drawn from the test's
# seed (each over runs).
MATRIX = [(name, pp, m) for pp, m in ((2, 4), (4, 8))
          for name in ("1f1b", "zb1p", "dualpipe", "dualpipev")] + [(None, 8, 16)]


@pytest.mark.parametrize("name,pp,micro_batches", MATRIX)
def test_schedule_matches_sequential_model(name, pp, micro_batches):
    name = name or str(np.random.default_rng().choice(["1f1b", "dualpipe", "dualpipev"]))
    schedule = make_schedule(name, pp, micro_batches)
    params, x, t = case(schedule, seed=pp * 10 + micro_batches)
    losses, grads = run(schedule, params, x, t)
    want = sequential_losses(params, x, t)
    np.testing.assert_array_equal(losses, np.asarray(want))  # same arithmetic, same bits
    want_grads = jax.grad(lambda p: jnp.mean(sequential_losses(p, x, t)))(params)
    for key in ("w", "b"):
        np.testing.assert_allclose(grads[key], want_grads[key], rtol=1e-5, atol=1e-7,
                                   err_msg=key)


def test_overlapped_hook_runs_every_fb_and_may_reorder():
    """A hook that computes the backward half first (as an interleaving would) gives the
    same results; it is traced for the FB ops of DualPipe."""
    schedule = make_schedule("dualpipe", 4, 8)
    assert any(op.kind == "FB" for ops in schedule.ops for op in ops)
    calls = []

    def backward_first(params_f, x_f, params_b, x_b, dy_b):
        calls.append(1)
        _, vjp = jax.vjp(stage, params_b, x_b)
        d_params, d_x = vjp(dy_b)
        y_f = stage(params_f, jax.lax.optimization_barrier((x_f, d_x))[0])
        return y_f, d_x, d_params

    params, x, t = case(schedule, seed=3)
    losses, grads = run(schedule, params, x, t, overlapped=backward_first)
    base_losses, base_grads = run(schedule, params, x, t, overlapped=default_overlapped(stage))
    assert calls  # traced (once: the tick body is a scan)
    np.testing.assert_array_equal(losses, base_losses)
    for key in ("w", "b"):
        np.testing.assert_allclose(grads[key], base_grads[key], rtol=1e-6, atol=1e-8)


def test_tick_table_respects_dependencies():
    schedule = make_schedule("dualpipev", 3, 6)
    table = tick_table(schedule)
    assert (table.code != 0).sum() == sum(len(schedule.compute_ops(r)) for r in range(3))
    # Fewer ticks than running every op one after the other on one rank.
    assert table.num_ticks < 3 * max(len(schedule.compute_ops(r)) for r in range(3))


def test_wrong_sizes_are_refused():
    schedule = make_schedule("1f1b", 2, 4)
    params, x, t = case(schedule, seed=0)
    with pytest.raises(ValueError, match="inputs hold 3 micro-batches; 1f1b was built for 4"):
        run(schedule, params, x[:3], t[:3])
    mesh = jax.make_mesh((4,), ("pp",), devices=jax.devices()[:4])
    step = pipeline_step(stage, loss, schedule)
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("pp"), P(), P()),
                               out_specs=(P(), P("pp"))))
    wrong = jax.device_put(jax.tree.map(lambda a: np.zeros((4, 1) + a.shape[1:], a.dtype),
                                        params), NamedSharding(mesh, P("pp")))
    with pytest.raises(ValueError, match="axis has 4 ranks; 1f1b was built for 2"):
        fn(wrong, x, t)
