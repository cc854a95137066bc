"""The benchmark's cases: inputs, one jitted shard_map program per (op, backend), bytes moved.

Every program takes rank-stacked inputs ([R, ...], rank d's shard is `a[d]`) and runs the op
per shard over the mesh axis "ep", with `on_overflow="drop", on_invalid="mask"`: the default
checks add a host callback to every call, which is not what a tuned training step pays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import jax_ep
from jax_ep.bench.routings import make_routing

AXIS = "ep"
OPS = (
    "layout",
    "dispatch",
    "combine",
    "dispatch+combine",
    "dispatch_fp8",
    "ll_dispatch",
    "ll_dispatch_fp8",
    "ll_combine",
    "ll_round_trip",
)
FP8_OPS = ("dispatch_fp8", "ll_dispatch_fp8")
UNCHECKED = {"on_overflow": "drop", "on_invalid": "mask"}


@dataclasses.dataclass(frozen=True)
class Setup:
    ranks: int
    tokens: int
    ll_tokens: int
    hidden: int
    top_k: int
    experts: int
    routing: str
    dtype: str
    seed: int


@dataclasses.dataclass
class Case:
    """One timed program: `fn(*args)`, and the bytes it moves per rank."""

    op: str
    backend: str
    fn: Callable[..., Any]
    args: tuple
    bytes_per_rank: float


def make_mesh(num_ranks: int, explicit: bool = True) -> Mesh:
    """A 1-D "ep" mesh of the first `num_ranks` devices. An Auto (not explicit) mesh lets
    shard_map reshard its inputs implicitly, for functions called under other transforms."""
    devices = np.array(jax.devices()[:num_ranks])
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(devices, (AXIS,), axis_types=(axis_type,))


def stacked(fn: Callable[..., Any], mesh: Mesh, jit: bool = True) -> Callable[..., Any]:
    """`fn` (per shard) as a function of rank-stacked arrays: [R, ...] -> [R, ...]."""

    def per_shard(*args):
        out = fn(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda a: jnp.asarray(a)[None], out)

    mapped = jax.shard_map(per_shard, mesh=mesh, in_specs=PartitionSpec(AXIS),
                           out_specs=PartitionSpec(AXIS))
    if jit:
        mapped = jax.jit(mapped)

    def run(*args):
        with jax.set_mesh(mesh):
            return mapped(*args)

    return run


def put(mesh: Mesh, tree: Any) -> Any:
    """Places rank-stacked arrays with rank d's block on device d."""
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, PartitionSpec(AXIS))),
                        tree)


def _unique_choices(idx: np.ndarray, num_experts: int) -> int:
    """Valid (token, expert) pairs, a token's repeated expert counted once."""
    return sum(len({int(e) for e in row if 0 <= e < num_experts}) for row in idx.reshape(
        -1, idx.shape[-1]))


def _rows_received(idx: np.ndarray, num_experts: int, num_ranks: int) -> int:
    """Rows all ranks receive in normal dispatch: (token, destination rank) pairs."""
    per_rank = num_experts // num_ranks
    valid = (idx >= 0) & (idx < num_experts)
    dest = np.where(valid, idx // per_rank, -1)
    return int(sum((dest == d).any(-1).sum() for d in range(num_ranks)))


def build_cases(setup: Setup, mesh: Mesh, ops: list[str], backend: str) -> list[Case | str]:
    """Cases of `ops` for `backend`; an op the backend cannot run becomes its reason (str)."""
    rng = np.random.default_rng(setup.seed)
    r, e, k, h = setup.ranks, setup.experts, setup.top_k, setup.hidden
    dtype = ml_dtypes.bfloat16 if setup.dtype == "bfloat16" else np.dtype(setup.dtype)
    item = np.dtype(dtype).itemsize
    idx, w = make_routing(rng, num_ranks=r, num_tokens=setup.tokens, top_k=k, num_experts=e,
                          kind=setup.routing)
    x = rng.standard_normal((r, setup.tokens, h)).astype(dtype)
    ll_idx, ll_w = make_routing(rng, num_ranks=r, num_tokens=setup.ll_tokens, top_k=k,
                                num_experts=e, kind=setup.routing)
    ll_x = rng.standard_normal((r, setup.ll_tokens, h)).astype(ml_dtypes.bfloat16)
    rows = _rows_received(idx, e, r) / r
    messages = _unique_choices(ll_idx, e) / r
    fp8_row = h + h // 128 * 4
    kw = {"num_experts": e, "backend": backend}
    dev = put(mesh, {"x": x, "idx": idx, "w": w, "ll_x": ll_x, "ll_idx": ll_idx, "ll_w": ll_w})

    def dispatch(x, idx, w):
        return jax_ep.dispatch(x, idx, w, **kw, **UNCHECKED)

    def ll_dispatch(x, idx, use_fp8=False):
        return jax_ep.low_latency_dispatch(x, idx, use_fp8=use_fp8, on_invalid="mask", **kw)

    cases: list[Case | str] = []
    for op in ops:
        try:
            if op == "layout":
                fn = stacked(lambda i: jax_ep.get_dispatch_layout(i, **kw), mesh)
                args = (dev["idx"],)
                nbytes = setup.tokens * (k * 4 + r) + (r + e + 1) * 4
            elif op == "dispatch":
                fn = stacked(lambda x, i, w: dispatch(x, i, w)[0], mesh)
                args, nbytes = (dev["x"], dev["idx"], dev["w"]), rows * h * item
            elif op == "dispatch_fp8":
                q, s = jax.jit(jax_ep.fp8.quantize)(jnp.asarray(x.astype(np.float32)))
                fn = stacked(lambda q, s, i, w: dispatch((q, s), i, w)[0], mesh)
                args = (*put(mesh, (np.asarray(q), np.asarray(s))), dev["idx"], dev["w"])
                nbytes = rows * fp8_row
            elif op == "combine":
                recv, handle = stacked(dispatch, mesh)(dev["x"], dev["idx"], dev["w"])
                fn = stacked(lambda y, hd: jax_ep.combine(y, hd, backend=backend), mesh)
                args, nbytes = (recv.x, handle), rows * h * item
            elif op == "dispatch+combine":

                def round_trip(x, i, w):
                    recv, handle = dispatch(x, i, w)
                    return jax_ep.combine(recv.x, handle, backend=backend)

                fn = stacked(round_trip, mesh)
                args, nbytes = (dev["x"], dev["idx"], dev["w"]), 2 * rows * h * item
            elif op in ("ll_dispatch", "ll_dispatch_fp8"):
                use_fp8 = op == "ll_dispatch_fp8"
                fn = stacked(lambda x, i, fp8=use_fp8: ll_dispatch(x, i, fp8)[0], mesh)
                args = (dev["ll_x"], dev["ll_idx"])
                nbytes = messages * (fp8_row if use_fp8 else 2 * h)
            elif op == "ll_combine":
                recv, handle = stacked(ll_dispatch, mesh)(dev["ll_x"], dev["ll_idx"])
                fn = stacked(lambda y, i, w, hd: jax_ep.low_latency_combine(
                    y, i, w, hd, backend=backend), mesh)
                args = (recv.x, dev["ll_idx"], dev["ll_w"], handle)
                nbytes = messages * 2 * h
            elif op == "ll_round_trip":

                def ll_round_trip(x, i, w):
                    recv, handle = ll_dispatch(x, i)
                    return jax_ep.low_latency_combine(recv.x, i, w, handle, backend=backend)

                fn = stacked(ll_round_trip, mesh)
                args = (dev["ll_x"], dev["ll_idx"], dev["ll_w"])
                nbytes = 2 * messages * 2 * h
            else:
                raise ValueError(f"unknown op {op!r}; choose from {list(OPS)}")
            jax.block_until_ready(fn(*args))  # compiles, and proves the backend runs the op
            cases.append(Case(op, backend, fn, args, float(nbytes)))
        except (NotImplementedError, RuntimeError) as error:
            cases.append(f"{op}: {str(error).splitlines()[0]}")
    return cases
