"""Runs a per-shard jax_ep program on R of the 8 host devices with stacked inputs.

Inputs and outputs are stacked on a leading rank axis ([R, ...]), the layout of
`jax_ep.reference`, so results compare directly with it.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

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
