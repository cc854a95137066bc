"""Normal-mode dispatch and combine (training, prefill), with their backward passes.

`dispatch` sends each token once to every rank that holds one of its experts; `combine`
brings the experts' rows back and sums them at the token's home rank. Each is the other's
transpose: the VJP of dispatch is combine of the cotangents, and the VJP of combine is
dispatch (with the same handle). The exact outputs are specified in docs/contract.md.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from functools import partial
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _checks, alignment, backends, checks, fp8, quant, runtime
from jax_ep._scopes import scoped
from jax_ep.backends import xla
from jax_ep.placement import Placement
from jax_ep.structs import DispatchHandle, Received
from jax_ep.tuned import DEFAULT_NUM_SMS  # the ops' num_sms, unless the GPU's is tuned

# A capacity past the worst case only wastes memory; past this many bytes of rows it is refused.
_WASTE_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class _DispatchConfig:
    """Static configuration of one dispatch (hashable: a custom_vjp non-diff argument)."""

    backend: str
    num_experts: int
    axis_name: str
    capacity: int
    expert_major: bool
    placement: Placement
    drop_by_source: bool = False
    wire: str | None = None  # the send casts the rows to this format (_CastOnSend)
    dequantize: bool = False  # and the unpack dequantizes them to bfloat16


@dataclasses.dataclass(frozen=True)
class _CastOnSend:
    """x's bfloat16 rows [T, H], which the cuda backend's send casts to `format` itself as it
    writes them (the bytes of quant.to_rows(quant.quantize(x, format))): each row read once,
    no quantization pass in XLA; received as that Quantized, or, `dequantize`, as bfloat16
    rows that the unpack dequantized (quant.dequantize's bits; no dequantization pass)."""

    x: jax.Array
    format: str
    dequantize: bool = False

    def like(self) -> quant.Quantized:
        """The Quantized of x (shapes and types only), which the received rows form."""
        return jax.eval_shape(partial(quant.quantize, format=self.format), self.x)


def default_capacity(num_ranks: int, num_tokens: int, top_k: int, num_experts: int,
                     expert_major: bool = False) -> int:
    """The capacity of `dispatch` when none is given: R*T rows, which never overflows; when
    `expert_major`, R*T*min(K, E/R) entries, which overflows only when tokens choose the same
    expert more than once (R*T*K never does)."""
    capacity = num_ranks * num_tokens
    return capacity * min(top_k, num_experts // num_ranks) if expert_major else capacity


def capacity_from_factor(capacity_factor: float, *, num_ranks: int, num_tokens: int,
                         top_k: int, num_experts: int, expert_major: bool = False) -> int:
    """The dispatch capacity that `capacity_factor` stands for.

    capacity = ceil(capacity_factor * what a rank receives on average when every token picks
    K distinct experts uniformly at random), at most `default_capacity`:
    - rank-major, rows: R*T * (1 - C(E - E/R, K) / C(E, K)), the chance that a token has a
      choice on a given rank;
    - expert-major, entries: T*K.
    """
    experts_per_rank = num_experts // num_ranks
    if expert_major:
        average = Fraction(num_tokens * top_k)
    else:
        misses = Fraction(math.comb(num_experts - experts_per_rank, top_k),
                          math.comb(num_experts, top_k))
        average = num_ranks * num_tokens * (1 - misses)
    # The factor as its shortest decimal (1.1, not the binary float above it): 1.1 * 300
    # gives 330 entries, as written; a NumPy float32 1.1 too (its own shortest decimal).
    factor = Fraction(str(capacity_factor) if isinstance(capacity_factor, np.floating)
                      else repr(float(capacity_factor)))
    default = default_capacity(num_ranks, num_tokens, top_k, num_experts, expert_major)
    return min(default, math.ceil(factor * average))  # at least 1 when T > 0


def _check_x(op: str, x, num_tokens: int, tokens_of: str = "topk_idx has"
             ) -> tuple[jax.Array, jax.Array | None]:
    """x is [T, H] floating, the FP8 pair or a Quantized; returns (x or its data, scales or
    the Quantized's other bytes (quant.to_rows), or None)."""
    if isinstance(x, _CastOnSend):
        data, scales = x.x, None
    elif isinstance(x, quant.Quantized):
        quant.check(op, "x", x)
        _checks.check_array(op, "x.data", x.data, ndim=2, expect="[T, ...] (one row a token)")
        data, scales = quant.to_rows(x)
    elif isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(
                f"{op}: x must be an array [T, H] or the pair (x_fp8, scales); got a "
                f"{type(x).__name__} of length {len(x)}."
            )
        x_fp8, scales = x
        fp8.check_pair(op, "x[0] (x_fp8)", x_fp8, scales)
        _checks.check_array(op, "x[0] (x_fp8)", x_fp8, ndim=2, expect="float8_e4m3fn [T, H]")
        data = x_fp8
    else:
        _checks.check_float(op, "x", x, ndim=2, expect="[T, H]")
        data, scales = x, None
    if data.shape[0] != num_tokens:
        raise ValueError(
            f"{op}: x has {data.shape[0]} rows but {tokens_of} {num_tokens}; both must be "
            f"[T, ...] for the same T tokens."
        )
    return data, scales


@scoped("jax_ep.dispatch")
def dispatch(
    x: jax.Array | tuple[jax.Array, jax.Array] | quant.Quantized,
    topk_idx: jax.Array | None = None,
    topk_weights: jax.Array | None = None,
    *,
    num_experts: int | None = None,
    handle: DispatchHandle | None = None,
    axis_name: str | None = None,
    capacity: int | None = None,
    capacity_factor: float | None = None,
    expert_major: bool = False,
    expert_alignment: int | None = None,
    on_overflow: Literal["error", "drop"] = "error",
    drop_order: Literal["expert", "source"] | None = None,
    on_invalid: Literal["error", "mask"] = "error",
    wire_format: str | None = None,
    dequantize: bool = True,
    grad_wire_format: str | None = None,
    backend: str = "auto",
    num_sms: int | None = DEFAULT_NUM_SMS,
    stream: int | None = None,
) -> tuple[Received, DispatchHandle]:
    """Sends each token to the ranks that hold its chosen experts (per shard, in shard_map).

    Args:
      x: [T, H] tokens of this rank (any float dtype of 16 bits or more), the FP8 pair
        `(x_fp8 float8_e4m3fn [T, H], scales float32 [T, H/128])` from `jax_ep.fp8.quantize`,
        or a `jax_ep.quant.Quantized` of any wire format (received as one, bit for bit).
      topk_idx: int32 [T, K] expert ids in [0, E); -1 masks a choice.
      topk_weights: float32 [T, K] (bfloat16 and float16 are upcast).
      num_experts: E, a multiple of the EP axis size R.
      handle: instead of topk_idx, topk_weights and num_experts, the DispatchHandle of an
        earlier dispatch: `x` (another [T, H2] array of the same tokens, any float dtype and
        width, the FP8 pair or a Quantized) goes along that dispatch's routing into the same
        rows (entries, aligned as it aligned them), without routing again; returns those
        rows alone ([capacity, H2], zero past the count; the pair or a Quantized as `x`
        was). Its gradient is the unweighted combine of theirs, as for dispatch. The layout
        arguments (capacity, expert_major, ...) are the handle's.
      axis_name: the mesh axis of the expert-parallel group (default "ep"; with `handle`,
        the handle's).
      capacity: static rows of the output (entries when `expert_major`). Default: R*T rows,
        which never overflows; when `expert_major`, R*T*min(K, E/R) entries, which overflows
        only when tokens choose the same expert more than once (R*T*K never does).
      capacity_factor: instead of `capacity`, a multiple of what a rank receives on average
        under uniform routing: capacity = ceil(capacity_factor * R*T * (1 - C(E - E/R, K) /
        C(E, K))) rows, or ceil(capacity_factor * T*K) entries when `expert_major`, at most
        the default (see `capacity_from_factor`).
      expert_major: return one row per (token, local expert) choice grouped by expert, with
        `group_sizes` for `jax.lax.ragged_dot`, instead of one row per token.
      expert_alignment: A (expert-major only): every local expert's entries start at a
        multiple of A rows, `group_sizes` are rounded up to multiples of A (the padding rows
        are zero, with topk_idx -1 and weight 0) and `tokens_per_expert` stays the real
        counts. The capacity must be a multiple of A; the default (and a capacity_factor's)
        grows by E/R*(A - 1) rows for the padding, rounded up to a multiple of A. Costs one
        local pass over the received rows in dispatch and one in combine.
      on_overflow: what a rank that needs more than `capacity` does: it keeps the first
        `capacity` rows and reports the rest in `num_dropped` either way; "error" also
        records a check that `jax_ep.checks.checked` raises (free otherwise); "drop" does not.
      drop_order: which entries an expert-major capacity keeps: "expert" (the default) the
        first in the layout's order (by local expert, then source rank and token); "source"
        the first by source rank, then local expert, token and choice (MaxText's order: its
        receive buffer fills source by source). The kept entries are laid out by expert
        either way. Rank-major rows are kept by source rank and token ("source"; "expert" is
        refused there).
      on_invalid: ids outside [-1, E) are treated as -1 and counted in `num_invalid`;
        "error" also records a check that `jax_ep.checks.checked` raises, "mask" does not.
      wire_format: the rows travel as this `jax_ep.quant` format ("e4m3", "e4m3_ue8m0",
        "mxfp8", "nvfp4"; x in bfloat16, float16 or float32): `recv.x` is, bit for bit,
        the dispatch of `quant.quantize(x, wire_format)` dequantized to x's dtype, and x's
        gradient is the unweighted combine of the rows' (straight through the rounding);
        topk_weights' as without it. On the cuda backend with bfloat16 x the kernels
        quantize in the send and dequantize in the unpack (no pass in XLA).
      dequantize: with `wire_format`, False returns the received `Quantized` rows instead
        (for a low-precision GEMM; x is then not differentiated).
      grad_wire_format: x's gradient, the combine of the rows' gradient, travels as this
        format (`combine(..., wire_format=)`'s rule; x a float array, H a multiple of the
        format's block). With or without `wire_format`.
      backend: "auto", "xla" or "cuda" (see `jax_ep.backends`).
      num_sms: the SMs each kernel launch may take (also in the backward pass), so the rest
        can compute beside it; None: every SM. Left unset, the GPU's entry in the tuned table
        (`jax_ep.tuned`) where it has one, else DEFAULT_NUM_SMS.
      stream: None: run on XLA's compute stream. N: run on GPU stream N
        (`compute_on("gpu_stream:N")`), beside the computation that does not depend on the
        results (also in the backward pass). `num_sms` and `stream` place the "cuda"
        backend's kernels; the "xla" backend leaves placement to XLA.

    Returns:
      (Received, DispatchHandle). Pass the handle to `combine`. With `handle`: the rows.
    """
    op = "jax_ep.dispatch"
    if wire_format is not None or grad_wire_format is not None:
        options = dict(num_experts=num_experts, handle=handle, axis_name=axis_name,
                       capacity=capacity, capacity_factor=capacity_factor,
                       expert_major=expert_major, expert_alignment=expert_alignment,
                       on_overflow=on_overflow, drop_order=drop_order, on_invalid=on_invalid,
                       backend=backend, num_sms=num_sms, stream=stream)
        return _dispatch_on_wire(op, x, topk_idx, topk_weights, wire_format, dequantize,
                                 grad_wire_format, options)
    if handle is not None:
        _checks_along(op, handle, topk_idx=topk_idx, topk_weights=topk_weights,
                      num_experts=num_experts, axis_name=axis_name, capacity=capacity,
                      capacity_factor=capacity_factor, expert_major=expert_major,
                      expert_alignment=expert_alignment, drop_order=drop_order)
        return _dispatch_along(op, x, handle, backends.resolve(backend),
                               _checks.placement(op, runtime.default_num_sms(op, num_sms), stream))
    if topk_idx is None or topk_weights is None or num_experts is None:
        raise TypeError(f"{op}: pass the routing (topk_idx, topk_weights and num_experts=), "
                        f"or handle= the DispatchHandle of an earlier dispatch to send x along "
                        f"its routing.")
    axis_name = _ep_axis(axis_name)
    num_ranks = _checks.axis_size(op, axis_name)
    num_tokens, top_k = _checks.check_topk_idx(op, topk_idx)
    data, scales = _check_x(op, x, num_tokens)
    topk_weights = _checks.check_topk_weights(op, topk_weights, num_tokens, top_k)
    _checks.check_num_experts(op, num_experts, num_ranks, axis_name)
    _checks.check_top_k(op, top_k, num_experts)
    _checks.check_positive_int(op, "capacity", capacity, allow_none=True)
    if capacity_factor is not None:
        if capacity is not None:
            raise ValueError(f"{op}: pass capacity or capacity_factor, not both; got "
                             f"capacity={capacity!r} and capacity_factor={capacity_factor!r}.")
        if not _checks.is_finite_number(capacity_factor) or capacity_factor <= 0:
            raise ValueError(f"{op}: capacity_factor must be a positive finite Python float "
                             f"(a static value); got {capacity_factor!r}.")
    if not isinstance(expert_major, bool):
        raise TypeError(f"{op}: expert_major must be a bool; got {expert_major!r}.")
    align = alignment.check(op, expert_alignment, expert_major)
    _checks.check_choice(op, "on_overflow", on_overflow, _checks.OVERFLOW_POLICIES)
    if drop_order is not None:
        _checks.check_choice(op, "drop_order", drop_order, ("expert", "source"))
        if drop_order == "expert" and not expert_major:
            raise ValueError(f"{op}: drop_order='expert' orders expert-major entries; "
                             f"rank-major rows are kept by source rank and token (leave it "
                             f"out, or pass expert_major=True).")
    _checks.check_choice(op, "on_invalid", on_invalid, _checks.INVALID_POLICIES)
    placement = _checks.placement(op, runtime.default_num_sms(op, num_sms), stream)
    # Rows (entries) a rank can need at most; a capacity that large never overflows.
    worst_case = num_ranks * num_tokens * (top_k if expert_major else 1)
    default = default_capacity(num_ranks, num_tokens, top_k, num_experts, expert_major)
    if capacity_factor is not None:
        capacity = capacity_from_factor(
            float(capacity_factor), num_ranks=num_ranks, num_tokens=num_tokens, top_k=top_k,
            num_experts=num_experts, expert_major=expert_major)
    if align:  # room for the padding, in whole multiples of the alignment
        def padded(rows):
            return alignment.with_padding(rows, num_experts // num_ranks, align)

        worst_case, default = padded(worst_case), padded(default)
        if capacity_factor is not None:
            capacity = padded(capacity)
        alignment.check_capacity(op, capacity, align, default)
    if capacity is None:
        capacity = default
    row_bytes = data.shape[1] * data.dtype.itemsize
    if isinstance(x, _CastOnSend) and not x.dequantize:  # the rows as they are received
        row_bytes = quant.wire_bytes(x.format, data.shape[1])[0]
    if capacity > worst_case and capacity * row_bytes > _WASTE_BYTES:
        raise ValueError(
            f"{op}: capacity={capacity} is more than a rank can ever need ({worst_case} "
            f"{'entries' if expert_major else 'rows'}), and its received rows alone would take "
            f"{capacity * row_bytes / 2**30:.1f} GiB per rank. Pass capacity<={worst_case}, "
            f"or leave it unset for the default ({default}).")
    if num_tokens == 0:  # nothing to send: the same empty results on every backend
        received, handle = _no_tokens(data, scales, topk_idx, num_experts, num_ranks,
                                      axis_name, capacity, expert_major)
        if align:
            received, handle = alignment.align(received, handle, align)
        return _as_sent(x, (received, handle))

    config = _DispatchConfig(
        backend=backends.resolve(backend),
        num_experts=num_experts,
        axis_name=axis_name,
        capacity=capacity,
        expert_major=expert_major,
        placement=placement,
        drop_by_source=expert_major and drop_order == "source",
        wire=x.format if isinstance(x, _CastOnSend) else None,
        dequantize=isinstance(x, _CastOnSend) and x.dequantize,
    )
    received, handle, needed = _dispatch(config, data, scales, topk_idx, topk_weights)
    if config.drop_by_source:
        handle = dataclasses.replace(handle, drop_by_source=True)
    if align:
        needed = alignment.needed_rows(received, jnp.sum(needed), align)
        received, handle = alignment.align(received, handle, align)
    if on_invalid == "error":
        checks.invalid_ids(op, received.num_invalid, num_experts=num_experts)
    if on_overflow == "error" and capacity < worst_case:
        what = "expert entries" if expert_major else "token rows"
        note = f"the default, R*T = {default}, never overflows"
        if expert_major:
            note = (f"the default, R*T*min(K, E/R) = {default}, holds every entry unless tokens "
                    f"choose the same expert more than once; R*T*K = {worst_case} always does")
        if align:
            what = f"rows (expert entries and their padding to multiples of {align})"
            note = (f"the default, {default}, holds every entry and its padding unless tokens "
                    f"choose the same expert more than once; {worst_case} always does")
        checks.overflow(op, needed, capacity=capacity, what=what, default=note,
                        at_least=bool(align))
    return _as_sent(x, (received, handle))


def _checks_along(op: str, handle, **given) -> None:
    """With a handle the routing and the layout are the handle's: arguments that would set
    them again must be left out, or agree with it."""
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"{op}: handle must be the DispatchHandle of an earlier jax_ep.dispatch; "
                        f"got {type(handle).__name__}.")
    aligned = None if handle.alignment is None else handle.alignment.alignment
    agree = {"num_experts": handle.num_experts, "axis_name": handle.axis_name,
             "capacity": handle.capacity, "expert_major": handle.expert_major,
             "expert_alignment": aligned}
    for name, value in given.items():
        if value is None or (name == "expert_major" and value is False) or \
                (name in agree and value == agree[name]):
            continue  # unset (expert_major's default is False), or as the handle has it
        what = (f"the handle's is {agree[name]!r}; got {value!r}" if name in agree
                else "the handle holds the routing")
        raise ValueError(f"{op}: with handle=, x goes along the handle's dispatch: leave "
                         f"{name} out ({what}).")
    num_ranks = _checks.axis_size(op, handle.axis_name)
    if num_ranks != handle.num_ranks:
        raise ValueError(f"{op}: the handle comes from a dispatch over {handle.num_ranks} ranks "
                         f"of axis {handle.axis_name!r}, which has {num_ranks} here: use it "
                         f"in the same shard_map (mesh) as the dispatch that made it.")


@scoped("jax_ep.dispatch_along")
def _dispatch_along(op: str, x, handle: DispatchHandle, backend: str,
                    placement: Placement):
    """`x`'s rows where the handle's dispatch put its tokens' rows: the data movement of
    dispatch (combine's backward, `rows_for_receivers`), with no routing of its own."""
    data, scales = _check_x(op, x, handle.num_tokens, "the handle's dispatch had")
    rows = handle.capacity
    if handle.num_tokens == 0:
        sent = (jax.lax.full_like(data, 0, shape=(rows, data.shape[1])),
                None if scales is None else jax.lax.full_like(
                    scales, 0, shape=(rows, scales.shape[1])))
    else:
        sent = (_along(backend, placement, data, handle),
                None if scales is None else _rows_along(backend, placement, scales, handle))
        if handle.alignment is not None:
            sent = alignment.moved_rows(*sent, handle.alignment)
    if isinstance(x, quant.Quantized):
        return quant.from_rows(*sent, x)
    return sent if scales is not None else sent[0]


def _rows_along(backend, placement, values, handle):
    return backends.get(backend).rows_for_receivers(values, handle, placement=placement)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _along(backend: str, placement: Placement, data, handle):
    return _rows_along(backend, placement, data, handle)


def _along_fwd(backend, placement, data, handle):
    return _along(backend, placement, data, handle), handle


@scoped("jax_ep.dispatch_along.backward")
def _along_bwd(backend, placement, handle, d_rows):
    if not jnp.issubdtype(d_rows.dtype, jnp.floating) or d_rows.dtype.itemsize == 1:
        return None, None  # FP8 data is not differentiated
    return backends.get(backend).combine(d_rows, None, handle, placement=placement), None


_along.defvjp(_along_fwd, _along_bwd)


def _dispatch_on_wire(op: str, x, topk_idx, topk_weights, wire_format: str | None,
                      dequantize: bool, grad_wire_format: str | None, options: dict):
    """dispatch(wire_format=..., grad_wire_format=...): x's rows dispatched (with a wire
    format, its Quantized: one exchange of the quantized rows, dequantized on arrival;
    topk_weights differentiated as always), and x's gradient straight through the rounding:
    the unweighted combine of the rows' gradient, as without the wire format, travelling as
    grad_wire_format."""
    if wire_format is not None:
        _checks.check_choice(op, "wire_format", wire_format, quant.FORMATS)
    if not isinstance(dequantize, bool):
        raise TypeError(f"{op}: dequantize must be a bool; got {dequantize!r}.")
    which = "wire_format" if wire_format is not None else "grad_wire_format"
    if options["handle"] is not None:
        raise ValueError(f"{op}: {which} with handle= is not supported; send "
                         f"jax_ep.quant.quantize(x, format) along the handle.")
    _checks.check_array(op, "x", x, ndim=2,
                        dtypes=(jnp.bfloat16, jnp.float16, jnp.float32),
                        expect=f"[T, H] in bfloat16, float16 or float32 (the rows {which} "
                               f"applies to)")
    if grad_wire_format is not None and not dequantize:
        raise ValueError(f"{op}: grad_wire_format needs dequantize=True (the received "
                         f"Quantized rows are not differentiated).")
    if grad_wire_format is not None:
        quant.check_format(op, "grad_wire_format", grad_wire_format, x.shape[1],
                           "x's hidden size")
    sent = jax.lax.stop_gradient(x)
    fused = _casts_on_send(wire_format, x, options["backend"])
    # The send quantizes and, between devices, the unpack dequantizes (a single rank runs as
    # virtual ranks, whose kernels write the rows as they travel).
    unpacked = fused and dequantize and _checks.axis_size(op, _ep_axis(options["axis_name"])) > 1
    if fused:
        sent = _CastOnSend(sent, wire_format, unpacked)
    elif wire_format is not None:
        sent = quant.quantize(sent, wire_format)
    received, handle = dispatch(sent, topk_idx, topk_weights, **options)
    if not dequantize:
        return received, handle
    rows = received.x
    if wire_format is not None and not unpacked:
        rows = quant.dequantize(rows, x.dtype)
    back = _placement_options(options) + (("wire_format", grad_wire_format),)
    rows = _straight_through(back, x, jax.lax.stop_gradient(rows), handle)
    return dataclasses.replace(received, x=rows), handle


def _ep_axis(axis_name: str | None) -> str:
    """The mesh axis dispatch runs over: `axis_name`, or "ep" when none is given."""
    return "ep" if axis_name is None else axis_name


def _casts_on_send(wire_format: str | None, x, backend: str) -> bool:
    """Whether the cuda backend's send quantizes x's rows itself: bfloat16 rows of whole
    blocks of the format (others are quantized in XLA first, or refused there), at least one
    token (none: the padding alone, as for any Quantized)."""
    return (wire_format is not None and x.dtype == jnp.bfloat16 and x.shape[0] > 0
            and x.shape[1] % quant.BLOCKS[wire_format] == 0
            and backends.resolve(backend) == "cuda")


def _placement_options(options: dict) -> tuple:
    return tuple((k, options[k]) for k in ("backend", "num_sms", "stream"))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _straight_through(back: tuple, x, rows, handle):
    """`rows` (x's dispatched, rounded rows) with x's gradient the unweighted combine of
    theirs, as a dispatch of x has; `back`: that combine's keyword arguments."""
    del back, x, handle
    return rows


def _straight_through_fwd(back, x, rows, handle):
    return rows, handle


def _straight_through_bwd(back, handle, d_rows):
    return combine(d_rows, handle, **dict(back)), None, None


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


def _as_sent(x, result: tuple[Received, DispatchHandle]) -> tuple[Received, DispatchHandle]:
    """The received rows in the form `x` was given: a Quantized arrives as one (its format,
    bit for bit), the FP8 pair and floats as they are."""
    received, handle = result
    if isinstance(x, quant.Quantized) or (isinstance(x, _CastOnSend) and not x.dequantize):
        like = x.like() if isinstance(x, _CastOnSend) else x
        rows = quant.from_rows(received.x, received.scales, like)
        received = dataclasses.replace(received, x=rows, scales=None)
    return received, handle


def _no_tokens(data, scales, topk_idx, num_experts, num_ranks, axis_name, capacity,
               expert_major) -> tuple[Received, DispatchHandle]:
    """dispatch of T = 0 tokens: padding only (typed like the inputs, as the backends'
    results are), zero counts."""
    top_k = topk_idx.shape[1]
    experts_per_rank = num_experts // num_ranks
    per_row = (capacity,) if expert_major else (capacity, top_k)

    def ints(value, shape):
        return jax.lax.full_like(topk_idx, value, shape=shape)

    zero = ints(0, ())
    tokens_per_expert = ints(0, (experts_per_rank,))
    received = Received(
        x=jax.lax.full_like(data, 0, shape=(capacity, data.shape[1])),
        scales=None if scales is None else jax.lax.full_like(
            scales, 0, shape=(capacity, scales.shape[1])),
        topk_idx=ints(-1, per_row), topk_weights=jax.lax.full_like(
            topk_idx, 0, shape=per_row, dtype=jnp.float32),
        num_tokens=zero, tokens_per_expert=tokens_per_expert, num_dropped=zero,
        num_invalid=zero, group_sizes=tokens_per_expert if expert_major else None,
    )
    entries = ints(-1, (capacity,)) if expert_major else None
    handle = DispatchHandle(
        topk_idx=topk_idx, recv_src=ints(-1, (0 if expert_major else capacity,)),
        src_row=ints(-1, (0,)), entry_row=entries, entry_choice=entries,
        row_entries=ints(-1, (0, top_k)) if expert_major else None, num_experts=num_experts,
        num_ranks=num_ranks, capacity=capacity, expert_major=expert_major, axis_name=axis_name,
    )
    return received, handle


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(config: _DispatchConfig, x, scales, topk_idx, topk_weights):
    cast = {}  # the cuda backend's only
    if config.wire is not None:
        cast = {"wire": config.wire, "dequantize": config.dequantize}
    return backends.get(config.backend).dispatch(
        x,
        scales,
        topk_idx,
        topk_weights,
        num_experts=config.num_experts,
        axis_name=config.axis_name,
        capacity=config.capacity,
        expert_major=config.expert_major,
        drop_by_source=config.drop_by_source,
        placement=config.placement,
        **cast,
    )


def _dispatch_fwd(config, x, scales, topk_idx, topk_weights):
    out = _dispatch(config, x, scales, topk_idx, topk_weights)
    received, handle, _ = out
    return out, (handle, received.topk_idx)


@scoped("jax_ep.dispatch.backward")
def _dispatch_bwd(config, residuals, cotangents):
    handle, received_idx = residuals
    d_received = cotangents[0]
    backend = backends.get(config.backend)
    d_weights = backend.weights_to_sources(d_received.topk_weights, received_idx, handle,
                                           placement=config.placement)
    if d_received.scales is not None:  # FP8 data is not differentiated: a zero cotangent
        d_x = None
    else:
        d_x = backend.combine(d_received.x, None, handle, placement=config.placement)
    return d_x, None, None, d_weights


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@scoped("jax_ep.combine")
def combine(
    y: jax.Array,
    handle: DispatchHandle,
    *,
    topk_weights: jax.Array | None = None,
    partial_dtype: jnp.dtype | type | None = None,
    wire_format: str | None = None,
    grad_wire_format: str | None = None,
    backend: str = "auto",
    num_sms: int | None = DEFAULT_NUM_SMS,
    stream: int | None = None,
) -> jax.Array:
    """Sums each token's rows over the ranks that received it, at the token's home rank.

    Args:
      y: [capacity, H] rows in the layout `dispatch` returned (rank-major rows or
        expert-major entries), any float dtype of 16 bits or more.
      handle: the DispatchHandle of that dispatch.
      topk_weights: optional float32 [capacity], a weight per row (entry): typically the
        received `topk_weights` of each expert-major entry, so the weighted expert outputs
        are reduced per rank before they travel.
      partial_dtype: expert-major, the dtype each rank's float32 partial sum of a token
        travels in (default y.dtype, where bfloat16 rounds it once before the home's sum);
        jnp.float32 keeps it unrounded for twice the bytes on the wire (and a cast of y).
        The result is in y.dtype either way; the backward pass is unchanged.
      wire_format: the rows travel home as this `jax_ep.quant` format ("e4m3",
        "e4m3_ue8m0", "mxfp8", "nvfp4"; H a multiple of its block): each rank's float32
        row for a token (expert-major the weighted sum of its entries, rank-major the
        weighted row) is quantized before it leaves and dequantized at home, where the sum
        is taken as always (docs/contract.md). The backward pass is unchanged (straight
        through the rounding). On the cuda backend with bfloat16 y between devices the
        kernels cast in their stages and dequantize in their sums; elsewhere the rows go
        through XLA's collectives.
      grad_wire_format: the backward pass sends d(out)'s rows to the receivers as this
        format (quantized at home, dequantized to d(out)'s dtype on arrival; H a multiple
        of its block): y's and the weights' gradients are the rule's on those values. On
        the cuda backend with bfloat16 d(out) between devices, the dispatch's send casts
        and its unpack dequantizes; elsewhere XLA's collectives carry it.
      backend: "auto", "xla" or "cuda".
      num_sms, stream: where the kernels run, also in the backward pass; as in `dispatch`.

    Returns:
      [T, H] in y.dtype: the float32 sum, in rank order (docs/contract.md, "combine").
    """
    op = "jax_ep.combine"
    placement = _checks.placement(op, runtime.default_num_sms(op, num_sms), stream)
    if not isinstance(handle, DispatchHandle):
        raise TypeError(
            f"{op}: handle must be the DispatchHandle returned by jax_ep.dispatch; got "
            f"{type(handle).__name__}."
        )
    rows = handle.capacity
    layout = "entries" if handle.expert_major else "rows"
    _checks.check_float(op, "y", y, ndim=2, expect=f"[capacity, H] = [{rows}, H] ({layout})")
    if y.shape[0] != rows:
        raise ValueError(
            f"{op}: y must have one row per dispatched {layout[:-1]}, [{rows}, H] (the "
            f"dispatch capacity); got {_checks.describe(y)}."
        )
    if topk_weights is not None:
        _checks.check_array(
            op, "topk_weights", topk_weights, ndim=1, dtypes=(jnp.float32,), shape=(rows,),
            expect=f"float32 [{rows}] (one weight per row of y)",
            fix=("Pass recv.topk_weights as dispatch returned it." if handle.expert_major else
                 "Rank-major rows carry a token's K weights (recv.topk_weights, [capacity, "
                 "K]): weight each expert's output by them in y, then combine(y, handle) "
                 "without topk_weights (or pass one weight per row)."),
        )
    if partial_dtype is not None:
        if not handle.expert_major:
            raise ValueError(f"{op}: partial_dtype applies to expert-major combines (rank-major "
                             f"rows travel as they are and are summed in float32 at home, "
                             f"rounded nowhere before); leave it out.")
        if jnp.dtype(partial_dtype) != jnp.float32:
            raise ValueError(f"{op}: partial_dtype must be jnp.float32 (or None: y's dtype); "
                             f"got {partial_dtype!r}.")
        partial_dtype = "float32"
    if wire_format is not None and partial_dtype is not None:
        raise ValueError(f"{op}: pass partial_dtype or wire_format, not both (the wire "
                         f"format's rows are quantized from float32).")
    for name, f in (("wire_format", wire_format), ("grad_wire_format", grad_wire_format)):
        if f is not None:
            quant.check_format(op, name, f, y.shape[1], "y's hidden size")
    if handle.num_tokens == 0:  # a dispatch of no tokens: nothing comes home
        return jax.lax.full_like(y, 0, shape=(0, y.shape[1]))
    if handle.alignment is not None:
        y, topk_weights = alignment.unalign(y, topk_weights, handle)
    wire = _Wire(partial_dtype, wire_format, grad_wire_format)
    return _combine(backends.resolve(backend), placement, wire, y, topk_weights, handle)


class _Wire(NamedTuple):
    """How a combine's rows travel: the partial sums in `partial_dtype` (None: y's dtype;
    "float32") or as `format`, and its backward's rows (d(out) sent to the receivers) as
    `grad_format` (None: in d(out)'s dtype)."""

    partial_dtype: str | None
    format: str | None
    grad_format: str | None


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _combine(backend: str, placement: Placement, wire: _Wire, y, weights, handle):
    """The combine, its rows travelling as `wire` says (with float32 partials, y is cast
    first: the sums of float32 partials are y's float32 values anyway). The result is in y's
    dtype."""
    if wire.format is not None and _casts_in_combine(backend, y, handle):
        return backends.get(backend).combine(y, weights, handle, placement=placement,
                                             wire=wire.format)
    if wire.format is not None:
        return xla.combine_on_wire(y, weights, handle, wire.format)
    rows = y if wire.partial_dtype is None else y.astype(wire.partial_dtype)
    out = backends.get(backend).combine(rows, weights, handle, placement=placement)
    return out.astype(y.dtype)


def _casts_in_combine(backend: str, y, handle: DispatchHandle) -> bool:
    """Whether the cuda backend's kernels carry a combine's wire format themselves (each
    stage casts the rows it stages, the home's sums dequantize them), or its backward's (the
    dispatch along the handle's routing casts in its send and dequantizes in its unpack):
    bfloat16 rows `y`, one rank per device. Virtual ranks (a single rank runs as one) sum
    the rows where they are, so nothing travels to cast: XLA's collectives carry the format
    there."""
    return backend == "cuda" and y.dtype == jnp.bfloat16 and handle.num_ranks > 1


def _combine_fwd(backend, placement, wire, y, weights, handle):
    return _combine(backend, placement, wire, y, weights, handle), (y, weights, handle)


@scoped("jax_ep.combine.backward")
def _combine_bwd(backend, placement, wire, residuals, d_out):
    y, weights, handle = residuals
    if wire.grad_format is not None and _casts_in_combine(backend, d_out, handle):
        rows = backends.get(backend).rows_for_receivers(d_out, handle, placement=placement,
                                                        wire=wire.grad_format)
    elif wire.grad_format is not None:
        rows = xla.rows_for_receivers_on_wire(d_out, handle, wire.grad_format)
    else:
        rows = backends.get(backend).rows_for_receivers(d_out, handle, placement=placement)
    if weights is None:
        return rows.astype(y.dtype), None, None
    rows = rows.astype(jnp.float32)
    # Rows past the count may hold anything, their weights too (docs/contract.md, "Padding"):
    # select, so that their cotangents are +0 whatever the weight (-0.0 or NaN otherwise).
    carried = (handle.entry_row if handle.expert_major else handle.recv_src) >= 0
    d_y = jnp.where(carried[:, None], rows * weights[:, None], 0.0).astype(y.dtype)
    d_weights = jnp.where(carried, jnp.sum(rows * y.astype(jnp.float32), axis=1), 0.0)
    return d_y, d_weights, None


_combine.defvjp(_combine_fwd, _combine_bwd)
