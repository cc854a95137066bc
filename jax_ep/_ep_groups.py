"""The EP groups of a mesh: which devices exchange with which.

The EP axis may be one axis of a larger mesh (data x ep; data x fsdp x expert, as MaxText's
meshes are): every coordinate of the other axes holds one EP group, the devices along the EP
axis there, in EP-index order. An exchange between devices must meet its own group only, so
its custom call carries every group of its program, the attribute `ep_groups`: the JAX ids of
the devices, [G, R] row by row. Each handler finds its device's row (cuda/ep_group.h).

The groups come from the concrete mesh the program is traced under (`jax.set_mesh`), which
is part of jit's cache key: a program traced for one mesh never runs on another's devices
(and the handlers check their own place in the table). Inside `shard_map` only the abstract
mesh is known otherwise; a mesh whose other axes all have size 1 needs no table (one group,
the ranks in order).
"""

from __future__ import annotations

import jax
import numpy as np


def _concrete_mesh() -> jax.sharding.Mesh | None:
    """The mesh of `jax.set_mesh` (or the deprecated `with mesh:`), if any."""
    from jax._src import mesh as mesh_lib

    for mesh in (mesh_lib.get_concrete_mesh(), mesh_lib.thread_resources.env.physical_mesh):
        if mesh is not None and not mesh.empty:
            return mesh
    return None


def device_table(axis_name: str, op: str) -> tuple[int, ...]:
    """The EP groups of the mesh being traced along `axis_name`, as device ids row by row
    (group g's EP rank r at g*R + r); () when the EP axis is the mesh's only axis of size > 1
    and no concrete mesh is known. Raises ValueError for a mesh with other axes whose devices
    are not known."""
    abstract = jax.sharding.get_abstract_mesh()
    names = tuple(abstract.axis_names)
    sizes = dict(zip(names, abstract.axis_sizes, strict=True))
    mesh = _concrete_mesh()
    if mesh is not None and tuple(mesh.axis_names) == names and \
            mesh.devices.shape == tuple(abstract.axis_sizes):
        rows = np.moveaxis(mesh.devices, names.index(axis_name), -1)
        return tuple(int(d.id) for d in rows.reshape(-1, sizes[axis_name]).flat)
    others = {name: size for name, size in sizes.items() if name != axis_name and size > 1}
    if not others:
        return ()
    raise ValueError(
        f"{op}: backend='cuda' on a mesh with axes {others} beside the EP axis "
        f"{axis_name!r}: each coordinate of those axes is its own EP group, and which devices "
        f"form each group comes from the concrete mesh. Trace the program inside "
        f"jax.set_mesh(mesh).")
