"""The custom-call backend: XLA FFI targets implemented by our extension.

Per shard inside `shard_map`, each op is one custom call with this rank's operands (stacked
V = 1, see jax_ep/_exchange_ffi.py) and its EP axis index. With one rank (R = 1) the call
needs no peers and runs anywhere: the CUDA kernels on a GPU, the CPU handlers (the same kernel
bodies) on a CPU. With R > 1 the ranks exchange after `jax_ep.initialize()`: GPUs through
NVSHMEM (one GPU per process), the CPU devices of one process through host peers
(cuda/host_peers.h), which run the same ops; each within its EP group of the mesh
(jax_ep/_ep_groups.py). The
layout op is local and runs anywhere. Result types are built from the operand's type
(`jax.typeof(x).update(...)`) so that they carry shard_map's varying-axis typing and
custom_vjp backward passes type-check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_ep import _exchange_ffi, _ffi
from jax_ep.placement import ANYWHERE
from jax_ep.structs import DispatchHandle, DispatchLayout, LowLatencyHandle, LowLatencyReceived

NAME = "cuda"


def _result(like: jax.Array, shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.typeof(like).update(shape=shape, dtype=jnp.dtype(dtype))


def _one(a):
    """This rank's operand, stacked V = 1."""
    return None if a is None else a[None]


def _first(tree):
    """The results of a V = 1 call, unstacked."""
    return jax.tree.map(lambda a: a[0], tree)


def get_dispatch_layout(
    topk_idx: jax.Array, *, num_experts: int, num_ranks: int
) -> DispatchLayout:
    _ffi.register()
    num_tokens = topk_idx.shape[0]
    outs = jax.ffi.ffi_call(
        "jax_ep_dispatch_layout",
        (
            _result(topk_idx, (num_ranks,), jnp.int32),
            _result(topk_idx, (num_experts,), jnp.int32),
            _result(topk_idx, (num_tokens, num_ranks), jnp.bool_),
            _result(topk_idx, (), jnp.int32),
        ),
        vmap_method="sequential",  # each batch element is an independent layout
    )(topk_idx, num_experts=np.int64(num_experts), num_ranks=np.int64(num_ranks))
    return DispatchLayout(*outs)


# ---------------------------------------------------------------------------------------------
# Normal dispatch / combine


def dispatch(x, scales, topk_idx, topk_weights, *, num_experts, axis_name, capacity,
             expert_major, drop_by_source=False, placement=ANYWHERE, wire=None,
             dequantize=False):
    """`wire`: a jax_ep.quant format the send casts x's bfloat16 rows to (the received x and
    scales are then quant.to_rows of the format's rows; `dequantize`: the rows dequantized to
    bfloat16 by the unpack, no scales)."""
    num_ranks = lax.axis_size(axis_name)
    out = _exchange_ffi.dispatch(_one(x), _one(scales), _one(topk_idx), _one(topk_weights),
                                 num_ranks=num_ranks, num_experts=num_experts,
                                 capacity=capacity, expert_major=expert_major,
                                 drop_by_source=drop_by_source, axis_name=axis_name,
                                 placement=placement, wire=wire, dequantize=dequantize)
    needed = out.pop("needed")[0]
    del out["workspace"]
    received, handle = _exchange_ffi.received_and_handle(
        _first(out), num_ranks=num_ranks, num_experts=num_experts, capacity=capacity,
        expert_major=expert_major, axis_name=axis_name)
    return received, handle, needed


def combine(y, weights, handle: DispatchHandle, *, placement=ANYWHERE, wire=None):
    """`wire`: a jax_ep.quant format the rows travel home in (bfloat16 y, one rank per
    device): the stages cast each rank's float32 row of a token, the sums dequantize it."""
    out = _exchange_ffi.combine(_one(y), _one(weights), _one(handle.src_row),
                                _one(handle.row_entries), num_ranks=handle.num_ranks,
                                top_k=handle.top_k, expert_major=handle.expert_major,
                                axis_name=handle.axis_name, placement=placement, wire=wire)
    return out[0]


def rows_for_receivers(values, handle: DispatchHandle, *, placement=ANYWHERE, wire=None):
    """Per-token values [T, H] delivered like the dispatch's rows (entries), the rows past the
    count zero (cotangents must be defined everywhere): each receiver pulls its rows along the
    handle (`_exchange_ffi.dispatch_rows`, no count), or, where peers cannot be read (puts),
    the dispatch's data movement runs again with the handle's routing. `wire` (a jax_ep.quant
    format; bfloat16 values, one rank per device): the rows travel in it, the dispatch's send
    casting them and its unpack dequantizing them to bfloat16."""
    row_bytes = values.shape[1] * values.dtype.itemsize
    if wire is None and _exchange_ffi.rows_by_loads(handle.axis_name, handle.num_ranks,
                                                    handle.num_tokens, row_bytes):
        entry_row = _one(handle.entry_row) if handle.expert_major else None
        return _exchange_ffi.dispatch_rows(
            _one(values), _one(handle.recv_src), entry_row, num_ranks=handle.num_ranks,
            capacity=handle.capacity, axis_name=handle.axis_name, placement=placement)[0]
    zeros = jnp.zeros(handle.topk_idx.shape, jnp.float32)
    out = _exchange_ffi.dispatch(_one(values), None, _one(handle.topk_idx), _one(zeros),
                                 num_ranks=handle.num_ranks, num_experts=handle.num_experts,
                                 capacity=handle.capacity, expert_major=handle.expert_major,
                                 drop_by_source=handle.drop_by_source,
                                 axis_name=handle.axis_name, zero_padding=True,
                                 placement=placement, wire=wire, dequantize=wire is not None)
    return out["x"][0]


def weights_to_sources(d_weights, received_idx, handle: DispatchHandle, *,
                       placement=ANYWHERE):
    """Cotangent of the received topk_weights -> cotangent of the source topk_weights [T, K]:
    each (row, choice) value goes home through combine; the other ranks add exact zeros."""
    d_weights = jnp.where(received_idx >= 0, d_weights, 0.0)
    num_rows, top_k = handle.num_ranks * handle.num_tokens, handle.top_k
    if handle.expert_major:  # entries back into their (rank-major row, choice) slots
        slot = jnp.where(handle.entry_row >= 0,
                         handle.entry_row * top_k + handle.entry_choice, num_rows * top_k)
        d_weights = jnp.zeros((num_rows * top_k,), jnp.float32).at[slot].set(
            d_weights, mode="drop").reshape(num_rows, top_k)
    out = _exchange_ffi.combine(_one(d_weights), None, _one(handle.src_row), None,
                                num_ranks=handle.num_ranks, top_k=top_k, expert_major=False,
                                axis_name=handle.axis_name, placement=placement)
    return out[0]


# ---------------------------------------------------------------------------------------------
# Low-latency dispatch / combine


def low_latency_dispatch_send(x, topk_idx, *, num_experts, axis_name, wire,
                              placement=ANYWHERE):
    data = _exchange_ffi.ll_dispatch_send(_one(x), _one(topk_idx),
                                          num_ranks=lax.axis_size(axis_name),
                                          num_experts=num_experts, wire=wire,
                                          axis_name=axis_name, placement=placement)
    data["num_invalid"] = data["num_invalid"][0]  # checked between the halves
    return data


def low_latency_dispatch_recv(sent, *, num_experts, axis_name, placement=ANYWHERE):
    num_ranks = lax.axis_size(axis_name)
    recv_x, recv_scales, src_row, count = _exchange_ffi.ll_dispatch_recv(
        sent, num_ranks=num_ranks, num_experts=num_experts, axis_name=axis_name,
        placement=placement)
    received = LowLatencyReceived(x=recv_x[0], scales=_first(recv_scales), count=count[0],
                                  num_invalid=sent["num_invalid"])
    handle = LowLatencyHandle(topk_idx=sent["clean_idx"][0], src_row=src_row[0],
                              num_experts=num_experts, num_ranks=num_ranks,
                              axis_name=axis_name)
    return received, handle


def low_latency_combine_send(y, handle: LowLatencyHandle, *, placement=ANYWHERE):
    if handle.num_ranks == 1:  # the receive reads y in place, as with virtual ranks
        return _one(y)
    return _exchange_ffi.ll_combine_send(_one(y), _one(handle.src_row),
                                         num_ranks=handle.num_ranks,
                                         num_experts=handle.num_experts,
                                         axis_name=handle.axis_name, placement=placement)


def low_latency_combine_recv(parts, topk_weights, handle: LowLatencyHandle, *,
                             placement=ANYWHERE):
    """`parts`: the send's staging, or y itself when there is one rank."""
    out = _exchange_ffi.ll_combine_recv(parts, _one(handle.src_row), _one(handle.topk_idx),
                                        _one(topk_weights), num_ranks=handle.num_ranks,
                                        num_experts=handle.num_experts,
                                        axis_name=handle.axis_name, placement=placement)
    return out[0]
