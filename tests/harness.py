"""Runs a per-shard jax_ep program on R of the 8 host devices with stacked inputs.

Inputs and outputs are stacked on a leading rank axis ([R, ...]), the layout of
`jax_ep.reference`, so results compare directly with it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets

import jax
import numpy as np

import jax_ep
from jax_ep.bench import suite


@functools.cache
def mesh(num_ranks: int, explicit: bool = True):
    return suite.make_mesh(num_ranks, explicit)


def sharded(fn, num_ranks: int, jit: bool = True):
    """`fn(*per_shard_args)` as a function of rank-stacked host arrays."""
    m = mesh(num_ranks)
    run = suite.stacked(fn, m, jit=jit)
    return lambda *args: run(*suite.put(m, args))


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
