"""The exchange custom calls (ffi/exchange.h), shared by `jax_ep.virtual` and the per-shard
"cuda" backend.

Operands and results stack V ranks on their leading axis: V = R with virtual ranks (all ranks
in one call), V = 1 inside `shard_map` (one rank per device; the handlers then exchange with
the other devices: GPUs through NVSHMEM, CPU devices through host peers). Every call's first
operand holds the EP rank of each stacked rank: 0..R-1 with virtual ranks (`axis_name`
None), the index along `axis_name` inside `shard_map`. Result types are derived from an
operand's type, so they carry shard_map's varying-axis typing.

Every call takes a `Placement` (jax_ep.backends): `num_sms`, the SMs' worth of blocks each
kernel launch may take (the blocks that many SMs hold at once; on the CPU, at most that many
blocks of $JAX_EP_CPU_GRID); `stream`, a GPU stream of the call's own: the custom call then
sits in a `compute_on2("gpu_stream:N")` call, which XLA runs asynchronously on that stream
(on the CPU the call runs as usual); and, for the low-latency calls, `buffer`, the half of the
low-latency regions they use.

With `$JAX_EP_CPU_REPLAY` set when a program is traced, each exchange call between devices
gets a `replay_site` of its own, and the CPU handlers record its launches the first time the
site runs and replay them later, as XLA's command buffers do on GPUs (ffi/exchange_cpu.cc):
the test that the exchanges are replay-safe.
"""

from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:  # jax <= 0.10; later versions name the function form compute_on, the same arguments
    from jax.experimental.compute_on import compute_on2
except ImportError:
    from jax.experimental.compute_on import compute_on as compute_on2

from jax_ep import _ep_groups, _exchange_order, _ffi, fp8, quant, runtime
from jax_ep.placement import ANYWHERE, Placement
from jax_ep.structs import DispatchHandle, Received


def _types(like: jax.Array, shapes) -> list:
    base = jax.typeof(like)
    return [base.update(shape=tuple(s), dtype=jnp.dtype(d)) for s, d in shapes]


_replay_sites = itertools.count()


def _exchange_call(target: str, result_types, operands, attrs: dict, placement: Placement, *,
                   axis_name: str | None, stacked: int, aliases: dict[int, int] | None = None):
    """An exchange custom call: the ranks operand (`_ranks(axis_name, stacked)`), then
    `operands`. Side-effecting (XLA runs it exactly once per rank) and, between devices, in
    the program's one order of exchanges (jax_ep/_exchange_order.py) and within the EP group
    of each device (jax_ep/_ep_groups.py). Placed on
    `placement.stream` when it names one. `aliases` maps operand indices (the ranks are 0)
    to result indices."""
    attrs = _attrs(**attrs, num_sms=placement.num_sms)
    ordered = axis_name is not None and attrs["num_ranks"] > 1
    if ordered:  # between devices: the program's EP groups (jax_ep/_ep_groups.py)
        groups = _ep_groups.device_table(axis_name, target)
        if groups:
            attrs["ep_groups"] = groups
        if os.environ.get("JAX_EP_CPU_REPLAY"):
            attrs["replay_site"] = np.int64(next(_replay_sites))
    single = not isinstance(result_types, (list, tuple))
    types = [result_types] if single else list(result_types)

    def run(*args):
        outs = _exchange_order.call(target, types, args, attrs, aliases, ordered=ordered)
        return outs[0] if single else outs

    if placement.stream is not None:
        device = jax.tree.map(lambda _: jax.memory.Space.Device, result_types)
        run = compute_on2(run, compute_type=f"gpu_stream:{placement.stream}",
                          out_memory_spaces=device)
    run = jax.custom_batching.custom_vmap(run)
    run.def_vmap(_refuse_vmap)
    return run(_ranks(axis_name, stacked), *operands)


def _refuse_vmap(axis_size, in_batched, *args):
    """An exchange meets its peers once per call: a batch of them is not one custom call."""
    raise ValueError(
        "jax_ep: the cuda backend's exchange ops cannot run under jax.vmap. To run the R "
        "ranks of an EP group in one call, use jax_ep.virtual (arguments stacked [R, ...]); "
        "to map over a batch, call the op once on the whole batch (tokens are rows), or pass "
        "backend='xla'."
    )


def _ranks(axis_name: str | None, stacked: int) -> jax.Array:
    """The EP rank of each stacked rank: this device's index along `axis_name`, or 0..V-1."""
    if axis_name is None:
        return jnp.arange(stacked, dtype=jnp.int32)
    return lax.axis_index(axis_name).astype(jnp.int32)[None]


def _attrs(**attrs) -> dict:
    """int64 attributes; None leaves one out (num_sms: then no bound)."""
    return {k: np.int64(int(v)) for k, v in attrs.items() if v is not None}


def _rings(op: str, axis_name: str | None, placement: Placement, expert_major: bool,
           num_ranks: int) -> dict:
    """Between devices, the rank-major normal ops stream through the buffer's rings, if it has
    them (runtime.channels(); cuda/peer_ops.h). The streaming launch's blocks are resident at
    once: an op whose num_sms holds fewer blocks streams through fewer of the rings' channels
    (runtime.stream_plan; every rank runs the same program, so all agree)."""
    rings = runtime.channels() if axis_name is not None and not expert_major else None
    if rings is None:
        return {}
    state = runtime.state() or {}
    nodes = state.get("ranks_per_node", 0) if state.get("peer_access") == "put" else 0
    plan = runtime.stream_plan(op, rings, num_ranks, ranks_per_node=nodes,
                               num_sms=placement.num_sms)
    return dict(channels=plan.channels, chunk_tokens=rings.chunk_tokens,
                ring_chunks=rings.ring_chunks, channel_warps=rings.warps)


def dispatch(data, scales, topk_idx, topk_weights, *, num_ranks, num_experts, capacity,
             expert_major, drop_by_source=False, axis_name=None, zero_padding=False,
             placement=ANYWHERE, wire=None, dequantize=False):
    """Normal dispatch; returns the 16 results of "jax_ep_dispatch" as a dict. Rows of "x"
    and "scales" past the count are unspecified unless `zero_padding` (docs/contract.md,
    "Padding"). `wire` (a jax_ep.quant format; data bfloat16, no scales): the send casts the
    rows, and "x" and "scales" are the format's rows (quant.to_rows), or, `dequantize` (one
    rank per device), "x" the rows dequantized to bfloat16 and no "scales"."""
    _ffi.register()
    V, T, K = topk_idx.shape
    R, E, cap = num_ranks, num_experts, capacity
    H, row_type = data.shape[2], data.dtype
    if scales is None:
        scales = jnp.zeros((V, T, 0), jnp.float32)
    S = scales.shape[2]
    if wire is not None and not dequantize:
        (H, row_type), S = ll_row_shapes(wire, H)
    elif wire is not None:
        S = 0
    rows = R * T if expert_major else cap
    per_entry = (V, cap) if expert_major else (V, cap, K)
    em_cap, em_rows = (cap, R * T) if expert_major else (0, 0)
    workspace = _ffi.EXT.workspace("jax_ep_dispatch", R, T, K, E, V)
    i32, f32 = jnp.int32, jnp.float32
    names_shapes = {
        "x": ((V, cap, H), row_type), "scales": ((V, cap, S), f32),
        "topk_idx": (per_entry, i32), "topk_weights": (per_entry, f32),
        "num_tokens": ((V,), i32), "tokens_per_expert": ((V, E // R), i32),
        "num_dropped": ((V,), i32), "num_invalid": ((V,), i32), "clean_idx": ((V, T, K), i32),
        "recv_src": ((V, rows), i32), "src_row": ((V, R * T), i32),
        "entry_row": ((V, em_cap), i32), "entry_choice": ((V, em_cap), i32),
        "row_entries": ((V, em_rows, K), i32), "needed": ((V,), i32),
        "workspace": ((workspace,), i32),
    }
    outs = _exchange_call(
        "jax_ep_dispatch", _types(topk_idx, names_shapes.values()),
        (data, scales, topk_idx, topk_weights),
        dict(num_ranks=R, num_experts=E, capacity=cap, expert_major=expert_major,
             zero_padding=zero_padding, drop_by_source=drop_by_source,
             wire=None if wire is None else WIRES.index(wire),
             dequantize=dequantize or None,
             **_rings("dispatch", axis_name, placement, expert_major, num_ranks)),
        placement, axis_name=axis_name,
        stacked=V)
    result = dict(zip(names_shapes, outs, strict=True))
    if not S:
        result["scales"] = None
    return result


def received_and_handle(out: dict, *, num_ranks, num_experts, capacity, expert_major,
                        axis_name) -> tuple[Received, DispatchHandle]:
    """The results of `_exchange_ffi.dispatch` as the ops' structures."""
    em = expert_major
    received = Received(
        x=out["x"],
        scales=out["scales"],
        topk_idx=out["topk_idx"],
        topk_weights=out["topk_weights"],
        num_tokens=out["num_tokens"],
        tokens_per_expert=out["tokens_per_expert"],
        num_dropped=out["num_dropped"],
        num_invalid=out["num_invalid"],
        group_sizes=out["tokens_per_expert"] if em else None,
    )
    handle = DispatchHandle(
        topk_idx=out["clean_idx"],
        recv_src=out["recv_src"],
        src_row=out["src_row"],
        entry_row=out["entry_row"] if em else None,
        entry_choice=out["entry_choice"] if em else None,
        row_entries=out["row_entries"] if em else None,
        num_experts=num_experts,
        num_ranks=num_ranks,
        capacity=capacity,
        expert_major=em,
        axis_name=axis_name,
    )
    return received, handle


def combine(y, weights, src_row, row_entries, *, num_ranks, top_k, expert_major,
            axis_name=None, placement=ANYWHERE, wire=None):
    """Combine of [V, rows, H] rows; `row_entries` None for the rank-major layout. `wire` (a
    jax_ep.quant format; bfloat16 y, one rank per device): the rows travel home in it, cast
    by the stages and dequantized by the sums (cuda/combine.h)."""
    _ffi.register()
    V, _, H = y.shape
    T = src_row.shape[1] // num_ranks
    if weights is None:
        weights = jnp.zeros((V, 0), jnp.float32)
    if row_entries is None:
        row_entries = jnp.zeros((V, 0, top_k), jnp.int32)
    return _exchange_call(
        "jax_ep_combine", _types(y, [((V, T, H), y.dtype)])[0],
        (y, weights, src_row, row_entries),
        dict(num_ranks=num_ranks, expert_major=expert_major,
             wire=None if wire is None else WIRES.index(wire),
             **_rings("combine", axis_name, placement, expert_major, num_ranks)), placement,
        axis_name=axis_name, stacked=V)


def dispatch_rows(values, recv_src, entry_row, *, num_ranks, capacity, axis_name=None,
                  placement=ANYWHERE):
    """[V, T, W] values to [V, capacity, W] where a dispatch put its tokens' rows
    (cuda/dispatch_rows.h): `recv_src` [V, N] and, expert-major, `entry_row` [V, capacity]
    (None rank-major) from its handle; zeros in the slots that hold no row. Loads only:
    `rows_by_loads` says where it runs."""
    _ffi.register()
    V, _, W = values.shape
    expert_major = entry_row is not None
    if entry_row is None:
        entry_row = jnp.zeros((V, 0), jnp.int32)
    return _exchange_call(
        "jax_ep_dispatch_rows", _types(values, [((V, capacity, W), values.dtype)])[0],
        (values, recv_src, entry_row), dict(num_ranks=num_ranks, expert_major=expert_major),
        placement, axis_name=axis_name, stacked=V)


def rows_by_loads(axis_name: str | None, num_ranks: int, num_tokens: int,
                  row_bytes: int) -> bool:
    """Whether `dispatch_rows` can run for this call: always with virtual ranks or one rank;
    between devices when the peers are reached with stores (not puts, not nodes) and the
    stage of num_tokens rows fits the normal-mode region (else the dispatch runs again)."""
    if axis_name is None or num_ranks == 1:
        return True
    state = runtime.state()
    if state is None or state["peer_access"] != "store" or state["ranks_per_node"]:
        return False
    return _ffi.EXT.rows_stage_fits(state["buffer_bytes"], state["low_latency_bytes"],
                                    num_tokens, row_bytes)


# The wire formats of low-latency dispatch by their number in cuda/wire.h.
WIRES = ("bf16", "e4m3", "e4m3_ue8m0", "mxfp8", "nvfp4")


def ll_row_shapes(wire: str, hidden: int) -> tuple[tuple[int, object], int]:
    """A low-latency row in `wire` format: (its data's (elements, dtype), its other bytes in
    float32 words, as jax_ep.quant.to_rows lays them out)."""
    if wire == "bf16":
        return (hidden, jnp.bfloat16), 0
    data_bytes, rest = quant.wire_bytes(wire, hidden)
    return (data_bytes, jnp.uint8 if wire == "nvfp4" else fp8.FP8_DTYPE), rest // 4


def ll_dispatch_send(x, topk_idx, *, num_ranks, num_experts, wire, axis_name=None,
                     placement=ANYWHERE):
    """The send half of low-latency dispatch, the rows cast to `wire` (WIRES); a dict for
    `ll_dispatch_recv`. With every rank of the group here (virtual ranks, or one rank) the
    send delivers: its rows land in their slots and it writes the count."""
    _ffi.register()
    V, T, K = topk_idx.shape
    R, E, H = num_ranks, num_experts, x.shape[2]
    slots = (V, E // R, R * T)
    i32 = jnp.int32
    (elements, dtype), words = ll_row_shapes(wire, H)
    shapes = [
        ((*slots, elements), dtype), ((*slots, words), jnp.float32), ((V, R, T, K), i32),
        ((V, T, K), i32), ((V,), i32), ((V, E // R if V == R else 0), i32),
        ((_ffi.EXT.workspace("jax_ep_ll_dispatch_send", R, T, K, E, V),), i32),
    ]
    recv_x, recv_scales, src_row, clean_idx, num_invalid, count, _ = _exchange_call(
        "jax_ep_ll_dispatch_send", _types(topk_idx, shapes), (x, topk_idx),
        dict(num_ranks=R, num_experts=E, wire=WIRES.index(wire), buffer=placement.buffer),
        placement,
        axis_name=axis_name, stacked=V)
    return {"recv_x": recv_x, "recv_scales": recv_scales, "src_row": src_row,
            "clean_idx": clean_idx, "num_invalid": num_invalid, "count": count}


def ll_dispatch_recv(data, *, num_ranks, num_experts, axis_name=None, placement=ANYWHERE):
    """The receive half: (recv_x, recv_scales or None, src_row, count [V, E/R]); no call
    when every rank is here (the send delivered)."""
    recv_x, recv_scales, src_row = data["recv_x"], data["recv_scales"], data["src_row"]
    stacked = recv_x.shape[0]
    if stacked == num_ranks:
        return recv_x, recv_scales if recv_scales.shape[3] else None, src_row, data["count"]
    recv_x, recv_scales, src_row, count = _exchange_call(
        "jax_ep_ll_dispatch_recv",
        _types(src_row, [(a.shape, a.dtype) for a in (recv_x, recv_scales, src_row)]
               + [((stacked, num_experts // num_ranks), jnp.int32)]),
        (recv_x, recv_scales, src_row),
        dict(num_ranks=num_ranks, num_experts=num_experts, buffer=placement.buffer), placement,
        axis_name=axis_name, stacked=stacked, aliases={1: 0, 2: 1, 3: 2})
    return recv_x, recv_scales if recv_scales.shape[3] else None, src_row, count


def ll_combine_send(y, src_row, *, num_ranks, num_experts, axis_name=None,
                    placement=ANYWHERE):
    """The send half of low-latency combine between devices: rows [1, T, K, H] staged at
    their homes (with virtual ranks there is no send: the receive reads y in place)."""
    _ffi.register()
    V, _, T, K = src_row.shape
    return _exchange_call(
        "jax_ep_ll_combine_send", _types(y, [((V, T, K, y.shape[3]), jnp.bfloat16)])[0],
        (y, src_row),
        dict(num_ranks=num_ranks, num_experts=num_experts, buffer=placement.buffer), placement,
        axis_name=axis_name, stacked=V)


def ll_combine_recv(rows, src_row, clean_idx, topk_weights, *, num_ranks, num_experts,
                    axis_name=None, placement=ANYWHERE):
    """The receive half: the top-k weighted sums, bfloat16 [V, T, H], of `rows`: y [V, E/R,
    R*T, H] read in place (virtual ranks, or one rank) or the send's staging (between
    devices)."""
    _ffi.register()
    V, T, _ = clean_idx.shape
    return _exchange_call(
        "jax_ep_ll_combine_recv", _types(rows, [((V, T, rows.shape[3]), jnp.bfloat16)])[0],
        (rows, src_row, clean_idx, topk_weights),
        dict(num_ranks=num_ranks, num_experts=num_experts, buffer=placement.buffer), placement,
        axis_name=axis_name, stacked=V)
