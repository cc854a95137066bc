"""Runs a per-shard jax_ep program on R of the 8 host devices with stacked inputs.

Inputs and outputs are stacked on a leading rank axis ([R, ...]), the layout of
`jax_ep.tools.reference`, so results compare directly with it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets

import jax
import numpy as np

import jax_ep
from jax_ep.tools.bench import suite


@functools.cache
def mesh(num_ranks: int, explicit: bool = True):
    return suite.make_mesh(num_ranks, explicit)


def sharded(fn, num_ranks: int, jit: bool = True):
    """`fn(*per_shard_args)` as a function of rank-stacked host arrays. With
    $JAX_EP_TEST_MESH (below) and R <= 4, on a mesh of two EP groups."""
    m = mesh(num_ranks)
    run = suite.stacked(fn, m, jit=jit)
    on_one_group = lambda *args: run(*suite.put(m, args))  # noqa: E731
    order = two_group_axes()
    if order is None or 2 * num_ranks > len(jax.devices()):
        return on_one_group
    return on_two_groups(fn, num_ranks, order, on_one_group, jit)


def two_group_axes() -> tuple[str, str] | None:
    """$JAX_EP_TEST_MESH: "data,ep" or "ep,data" runs every `sharded` program on a mesh of
    those axes (data 2), each data coordinate its own EP group; unset: a 1-D "ep" mesh."""
    text = os.environ.get("JAX_EP_TEST_MESH", "").strip()
    if not text:
        return None
    axes = tuple(a.strip() for a in text.split(","))
    if sorted(axes) != ["data", "ep"]:
        raise ValueError(f"$JAX_EP_TEST_MESH={text!r}: expected 'data,ep' or 'ep,data'")
    return axes


def on_two_groups(fn, num_ranks: int, axes: tuple[str, str], on_one_group, jit: bool):
    """`fn` on a (data 2) x (ep R) mesh in `axes` order: the first EP group gets the test's
    inputs and its results are returned; the second gets them with every float negated, and
    its results must equal, bit for bit, the same program run on that input alone. So every
    test of the contract also checks that the groups of a mesh exchange only within
    themselves."""
    data_first = axes[0] == "data"
    shape = (2, num_ranks) if data_first else (num_ranks, 2)
    devices = np.array(jax.devices()[:2 * num_ranks]).reshape(shape)
    m = jax.sharding.Mesh(devices, axes, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    spec = jax.sharding.PartitionSpec(*axes)

    def per_shard(*args):
        out = fn(*jax.tree.map(lambda a: a[0, 0], args))
        return jax.tree.map(lambda a: jax.numpy.asarray(a)[None, None], out)

    program = jax.shard_map(per_shard, mesh=m, in_specs=spec, out_specs=spec)
    program = jax.jit(program) if jit else program
    group = 0 if data_first else 1  # the data axis in the stacked arrays

    def run(*args):
        args = jax.tree.map(np.asarray, args)
        negated = jax.tree.map(_negated, args)
        both = jax.tree.map(lambda a, b: np.stack([a, b], axis=group), args, negated)
        sharding = jax.sharding.NamedSharding(m, spec)
        with jax.set_mesh(m):
            out = to_numpy(program(*jax.tree.map(lambda a: jax.device_put(a, sharding), both)))
        first, second = (jax.tree.map(lambda a, i=i: np.take(a, i, axis=group), out)
                         for i in (0, 1))
        alone = to_numpy(on_one_group(*negated))
        for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(second)[0],
                                     jax.tree.leaves(alone), strict=True):
            size = got.dtype.itemsize
            view = f"u{size}" if size > 1 else np.uint8
            assert np.array_equal(got.view(view), want.view(view)), (
                f"the second EP group of the {axes} mesh{jax.tree_util.keystr(path)} differs "
                f"from the same program on its group alone")
        return first

    return run


def _negated(a: np.ndarray) -> np.ndarray:
    return -a if np.issubdtype(a.dtype, np.floating) or a.dtype.kind == "V" else a


def to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def checked(fn, num_ranks: int):
    """Like `sharded`, through `jax_ep.checked`: jax_ep's value checks raise ValueError."""
    m = mesh(num_ranks)
    run = jax_ep.checked(suite.stacked_shard_map(fn, m))
    return lambda *args: run(*suite.put(m, args))


def compiled_text(fn, num_ranks: int, *args) -> str:
    """The optimized HLO of `sharded(fn, num_ranks)` for these arguments."""
    m = mesh(num_ranks)
    with jax.set_mesh(m):
        program = jax.jit(suite.stacked_shard_map(fn, m))
        return program.lower(*suite.put(m, args)).compile().as_text()


def forget_failed_exchange():
    """After a test made an exchange fail on purpose: exchanges are side-effecting, so JAX
    keeps the failed run as its devices' last effect and would raise its error again at
    exit. Drop that record."""
    from jax._src import dispatch

    dispatch.runtime_tokens.clear()


@contextlib.contextmanager
def seeded_default_rng(seed: int):
    """`np.random.default_rng()` without a seed draws from `seed` while this is active (each
    call gets its own child stream), so a run with the same seed sees the same inputs."""
    original = np.random.default_rng
    sequence = np.random.SeedSequence(seed)

    def default_rng(seed=None):
        return original(sequence.spawn(1)[0] if seed is None else seed)

    np.random.default_rng = default_rng
    try:
        yield
    finally:
        np.random.default_rng = original


def test_seed() -> int:
    """JAX_EP_TEST_SEED when set, else a fresh seed."""
    value = os.environ.get("JAX_EP_TEST_SEED")
    return int(value) if value else secrets.randbits(32)
