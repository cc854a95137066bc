"""Virtual ranks: all R ranks of an EP group in one call on one device.

Every argument and result carries a leading rank axis `[R, ...]` (the layout of
`jax_ep.tools.reference`), and one call does the whole group's exchange. This is how the kernels
are checked and timed without R GPUs: with `backend="cuda"` the same kernel bodies that run
between GPUs run between R slices of one device's memory (on a CPU, the C++ handlers run
those bodies in loops); with `backend="xla"` the portable implementation runs under
`jax.vmap` with a named axis. Results are bit for bit those of the per-shard ops
(docs/contract.md).

Every op takes `num_sms`, the SMs each kernel launch may take with `backend="cuda"` (None,
the default: every SM, since one device plays the whole group).

Counts are reported, not raised: check `num_dropped` and `num_invalid` of the results. The
ops are not differentiable here; their backward passes are these same ops (combine of the
cotangents, dispatch with the handle) and are differentiable through `jax_ep.dispatch` and
`jax_ep.combine` inside `shard_map`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jax_ep import _checks, _exchange_ffi, _ffi, alignment, fp8, low_latency
from jax_ep.backends import xla
from jax_ep.dispatch import _no_tokens, default_capacity
from jax_ep.structs import (
    DispatchHandle,
    DispatchLayout,
    LowLatencyCombinePending,
    LowLatencyDispatchPending,
    LowLatencyHandle,
    LowLatencyReceived,
    Received,
)

AXIS = "virtual_ranks"
# The portable ops run under vmap here, where ragged_all_to_all has no batching rule.
VMAP_TRANSPORT = "all_gather"
BACKENDS = ("cuda", "xla")


def _backend(op: str, backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {list(BACKENDS)}; got {backend!r}.")
    if backend == "cuda":
        _ffi.register()
    return backend


def _check_routing(op: str, topk_idx, num_experts: int) -> tuple[int, int, int]:
    _checks.check_array(op, "topk_idx", topk_idx, ndim=3, dtypes=(jnp.int32,),
                        expect="int32 [R, T, K]")
    num_ranks, num_tokens, top_k = topk_idx.shape
    if num_ranks < 1:
        raise ValueError(f"{op}: topk_idx must hold at least one rank; got shape "
                         f"{list(topk_idx.shape)}.")
    _checks.check_positive_int(op, "num_experts", num_experts)
    if num_experts % num_ranks:
        raise ValueError(
            f"{op}: num_experts must be a positive multiple of the number of ranks "
            f"R = topk_idx.shape[0] = {num_ranks}; got {num_experts!r}."
        )
    _checks.check_top_k(op, top_k, num_experts)
    return num_ranks, num_tokens, top_k


# ---------------------------------------------------------------------------------------------
# Layout


def get_dispatch_layout(topk_idx, *, num_experts: int, backend: str = "cuda") -> DispatchLayout:
    """`jax_ep.get_dispatch_layout` of every rank: leaves stacked [R, ...]."""
    op = "jax_ep.virtual.get_dispatch_layout"
    num_ranks, _, _ = _check_routing(op, topk_idx, num_experts)
    module = _module(op, backend)
    return jax.vmap(
        lambda idx: module.get_dispatch_layout(idx, num_experts=num_experts, num_ranks=num_ranks)
    )(topk_idx)


def _module(op: str, backend: str):
    if _backend(op, backend) == "cuda":
        from jax_ep.backends import cuda

        return cuda
    return xla


# ---------------------------------------------------------------------------------------------
# Normal dispatch / combine


def dispatch(
    x,
    topk_idx,
    topk_weights,
    *,
    num_experts: int,
    capacity: int | None = None,
    expert_major: bool = False,
    expert_alignment: int | None = None,
    backend: str = "cuda",
    num_sms: int | None = None,
) -> tuple[Received, DispatchHandle]:
    """`jax_ep.dispatch` of every rank at once.

    Args:
      x: [R, T, H] (any float dtype), or the FP8 pair `(x_fp8 [R, T, H], scales [R, T, H/128])`.
      topk_idx: int32 [R, T, K]; topk_weights: float32 [R, T, K].
      num_experts, capacity, expert_major, expert_alignment: as in `jax_ep.dispatch`.
      backend: "cuda" (our kernels) or "xla" (the portable implementation under vmap).
      num_sms: the SMs each kernel launch may take (None: every SM).

    Returns:
      (Received, DispatchHandle) with every leaf stacked [R, ...]; pass the handle to
      `jax_ep.virtual.combine`.
    """
    op = "jax_ep.virtual.dispatch"
    num_ranks, num_tokens, top_k = _check_routing(op, topk_idx, num_experts)
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{op}: x must be an array or the pair (x_fp8, scales).")
        data, scales = x
        fp8.check_pair(op, "x[0] (x_fp8)", data, scales)
    else:
        data, scales = x, None
        _checks.check_float(op, "x", x, ndim=3, expect="[R, T, H]")
    if data.ndim != 3 or data.shape[:2] != (num_ranks, num_tokens):
        raise ValueError(f"{op}: x must be [R, T, H] = [{num_ranks}, {num_tokens}, H] like "
                         f"topk_idx; got {_checks.describe(data)}.")
    _checks.check_array(op, "topk_weights", topk_weights, dtypes=(jnp.float32,),
                        shape=(num_ranks, num_tokens, top_k), ndim=3,
                        expect=f"float32 [R, T, K] = [{num_ranks}, {num_tokens}, {top_k}]")
    _checks.check_positive_int(op, "capacity", capacity, allow_none=True)
    placement = _checks.placement(op, num_sms, None)
    align = alignment.check(op, expert_alignment, expert_major)
    default = default_capacity(num_ranks, num_tokens, top_k, num_experts, expert_major)
    if align:
        default = alignment.with_padding(default, num_experts // num_ranks, align)
        alignment.check_capacity(op, capacity, align, default)
    capacity = default if capacity is None else capacity
    name = _backend(op, backend)
    received, handle = _dispatch(name, data, scales, topk_idx, topk_weights, num_experts,
                                 capacity, expert_major, placement)
    if align:
        received, handle = jax.vmap(partial(alignment.align, alignment=align))(received, handle)
    return received, handle


def _dispatch(name, data, scales, topk_idx, topk_weights, num_experts, capacity, expert_major,
              placement):
    """The unaligned results of `dispatch`, every rank's."""
    num_ranks = topk_idx.shape[0]
    if topk_idx.shape[1] == 0:  # nothing to send: the per-shard op's empty results, every rank
        return jax.vmap(lambda xs, ss, idx: _no_tokens(
            xs, ss, idx, num_experts, num_ranks, AXIS, capacity, expert_major))(
                data, scales, topk_idx)
    if name == "xla":
        def run(xs, ss, idx, w):
            received, handle, _ = xla.dispatch(
                xs, ss, idx, w, num_experts=num_experts, axis_name=AXIS, capacity=capacity,
                expert_major=expert_major, transport_name=VMAP_TRANSPORT)
            return received, handle

        return jax.vmap(run, axis_name=AXIS, axis_size=num_ranks)(data, scales, topk_idx,
                                                                  topk_weights)
    out = _exchange_ffi.dispatch(data, scales, topk_idx, topk_weights, num_ranks=num_ranks,
                                 num_experts=num_experts, capacity=capacity,
                                 expert_major=expert_major, placement=placement)
    return _exchange_ffi.received_and_handle(
        out, num_ranks=num_ranks, num_experts=num_experts, capacity=capacity,
        expert_major=expert_major, axis_name=AXIS)


def combine(y, handle: DispatchHandle, *, topk_weights=None, backend: str = "cuda",
            num_sms: int | None = None):
    """`jax_ep.combine` of every rank at once: y [R, capacity, H] -> [R, T, H] in y.dtype."""
    op = "jax_ep.virtual.combine"
    placement = _checks.placement(op, num_sms, None)
    if not isinstance(handle, DispatchHandle) or handle.axis_name != AXIS:
        raise TypeError(f"{op}: handle must be the DispatchHandle of jax_ep.virtual.dispatch.")
    R, cap = handle.num_ranks, handle.capacity
    _checks.check_float(op, "y", y, ndim=3, expect=f"[R, capacity, H] = [{R}, {cap}, H]")
    if y.shape[:2] != (R, cap):
        raise ValueError(f"{op}: y must be [R, capacity, H] = [{R}, {cap}, H]; got "
                         f"{_checks.describe(y)}.")
    if topk_weights is not None:
        _checks.check_array(op, "topk_weights", topk_weights, ndim=2, dtypes=(jnp.float32,),
                            shape=(R, cap), expect=f"float32 [R, capacity] = [{R}, {cap}]")
    name = _backend(op, backend)
    if handle.topk_idx.shape[1] == 0:  # a dispatch of no tokens: nothing comes home
        return jax.lax.full_like(y, 0, shape=(R, 0, y.shape[2]))
    if handle.alignment is not None:
        y, topk_weights = jax.vmap(alignment.unalign)(y, topk_weights, handle)
    if name == "xla":
        return jax.vmap(xla.combine, axis_name=AXIS, axis_size=R)(y, topk_weights, handle)
    if y.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{op}: the cuda backend combines float32, bfloat16 or float16 rows; "
                         f"got {y.dtype}. Cast y, or use backend='xla'.")
    return _exchange_ffi.combine(y, topk_weights, handle.src_row, handle.row_entries,
                                 num_ranks=R, top_k=handle.topk_idx.shape[2],
                                 expert_major=handle.expert_major, placement=placement)


# ---------------------------------------------------------------------------------------------
# Low-latency dispatch / combine


def low_latency_dispatch_send(x, topk_idx, *, num_experts: int, use_fp8: bool = False,
                              wire_format: str | None = None, backend: str = "cuda",
                              num_sms: int | None = None) -> LowLatencyDispatchPending:
    """Issues `jax_ep.low_latency_dispatch` for every rank; complete with `..._recv`."""
    op = "jax_ep.virtual.low_latency_dispatch"
    placement = _checks.placement(op, num_sms, None)
    R, T, K = _check_routing(op, topk_idx, num_experts)
    _checks.check_array(op, "x", x, ndim=3, dtypes=(jnp.bfloat16,), shape=(R, T, None),
                        expect=f"bfloat16 [R, T, H] = [{R}, {T}, H]")
    fp8.check_hidden(op, "x", x.shape[2], low_latency=True)
    rows = low_latency.wire(op, use_fp8, wire_format)
    name = _backend(op, backend)
    if name == "xla":
        data = jax.vmap(
            lambda xs, idx: xla.low_latency_dispatch_send(
                xs, idx, num_experts=num_experts, axis_name=AXIS, wire=rows,
                transport_name=VMAP_TRANSPORT),
            axis_name=AXIS, axis_size=R)(x, topk_idx)
    else:
        data = _exchange_ffi.ll_dispatch_send(x, topk_idx, num_ranks=R, num_experts=num_experts,
                                              wire=rows, placement=placement)
    return LowLatencyDispatchPending(data=data, num_experts=num_experts, axis_name=AXIS,
                                     backend=name, placement=placement,
                                     wire_format=wire_format)


def low_latency_dispatch_recv(pending: LowLatencyDispatchPending):
    """Completes `low_latency_dispatch_send`: (LowLatencyReceived, LowLatencyHandle), stacked."""
    if not isinstance(pending, LowLatencyDispatchPending) or pending.axis_name != AXIS:
        raise TypeError("jax_ep.virtual.low_latency_dispatch_recv: pending must be the value "
                        "of jax_ep.virtual.low_latency_dispatch_send.")
    E, data = pending.num_experts, pending.data
    if pending.backend == "xla":
        received, handle = jax.vmap(
            lambda sent: xla.low_latency_dispatch_recv(sent, num_experts=E, axis_name=AXIS),
            axis_name=AXIS)(data)
    else:
        R = data["recv_x"].shape[0]
        recv_x, recv_scales, src_row, count = _exchange_ffi.ll_dispatch_recv(
            data, num_ranks=R, num_experts=E, placement=pending.placement)
        received = LowLatencyReceived(x=recv_x, scales=recv_scales, count=count,
                                      num_invalid=data["num_invalid"])
        handle = LowLatencyHandle(topk_idx=data["clean_idx"], src_row=src_row,
                                  num_experts=E, num_ranks=R, axis_name=AXIS)
    return low_latency.as_quantized(received, pending.wire_format), handle


def low_latency_dispatch(x, topk_idx, *, num_experts: int, use_fp8: bool = False,
                         wire_format: str | None = None, backend: str = "cuda",
                         num_sms: int | None = None):
    """`jax_ep.low_latency_dispatch` of every rank: x bf16 [R, T, H] -> x [R, E/R, R*T, H]."""
    return low_latency_dispatch_recv(low_latency_dispatch_send(
        x, topk_idx, num_experts=num_experts, use_fp8=use_fp8, wire_format=wire_format,
        backend=backend, num_sms=num_sms))


def low_latency_combine_send(y, topk_idx, topk_weights, handle: LowLatencyHandle, *,
                             backend: str = "cuda", num_sms: int | None = None
                             ) -> LowLatencyCombinePending:
    """Issues `jax_ep.low_latency_combine` for every rank; complete with `..._recv`."""
    op = "jax_ep.virtual.low_latency_combine"
    placement = _checks.placement(op, num_sms, None)
    if not isinstance(handle, LowLatencyHandle) or handle.axis_name != AXIS:
        raise TypeError(f"{op}: handle must be the LowLatencyHandle of "
                        f"jax_ep.virtual.low_latency_dispatch.")
    R, T, K = handle.topk_idx.shape
    El = handle.num_experts // R
    _checks.check_array(op, "y", y, ndim=4, dtypes=(jnp.bfloat16,), shape=(R, El, R * T, None),
                        expect=f"bfloat16 [R, E/R, R*T, H] = [{R}, {El}, {R * T}, H]")
    for name, a, dtype in (("topk_idx", topk_idx, jnp.int32),
                           ("topk_weights", topk_weights, jnp.float32)):
        _checks.check_array(op, name, a, ndim=3, dtypes=(dtype,), shape=(R, T, K),
                            expect=f"{jnp.dtype(dtype).name} [R, T, K] = [{R}, {T}, {K}]")
    name = _backend(op, backend)
    if name == "xla":
        data = jax.vmap(xla.low_latency_combine_send, axis_name=AXIS, axis_size=R)(y, handle)
    else:
        data = y  # no send: with virtual ranks the receive reads the expert rows in place
    return LowLatencyCombinePending(data=data, topk_weights=topk_weights, handle=handle,
                                    backend=name, placement=placement)


def low_latency_combine_recv(pending: LowLatencyCombinePending):
    """Completes `low_latency_combine_send`: bfloat16 [R, T, H]."""
    if not isinstance(pending, LowLatencyCombinePending) or pending.handle.axis_name != AXIS:
        raise TypeError("jax_ep.virtual.low_latency_combine_recv: pending must be the value "
                        "of jax_ep.virtual.low_latency_combine_send.")
    handle = pending.handle
    if pending.backend == "xla":
        return jax.vmap(xla.low_latency_combine_recv, axis_name=AXIS)(
            pending.data, pending.topk_weights, handle)
    return _exchange_ffi.ll_combine_recv(pending.data, handle.src_row, handle.topk_idx,
                                         pending.topk_weights,
                                         num_ranks=handle.num_ranks,
                                         num_experts=handle.num_experts,
                                         placement=pending.placement)


def low_latency_combine(y, topk_idx, topk_weights, handle: LowLatencyHandle, *,
                        backend: str = "cuda", num_sms: int | None = None):
    """`jax_ep.low_latency_combine` of every rank: bfloat16 [R, T, H]."""
    return low_latency_combine_recv(low_latency_combine_send(
        y, topk_idx, topk_weights, handle, backend=backend, num_sms=num_sms))
