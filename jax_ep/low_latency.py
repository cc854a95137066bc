"""Low-latency dispatch and combine (decode), whole or split into send and receive halves.

Each (token, expert) pair is one message into per-expert slots `[E_local, R*T, H]`, so the
expert computation can start from a fixed layout, and combine forms the top-k weighted sum at
the token's home rank. The split forms let other work run between issuing the sends and
waiting for the data: `*_send` returns a pending value, `*_recv` completes it. The exact
outputs are specified in docs/contract.md.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp

from jax_ep import _checks, _exchange_ffi, backends, checks, fp8, overlap, quant
from jax_ep._scopes import scoped
from jax_ep.structs import (
    LowLatencyCombinePending,
    LowLatencyDispatchPending,
    LowLatencyHandle,
    LowLatencyReceived,
)


def _inference_only(op: str, fn, *args):
    """fn(*args), with differentiation refused by a message naming `op` (on every backend:
    low-latency mode serves decoding; training uses dispatch and combine)."""

    @jax.custom_jvp
    def run(*args):
        return fn(*args)

    @run.defjvp
    def _refuse(primals, tangents):
        raise TypeError(
            f"{op} is not differentiable: the low-latency ops serve inference (decoding). "
            f"To train, use jax_ep.dispatch and jax_ep.combine, whose gradients are defined "
            f"(docs/contract.md, \"Backward\"); or apply jax.lax.stop_gradient to the inputs."
        )

    return run(*args)


def wire(op: str, use_fp8, wire_format) -> str:
    """The format the rows travel in: a jax_ep.quant format, or "bf16"."""
    if not isinstance(use_fp8, bool):
        raise TypeError(f"{op}: use_fp8 must be a bool; got {use_fp8!r}.")
    if wire_format is None:
        return "e4m3" if use_fp8 else "bf16"
    _checks.check_choice(op, "wire_format", wire_format, quant.FORMATS)
    if use_fp8:
        raise ValueError(f"{op}: pass use_fp8=True (e4m3, received as the pair x, scales) or "
                         f"wire_format={wire_format!r} (received as a jax_ep.quant.Quantized), "
                         f"not both.")
    return wire_format


def as_quantized(received: LowLatencyReceived, wire_format: str | None) -> LowLatencyReceived:
    """With a `wire_format`, the received rows (data and their other bytes in float32 words)
    as a jax_ep.quant.Quantized of it; else as they are."""
    if wire_format is None:
        return received
    hidden = received.x.shape[-1] * (2 if wire_format == "nvfp4" else 1)
    like = jax.eval_shape(partial(quant.quantize, format=wire_format),
                          jax.ShapeDtypeStruct((1, hidden), jnp.bfloat16))
    rows = quant.from_rows(received.x, received.scales, like)
    return dataclasses.replace(received, x=rows, scales=None)


@scoped("jax_ep.low_latency_dispatch_send")
def low_latency_dispatch_send(
    x: jax.Array,
    topk_idx: jax.Array,
    *,
    num_experts: int,
    axis_name: str = "ep",
    use_fp8: bool = False,
    wire_format: str | None = None,
    on_invalid: Literal["error", "mask"] = "error",
    backend: str = "auto",
    num_sms: int | None = None,
    stream: int | None = None,
    buffer: int | None = None,
) -> LowLatencyDispatchPending:
    """Issues the sends of `low_latency_dispatch`; complete with `low_latency_dispatch_recv`."""
    op = "jax_ep.low_latency_dispatch"
    num_ranks = _checks.axis_size(op, axis_name)
    num_tokens, top_k = _checks.check_topk_idx(op, topk_idx)
    _checks.check_array(
        op, "x", x, ndim=2, dtypes=(jnp.bfloat16,), shape=(num_tokens, None),
        expect=f"bfloat16 [T, H] with T={num_tokens} like topk_idx",
        fix="Cast with x.astype(jnp.bfloat16).",
    )
    fp8.check_hidden(op, "x", x.shape[1], low_latency=True)
    _checks.check_num_experts(op, num_experts, num_ranks, axis_name)
    _checks.check_top_k(op, top_k, num_experts)
    _checks.check_choice(op, "on_invalid", on_invalid, _checks.INVALID_POLICIES)
    if buffer is None:
        buffer = overlap.micro_batch()
    placement = _checks.placement(op, num_sms, stream, buffer)
    rows = wire(op, use_fp8, wire_format)
    name = backends.resolve(backend)
    send = partial(backends.get(name).low_latency_dispatch_send, placement=placement)
    if num_tokens == 0:  # nothing to send: the receive builds the same empty results everywhere
        data = {"no_tokens": (x, topk_idx, rows),
                "num_invalid": jax.lax.full_like(topk_idx, 0, shape=())}
    else:
        data = _inference_only(
            op, lambda x, topk_idx: send(x, topk_idx, num_experts=num_experts,
                                         axis_name=axis_name, wire=rows), x, topk_idx)
    if on_invalid == "error":
        checks.invalid_ids(op, data["num_invalid"], num_experts=num_experts)
    return LowLatencyDispatchPending(
        data=data, num_experts=num_experts, axis_name=axis_name, backend=name,
        placement=placement, wire_format=wire_format,
    )


def _no_tokens(pending: LowLatencyDispatchPending):
    """The receive of a dispatch of T = 0 tokens: empty slots, zero counts (typed like the
    inputs, as the backends' results are)."""
    x, topk_idx, rows = pending.data["no_tokens"]
    num_ranks = jax.lax.axis_size(pending.axis_name)
    experts_per_rank = pending.num_experts // num_ranks
    (elements, dtype), words = _exchange_ffi.ll_row_shapes(rows, x.shape[1])
    scales = None
    if words:
        scales = jax.lax.full_like(x, 0, shape=(experts_per_rank, 0, words), dtype=jnp.float32)
    received = LowLatencyReceived(
        x=jax.lax.full_like(x, 0, shape=(experts_per_rank, 0, elements), dtype=dtype),
        scales=scales,
        count=jax.lax.full_like(topk_idx, 0, shape=(experts_per_rank,)),
        num_invalid=pending.data["num_invalid"])
    handle = LowLatencyHandle(
        topk_idx=topk_idx, src_row=jax.lax.full_like(topk_idx, -1, shape=(num_ranks, 0,
                                                                           topk_idx.shape[1])),
        num_experts=pending.num_experts, num_ranks=num_ranks, axis_name=pending.axis_name)
    return received, handle


@scoped("jax_ep.low_latency_dispatch_recv")
def low_latency_dispatch_recv(
    pending: LowLatencyDispatchPending,
) -> tuple[LowLatencyReceived, LowLatencyHandle]:
    """Completes a `low_latency_dispatch_send` (placed like the send)."""
    if not isinstance(pending, LowLatencyDispatchPending):
        raise TypeError(
            "jax_ep.low_latency_dispatch_recv: pending must be the value returned by "
            f"low_latency_dispatch_send; got {type(pending).__name__}."
        )
    if "no_tokens" in pending.data:
        received, handle = _no_tokens(pending)
    else:
        received, handle = backends.get(pending.backend).low_latency_dispatch_recv(
            pending.data, num_experts=pending.num_experts, axis_name=pending.axis_name,
            placement=pending.placement)
    received = as_quantized(received, pending.wire_format)
    # The combine exchanges on the dispatch's low-latency region.
    return received, dataclasses.replace(handle, buffer=pending.placement.buffer)


def low_latency_dispatch(
    x: jax.Array,
    topk_idx: jax.Array,
    *,
    num_experts: int,
    axis_name: str = "ep",
    use_fp8: bool = False,
    wire_format: str | None = None,
    on_invalid: Literal["error", "mask"] = "error",
    backend: str = "auto",
    num_sms: int | None = None,
    stream: int | None = None,
    buffer: int | None = None,
) -> tuple[LowLatencyReceived, LowLatencyHandle]:
    """Sends one message per (token, expert) into per-expert slots (per shard, in shard_map).

    Args:
      x: bfloat16 [T, H] tokens of this rank, H a multiple of 128.
      topk_idx: int32 [T, K] expert ids in [0, E); -1 masks a choice. A token that picks
        the same expert twice is sent to it once.
      num_experts: E, a multiple of the EP axis size R.
      axis_name: the mesh axis of the expert-parallel group.
      use_fp8: quantize to float8_e4m3fn (one float32 scale per 128 channels) before sending.
      wire_format: instead, a jax_ep.quant format ("e4m3", "e4m3_ue8m0", "mxfp8", "nvfp4")
        the kernels quantize to before sending, bit for bit `jax_ep.quant.quantize` of the
        rows; the rows arrive as a Quantized.
      on_invalid: ids outside [-1, E) are treated as -1 and counted in `num_invalid`;
        "error" also records a check that `jax_ep.checks.checked` raises, "mask" does not.
      backend: "auto", "xla" or "cuda".
      num_sms: the SMs each kernel launch may take; None (the default): every SM, since
        low-latency messages are small and a launch holds its SMs only while it runs.
      stream: None: XLA's compute stream; N: GPU stream N, beside the computation that does
        not depend on the results (as in `jax_ep.dispatch`).
      buffer: which of the two low-latency regions the exchange (and its combine) uses, 0 or
        1; a call waits only for the peers to be done with the last call on the same region,
        so two exchanges on different regions can be in flight at once. None (default): the
        micro-batch inside `jax_ep.overlap.run`, else 0.

    Returns:
      (LowLatencyReceived, LowLatencyHandle): `.x` [E_local, R*T, H] (bf16, or FP8 with
      `.scales` [E_local, R*T, H/128], or with `wire_format` a jax_ep.quant.Quantized of
      E_local * R*T rows), rows of local expert j ordered by source rank then
      source token, `.count` [E_local] rows used; pass the handle to `low_latency_combine`.
    """
    return low_latency_dispatch_recv(
        low_latency_dispatch_send(
            x, topk_idx, num_experts=num_experts, axis_name=axis_name, use_fp8=use_fp8,
            wire_format=wire_format, on_invalid=on_invalid, backend=backend, num_sms=num_sms,
            stream=stream, buffer=buffer,
        )
    )


@scoped("jax_ep.low_latency_combine_send")
def low_latency_combine_send(
    y: jax.Array,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    handle: LowLatencyHandle,
    *,
    backend: str = "auto",
    num_sms: int | None = None,
    stream: int | None = None,
) -> LowLatencyCombinePending:
    """Issues the sends of `low_latency_combine`; complete with `low_latency_combine_recv`."""
    op = "jax_ep.low_latency_combine"
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(
            f"{op}: handle must be the LowLatencyHandle returned by low_latency_dispatch; got "
            f"{type(handle).__name__}."
        )
    num_tokens, top_k = handle.topk_idx.shape
    experts_per_rank = handle.num_experts // handle.num_ranks
    slots = handle.num_ranks * num_tokens
    _checks.check_array(
        op, "y", y, ndim=3, dtypes=(jnp.bfloat16,), shape=(experts_per_rank, slots, None),
        expect=f"bfloat16 [E_local, R*T, H] = [{experts_per_rank}, {slots}, H]",
    )
    _checks.check_array(
        op, "topk_idx", topk_idx, ndim=2, dtypes=(jnp.int32,), shape=(num_tokens, top_k),
        expect=f"int32 [T, K] = [{num_tokens}, {top_k}], the topk_idx given to dispatch",
    )
    topk_weights = _checks.check_topk_weights(op, topk_weights, num_tokens, top_k)
    checks.same_routing(op, topk_idx, handle.topk_idx, num_experts=handle.num_experts)
    placement = _checks.placement(op, num_sms, stream, handle.buffer)
    name = backends.resolve(backend)
    send = partial(backends.get(name).low_latency_combine_send, placement=placement)
    return LowLatencyCombinePending(
        data=y if num_tokens == 0 else _inference_only(op, send, y, handle),
        topk_weights=topk_weights, handle=handle,
        backend=name, placement=placement,
    )


@scoped("jax_ep.low_latency_combine_recv")
def low_latency_combine_recv(pending: LowLatencyCombinePending) -> jax.Array:
    """Completes a `low_latency_combine_send` (placed like the send); returns bfloat16
    [T, H]."""
    if not isinstance(pending, LowLatencyCombinePending):
        raise TypeError(
            "jax_ep.low_latency_combine_recv: pending must be the value returned by "
            f"low_latency_combine_send; got {type(pending).__name__}."
        )
    recv = partial(backends.get(pending.backend).low_latency_combine_recv,
                   placement=pending.placement)
    if pending.handle.topk_idx.shape[0] == 0:  # no tokens: nothing comes home
        return jax.lax.full_like(pending.data, 0, shape=(0, pending.data.shape[2]))
    return _inference_only("jax_ep.low_latency_combine", recv, pending.data,
                           pending.topk_weights, pending.handle)


def low_latency_combine(
    y: jax.Array,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    handle: LowLatencyHandle,
    *,
    backend: str = "auto",
    num_sms: int | None = None,
    stream: int | None = None,
) -> jax.Array:
    """Top-k weighted sum of the experts' outputs at each token's home rank.

    Args:
      y: bfloat16 [E_local, R*T, H], expert outputs in the layout of low_latency_dispatch.
      topk_idx: int32 [T, K], the routing given to low_latency_dispatch (the handle holds
        it; this argument is checked for shape only).
      topk_weights: float32 [T, K] weights of the choices (bfloat16 and float16 are
        upcast).
      handle: the LowLatencyHandle of that dispatch.
      backend: "auto", "xla" or "cuda".
      num_sms, stream: where the kernels run, as in `low_latency_dispatch`.

    Returns:
      bfloat16 [T, H]: sum over k of topk_weights[t, k] * y[expert of k][slot of t], in
      float32, in k order.
    """
    return low_latency_combine_recv(
        low_latency_combine_send(y, topk_idx, topk_weights, handle, backend=backend,
                                 num_sms=num_sms, stream=stream)
    )
