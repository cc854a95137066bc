"""Runs a per-shard jax_ep program on R of the 8 host devices with stacked inputs.

Inputs and outputs are stacked on a leading rank axis ([R, ...]), the layout of
`jax_ep.reference`, so results compare directly with it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


@functools.cache
def mesh(num_ranks: int, axis_name: str = "ep", explicit: bool = True) -> Mesh:
    """A 1-D mesh of the first `num_ranks` devices. An Auto (not explicit) mesh lets
    shard_map reshard its inputs implicitly, for functions called under other transforms."""
    devices = np.array(jax.devices()[:num_ranks])
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(devices, (axis_name,), axis_types=(axis_type,))


def sharded(fn, num_ranks: int, axis_name: str = "ep", jit: bool = True):
    """`fn(*per_shard_args)` as a function of rank-stacked arrays ([R, ...] -> [R, ...])."""
    m = mesh(num_ranks, axis_name)

    def per_shard(*args):
        out = fn(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda a: jnp.asarray(a)[None], out)

    mapped = jax.shard_map(per_shard, mesh=m, in_specs=P(axis_name), out_specs=P(axis_name))
    if jit:
        mapped = jax.jit(mapped)

    def run(*args):
        put = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(m, P(axis_name))), args)
        with jax.set_mesh(m):
            return mapped(*put)

    return run


def to_numpy(tree):
    return jax.tree.map(np.asarray, tree)
