"""The benchmark's cases: inputs, one jitted shard_map program per (op, backend), bytes moved.

Every program takes rank-stacked inputs (`[R, ...]`, rank d's block `a[d]` placed on device d)
and runs one op per shard over the mesh axis "ep", with the default arguments (their value
checks compile to nothing; the default capacity never overflows, so nothing is dropped).

Bytes moved per rank follow DeepEP's convention, averaged over the ranks. They are counted from
the routing with NumPy, and the counts are checked against the op's own on the first call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import jax_ep
from jax_ep import runtime
from jax_ep.tools import account
from jax_ep.tools.bench import OPS, wire
from jax_ep.tools.bench.routings import KINDS, make_routing

AXIS = "ep"
BLOCK = 128  # channels per FP8 scale
SCALE_BYTES = 4  # one float32 scale per block


@dataclasses.dataclass(frozen=True)
class Setup:
    """Shapes and routing of one run (notation of docs/contract.md).

    Attributes:
      ranks: R, devices on the "ep" axis.
      tokens: T per rank, normal mode.
      ll_tokens: T per rank, low-latency mode.
      hidden: H, a multiple of 128.
      top_k: K.
      experts: E, a multiple of R.
      routing: a `routings.KINDS` name.
      dtype: payload dtype of normal mode (low-latency sends bfloat16 or FP8).
      seed: seed of the routing and the payload.
    """

    ranks: int
    tokens: int
    ll_tokens: int
    hidden: int
    top_k: int
    experts: int
    routing: str
    dtype: str
    seed: int

    def check(self) -> None:
        """Raises ValueError naming the first setting the ops would reject."""
        for name in ("ranks", "tokens", "ll_tokens", "hidden", "top_k", "experts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}.")
        if self.hidden % BLOCK:
            raise ValueError(f"hidden must be a multiple of {BLOCK}; got {self.hidden}.")
        if self.experts % self.ranks:
            raise ValueError(
                f"experts ({self.experts}) must be a multiple of ranks ({self.ranks})."
            )
        if self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be at most experts ({self.experts}).")
        if self.routing not in KINDS:
            raise ValueError(f"routing must be one of {list(KINDS)}; got {self.routing!r}.")


# ---------------------------------------------------------------------------------------------
# Mesh and rank-stacked programs (also used by the tests, through tests/harness.py)


def make_mesh(num_ranks: int, explicit: bool = True) -> Mesh:
    """A 1-D "ep" mesh of the first `num_ranks` devices.

    Args:
      num_ranks: R.
      explicit: an Explicit axis (the default); an Auto axis lets shard_map reshard its inputs
        implicitly, for functions called under other transforms.
    """
    devices = np.array(jax.devices()[:num_ranks])
    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(devices, (AXIS,), axis_types=(axis_type,))


def stacked_shard_map(fn: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """`fn` (per shard) as a shard_map over "ep" of rank-stacked arrays (to jit or lower under
    `jax.set_mesh(mesh)`)."""

    def per_shard(*args: Any) -> Any:
        out = fn(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda a: jnp.asarray(a)[None], out)

    return jax.shard_map(
        per_shard, mesh=mesh, in_specs=PartitionSpec(AXIS), out_specs=PartitionSpec(AXIS)
    )


def stacked(fn: Callable[..., Any], mesh: Mesh, jit: bool = True) -> Callable[..., Any]:
    """`fn` (per shard) as a function of rank-stacked arrays: `[R, ...] -> [R, ...]`.

    Args:
      fn: a per-shard function of arrays (pytrees allowed), run inside shard_map over "ep".
      mesh: the mesh from `make_mesh`.
      jit: compile the shard_map program (the benchmark always does).

    Returns:
      A function of the stacked arguments that runs under `jax.set_mesh(mesh)`.
    """

    mapped = stacked_shard_map(fn, mesh)
    if jit:
        mapped = jax.jit(mapped)

    def run(*args: Any) -> Any:
        with jax.set_mesh(mesh):
            return mapped(*args)

    return run


def put(mesh: Mesh, tree: Any) -> Any:
    """Places rank-stacked arrays with rank d's block on device d."""
    sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    return jax.tree.map(lambda a: jax.device_put(a, sharding), tree)


# ---------------------------------------------------------------------------------------------
# What the routing moves (NumPy, independent of the ops)


# ---------------------------------------------------------------------------------------------
# Inputs shared by every case


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The rank-stacked inputs on their devices, and what the routings move.

    Attributes:
      setup: the run's shapes.
      mesh: the "ep" mesh (None with virtual ranks).
      x: [R, T, H] normal-mode tokens in `setup.dtype`.
      idx: int32 [R, T, K]; `w` float32 [R, T, K].
      ll_x: bfloat16 [R, T_ll, H] low-latency tokens.
      ll_idx: int32 [R, T_ll, K]; `ll_w` float32 [R, T_ll, K].
      rows: rows received by all ranks together in normal dispatch.
      messages: low-latency messages sent by all ranks together.
    """

    setup: Setup
    mesh: Mesh | None
    x: jax.Array
    idx: jax.Array
    w: jax.Array
    ll_x: jax.Array
    ll_idx: jax.Array
    ll_w: jax.Array
    rows: int
    messages: int


def make_inputs(setup: Setup, mesh: Mesh | None) -> Inputs:
    """Draws the routings (`setup.routing`) and standard-normal tokens, and places them on
    `mesh` (sharded over "ep"), or whole on the default device when `mesh` is None."""
    rng = np.random.default_rng(setup.seed)
    r, k, e, h = setup.ranks, setup.top_k, setup.experts, setup.hidden

    def draw(num_tokens: int, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx, w = make_routing(
            rng, num_ranks=r, num_tokens=num_tokens, top_k=k, num_experts=e, kind=setup.routing
        )
        x = rng.standard_normal((r, num_tokens, h), dtype=np.float32).astype(jnp.dtype(dtype))
        return x, idx, w

    x, idx, w = draw(setup.tokens, setup.dtype)
    ll_x, ll_idx, ll_w = draw(setup.ll_tokens, "bfloat16")
    arrays = (x, idx, w, ll_x, ll_idx, ll_w)
    return Inputs(
        setup,
        mesh,
        *(put(mesh, arrays) if mesh is not None else jax.device_put(arrays)),
        rows=int(account.kept_rows(idx, e, capacity=idx.shape[0] * idx.shape[1]).sum()),
        messages=int(account.messages(ll_idx, e).sum()),
    )


# ---------------------------------------------------------------------------------------------
# The cases: one program per op


@dataclasses.dataclass(frozen=True)
class Case:
    """One timed program `fn(*args)` and the bytes it moves per rank.

    Attributes:
      fn: the jitted shard_map program over rank-stacked arguments.
      args: its arguments, on their devices.
      bytes_per_rank: DeepEP's count of the bytes moved, averaged over the ranks.
      check: called with the first call's outputs; raises RuntimeError when the op's own
        counts disagree with the routing's.
    """

    fn: Callable[..., Any]
    args: tuple
    bytes_per_rank: float
    check: Callable[[Any], None] | None = None


def _expect(what: str, got: Any, want: int) -> None:
    """Raises RuntimeError unless the op's count `got` (summed over ranks) is `want`."""
    if int(np.sum(got)) != want:
        raise RuntimeError(f"{what}: the op reports {int(np.sum(got))}, the routing gives {want}.")


def _check_received(op: str, inp: Inputs) -> Callable[[Any], None]:
    """Check of a normal dispatch's first outputs: every routed row received, none dropped."""

    def check(out: Any) -> None:
        _expect(f"{op} rows received", out[0].num_tokens, inp.rows)
        _expect(f"{op} rows dropped", out[0].num_dropped, 0)

    return check


def _rows_bytes(inp: Inputs, fp8: bool = False) -> float:
    """Normal mode: received rows per rank x bytes per row (FP8: + the row's scales)."""
    h = inp.setup.hidden
    row = h + h // BLOCK * SCALE_BYTES if fp8 else h * jnp.dtype(inp.setup.dtype).itemsize
    return inp.rows / inp.setup.ranks * row


def _messages_bytes(inp: Inputs, fp8: bool = False) -> float:
    """Low-latency: messages per rank x bytes per message (bf16, or FP8 with its scales)."""
    h = inp.setup.hidden
    message = h + h // BLOCK * SCALE_BYTES if fp8 else h * 2
    return inp.messages / inp.setup.ranks * message


def _dispatch_fn(inp: Inputs, backend: str) -> Callable[..., Any]:
    """Per shard: dispatch(x, topk_idx, topk_weights) -> (Received, DispatchHandle)."""

    def dispatch(x: Any, idx: jax.Array, w: jax.Array) -> Any:
        return jax_ep.dispatch(
            x,
            idx,
            w,
            num_experts=inp.setup.experts,
            axis_name=AXIS,
            backend=backend,
        )

    return dispatch


def _ll_dispatch_fn(inp: Inputs, backend: str, use_fp8: bool) -> Callable[..., Any]:
    """Per shard: low_latency_dispatch(x, topk_idx) -> (LowLatencyReceived, LowLatencyHandle)."""

    def ll_dispatch(x: jax.Array, idx: jax.Array) -> Any:
        return jax_ep.low_latency_dispatch(
            x,
            idx,
            num_experts=inp.setup.experts,
            axis_name=AXIS,
            use_fp8=use_fp8,
            backend=backend,
        )

    return ll_dispatch


def layout_case(inp: Inputs, backend: str) -> Case:
    """get_dispatch_layout; bytes: topk_idx read plus the outputs written."""
    s = inp.setup
    fn = stacked(
        lambda idx: jax_ep.get_dispatch_layout(
            idx, num_experts=s.experts, axis_name=AXIS, backend=backend
        ),
        inp.mesh,
    )
    read = s.tokens * s.top_k * 4
    written = (s.ranks + s.experts + 1) * 4 + s.tokens * s.ranks  # int32 counts, bool [T, R]
    return Case(
        fn,
        (inp.idx,),
        read + written,
        check=lambda out: _expect("layout rows to send", out.num_tokens_per_rank, inp.rows),
    )


def dispatch_case(inp: Inputs, backend: str) -> Case:
    """Normal dispatch of `setup.dtype` rows, returning the received rows and the handle."""
    fn = stacked(_dispatch_fn(inp, backend), inp.mesh)
    return Case(
        fn,
        (inp.x, inp.idx, inp.w),
        _rows_bytes(inp),
        check=_check_received("dispatch", inp),
    )


def dispatch_fp8_case(inp: Inputs, backend: str) -> Case:
    """Normal dispatch of the FP8 pair (x_fp8, scales), quantized once beforehand."""
    x_fp8, scales = stacked(jax_ep.fp8.quantize, inp.mesh)(inp.x)
    dispatch = _dispatch_fn(inp, backend)
    fn = stacked(lambda q, s, idx, w: dispatch((q, s), idx, w), inp.mesh)
    return Case(
        fn,
        (x_fp8, scales, inp.idx, inp.w),
        _rows_bytes(inp, fp8=True),
        check=_check_received("dispatch_fp8", inp),
    )


def combine_case(inp: Inputs, backend: str) -> Case:
    """combine of the received rows of a dispatch (run once, untimed), with its handle."""
    received, handle = stacked(_dispatch_fn(inp, backend), inp.mesh)(inp.x, inp.idx, inp.w)
    fn = stacked(lambda y, hd: jax_ep.combine(y, hd, backend=backend), inp.mesh)
    return Case(fn, (received.x, handle), _rows_bytes(inp))


def round_trip_case(inp: Inputs, backend: str) -> Case:
    """dispatch then combine of the received rows, in one program."""
    dispatch = _dispatch_fn(inp, backend)

    def round_trip(x: jax.Array, idx: jax.Array, w: jax.Array) -> jax.Array:
        received, handle = dispatch(x, idx, w)
        return jax_ep.combine(received.x, handle, backend=backend)

    return Case(stacked(round_trip, inp.mesh), (inp.x, inp.idx, inp.w), 2 * _rows_bytes(inp))


def ll_dispatch_case(inp: Inputs, backend: str, use_fp8: bool = False) -> Case:
    """low_latency_dispatch (bf16, or FP8 quantized inside the op), with its handle."""
    fn = stacked(_ll_dispatch_fn(inp, backend, use_fp8), inp.mesh)
    return Case(
        fn,
        (inp.ll_x, inp.ll_idx),
        _messages_bytes(inp, fp8=use_fp8),
        check=lambda out: _expect("low-latency messages", out[0].count, inp.messages),
    )


def ll_combine_case(inp: Inputs, backend: str) -> Case:
    """low_latency_combine of the slots of a bf16 low-latency dispatch (run once, untimed)."""
    received, handle = stacked(_ll_dispatch_fn(inp, backend, False), inp.mesh)(inp.ll_x, inp.ll_idx)
    fn = stacked(
        lambda y, idx, w, hd: jax_ep.low_latency_combine(y, idx, w, hd, backend=backend),
        inp.mesh,
    )
    return Case(fn, (received.x, inp.ll_idx, inp.ll_w, handle), _messages_bytes(inp))


def ll_round_trip_case(inp: Inputs, backend: str) -> Case:
    """bf16 low_latency_dispatch then low_latency_combine of the slots, in one program."""
    ll_dispatch = _ll_dispatch_fn(inp, backend, False)

    def ll_round_trip(x: jax.Array, idx: jax.Array, w: jax.Array) -> jax.Array:
        received, handle = ll_dispatch(x, idx)
        return jax_ep.low_latency_combine(received.x, idx, w, handle, backend=backend)

    fn = stacked(ll_round_trip, inp.mesh)
    return Case(fn, (inp.ll_x, inp.ll_idx, inp.ll_w), 2 * _messages_bytes(inp))


CASES: dict[str, Callable[[Inputs, str], Case]] = {
    "layout": layout_case,
    "dispatch": dispatch_case,
    "dispatch_fp8": dispatch_fp8_case,
    "combine": combine_case,
    "dispatch+combine": round_trip_case,
    "ll_dispatch": ll_dispatch_case,
    "ll_dispatch_fp8": lambda inp, backend: ll_dispatch_case(inp, backend, use_fp8=True),
    "ll_combine": ll_combine_case,
    "ll_round_trip": ll_round_trip_case,
}
assert tuple(CASES) == OPS


def case_account(op: str, inp: Inputs, virtual: bool) -> Any:
    """What the cuda backend's kernels do for `op` on these inputs (a jax_ep.tools.account.Account:
    launches, barriers, bytes of row data against the minimum), or None for the layout."""
    s = inp.setup
    between = not virtual and s.ranks > 1
    E, H = s.experts, s.hidden
    idx, ll_idx = np.asarray(inp.idx), np.asarray(inp.ll_idx)
    row = H * jnp.dtype(s.dtype).itemsize
    if op == "layout":
        return None
    if op == "dispatch_fp8":
        return account.dispatch(idx, num_experts=E, row_bytes=H,
                                scale_bytes=H // BLOCK * SCALE_BYTES, between=between)
    parts = []
    if op in ("dispatch", "dispatch+combine"):
        parts.append(account.dispatch(idx, num_experts=E, row_bytes=row, between=between))
    if op in ("combine", "dispatch+combine"):
        parts.append(account.combine(idx, num_experts=E, row_bytes=row, between=between))
    if op in ("ll_dispatch", "ll_dispatch_fp8", "ll_round_trip"):
        parts += account.low_latency_dispatch(ll_idx, num_experts=E, hidden=H,
                                               wire="e4m3" if op == "ll_dispatch_fp8" else "bf16",
                                               between=between)
    if op in ("ll_combine", "ll_round_trip"):
        parts += account.low_latency_combine(ll_idx, num_experts=E, hidden=H, between=between)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def case_wire(op: str, inp: Inputs) -> dict[str, float] | None:
    """Bytes a rank sends over the wire for `op` (jax_ep.tools.bench.wire): the routed "minimum"
    and each transport's, or None for the layout (purely local)."""
    s = inp.setup
    if op == "layout":
        return None
    low = op.startswith("ll_")
    idx = np.asarray(inp.ll_idx if low else inp.idx)
    fp8 = op.endswith("_fp8")
    h = s.hidden
    fp8_row = h + h // BLOCK * SCALE_BYTES
    row = fp8_row if fp8 else h * (2 if low else jnp.dtype(s.dtype).itemsize)
    back = h * (2 if low else jnp.dtype(s.dtype).itemsize)
    base = op.removeprefix("ll_").removesuffix("_fp8")  # round trips: both directions
    directions = {"dispatch": ("dispatch",), "combine": ("combine",)}.get(
        base, ("dispatch", "combine"))
    out = dict.fromkeys(("minimum", *wire.TRANSPORTS), 0.0)
    for direction in directions:
        payload = row if direction == "dispatch" else back
        out["minimum"] += wire.minimum(idx, s.experts, payload, low, direction)
        for transport in wire.TRANSPORTS:
            if low:
                out[transport] += wire.low_latency(idx, s.experts, row, h, transport, direction)
            else:
                out[transport] += wire.normal(idx, s.experts, payload, transport, direction)
    return out


def build_case(op: str, inp: Inputs, backend: str, cases: dict | None = None) -> Case:
    """The case of `op` on `backend`, compiled and run once (its counts checked): from CASES
    (per shard), or from `cases` (`virtual_cases.CASES`: all ranks on one device).

    Raises:
      NotImplementedError: the backend cannot run the op here.
      RuntimeError: the op's counts disagree with the routing's.
    """
    virtual = cases is not None
    exchange = backend == "cuda" and not virtual and op != "layout" and inp.setup.ranks > 1
    if exchange and not runtime.is_initialized():
        raise NotImplementedError(
            "between devices the cuda backend needs jax_ep.initialize() (initialize_for(setup))"
        )
    case = (cases or CASES)[op](inp, backend)
    out = jax.block_until_ready(case.fn(*case.args))
    if case.check is not None:
        case.check(out)
    return case


def initialize_for(setup: Setup) -> None:
    """`jax_ep.initialize()` with a buffer for the setup's largest calls, for the cuda backend
    between devices: GPUs of this process through peer access, CPU devices through host
    peers (docs/cuda.md)."""
    jax_ep.initialize(runtime.BufferConfig(
        num_tokens=setup.tokens, hidden=setup.hidden, top_k=setup.top_k,
        num_experts=setup.experts, num_ranks=setup.ranks,
        dtype_bytes=jnp.dtype(setup.dtype).itemsize, low_latency_tokens=setup.ll_tokens))


def backend_unavailable(backend: str, platform: str) -> str | None:
    """Why `backend` cannot run at all on `platform` ("cpu" or "gpu"), or None if it can.

    The "cuda" backend needs the compiled extension (jax_ep._ext) and its FFI targets; on CPU
    its custom calls run the extension's CPU handlers, on a GPU its CUDA kernels.
    """
    if backend != "cuda":
        return None
    try:
        from jax_ep import _ffi

        _ffi.register()
    except Exception as error:  # a missing or broken extension: say why, run the others
        return f"{type(error).__name__}: {error}"
    if platform != "cpu" and not _ffi.cuda_kernels_compiled():
        return "the extension was built without the CUDA kernels"
    return None
