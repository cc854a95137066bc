"""The portable backend: every op in pure JAX over XLA collectives (any platform).

This is the CPU default and the reference implementation that the CUDA kernels are checked
against, so it follows docs/contract.md literally, including the float32 summation orders.

Transports (`transport()`):
- "ragged" (jax_ep/backends/ragged.py): only the routed rows travel, in
  `ragged_all_to_all`; the default where JAX compiles for a GPU or TPU, over two ranks or more.
- "all_gather" (this module): fixed-size per-rank blocks of T rows. Towards the experts
  (dispatch, and the backward of combine) each rank receives every source's [T, ...] block
  with `all_gather` and picks the rows routed to it; towards the tokens' home (combine, and
  the backward of dispatch) each rank scatters its rows into one [T, ...] block per source and
  exchanges the blocks with `all_to_all`. The default on the CPU, which cannot run
  `ragged_all_to_all` (jax 0.10.2). There a padded `all_to_all` of T-row chunks delivers the
  same bytes as the `all_gather` but first builds R chunks at the sender: measured on 8 host
  devices (2 cores, T=256, H=1024, bf16, median of 20) the exchange took 60 ms with
  `all_to_all` and 36 ms with `all_gather`.
Both give the same bits; the choice is made when an op is traced, and the handles say which
transport moved their rows (`handle.ragged`).

All functions run per shard inside `shard_map` over `axis_name`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import quant, routing
from jax_ep.backends import ragged
from jax_ep.backends._rows import (
    choice_rows,
    expert_entries,
    expert_slots,
    gather_rows,
    products,
    scatter_rows,
    slot_rows,
    sum_in_order,
)
from jax_ep.placement import ANYWHERE, Placement
from jax_ep.structs import (
    DispatchHandle,
    DispatchLayout,
    LowLatencyHandle,
    LowLatencyReceived,
    Received,
)

NAME = "xla"
TRANSPORTS = ("all_gather", "ragged")
TRANSPORT_ENV_VAR = "JAX_EP_XLA_TRANSPORT"


# ---------------------------------------------------------------------------------------------
# Transport


def transport(num_ranks: int | None = None) -> str:
    """The transport the portable backend's exchanges over `num_ranks` ranks use, chosen when
    an op is traced: $JAX_EP_XLA_TRANSPORT if set, else "all_gather" where JAX compiles for the
    CPU by default (XLA:CPU cannot run ragged_all_to_all) or for one rank (nothing crosses: the
    all_gather path is local copies, while XLA's ragged_all_to_all of one rank moved 58 MB in
    23.6 ms on an H200, docs/gpu/2026-11-27-nvidia-h200-ca296ed.md), and "ragged" elsewhere."""
    name = os.environ.get(TRANSPORT_ENV_VAR, "").strip().lower()  # as every variable's value
    if name:
        if name not in TRANSPORTS:
            raise ValueError(
                f"${TRANSPORT_ENV_VAR}={name!r} is not one of {list(TRANSPORTS)}; unset it to "
                f"choose by platform."
            )
        return name
    return "all_gather" if jax.default_backend() == "cpu" or num_ranks == 1 else "ragged"


def _to_experts(block: jax.Array, axis_name: str) -> jax.Array:
    """Every rank's [T, ...] block, stacked by source rank: [R, T, ...]."""
    return lax.all_gather(block, axis_name)


def _to_home(blocks: jax.Array, axis_name: str) -> jax.Array:
    """blocks[s] goes to rank s; returns the blocks received, stacked by sender: [R, T, ...]."""
    return lax.all_to_all(blocks, axis_name, split_axis=0, concat_axis=0)


# ---------------------------------------------------------------------------------------------
# Layout


def get_dispatch_layout(
    topk_idx: jax.Array, *, num_experts: int, num_ranks: int
) -> DispatchLayout:
    idx, num_invalid = routing.clean_topk_idx(topk_idx, num_experts)
    in_rank = routing.is_token_in_rank(idx, num_experts, num_ranks)
    return DispatchLayout(
        num_tokens_per_rank=jnp.sum(in_rank, axis=0, dtype=jnp.int32),
        num_tokens_per_expert=routing.count_ids(idx, num_experts),
        is_token_in_rank=in_rank,
        num_invalid=num_invalid,
    )


# ---------------------------------------------------------------------------------------------
# Normal dispatch / combine


def dispatch(
    x: jax.Array,
    scales: jax.Array | None,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    *,
    num_experts: int,
    axis_name: str,
    capacity: int,
    expert_major: bool,
    drop_by_source: bool = False,
    transport_name: str | None = None,
    placement: Placement = ANYWHERE,
) -> tuple[Received, DispatchHandle, jax.Array]:
    """Returns (received, handle, rows or entries this rank needed before the capacity cut);
    `transport_name` overrides `transport()`."""
    if (transport_name or transport(lax.axis_size(axis_name))) == "ragged":
        return ragged.dispatch(x, scales, topk_idx, topk_weights, num_experts=num_experts,
                               axis_name=axis_name, capacity=capacity, expert_major=expert_major,
                               drop_by_source=drop_by_source)
    num_ranks = lax.axis_size(axis_name)
    rank = lax.axis_index(axis_name)
    num_tokens, top_k = topk_idx.shape
    idx, num_invalid = routing.clean_topk_idx(topk_idx, num_experts)

    # Everything the senders hold, stacked by source rank and flattened to s * T + t.
    all_idx = _to_experts(idx, axis_name).reshape(num_ranks * num_tokens, top_k)
    all_w = _to_experts(topk_weights, axis_name).reshape(num_ranks * num_tokens, top_k)
    all_x = _to_experts(x, axis_name).reshape(num_ranks * num_tokens, x.shape[1])
    all_scales = None
    if scales is not None:
        all_scales = _to_experts(scales, axis_name).reshape(num_ranks * num_tokens,
                                                             scales.shape[1])

    # Rank-major rows: sources in rank order, then token order.
    local = routing.local_choices(all_idx, num_experts, num_ranks, rank)
    goes = jnp.any(local >= 0, axis=1)
    row_of_src = jnp.cumsum(goes, dtype=jnp.int32) - 1
    needed_rows = jnp.sum(goes, dtype=jnp.int32)
    num_rows = num_ranks * num_tokens if expert_major else capacity
    kept = goes & (row_of_src < num_rows)
    src_row = jnp.where(kept, row_of_src, -1)
    recv_src = scatter_rows(
        num_rows, src_row, jnp.arange(goes.shape[0], dtype=jnp.int32), fill=-1
    )
    row_idx = gather_rows(local, recv_src, fill=-1)
    row_w = jnp.where(row_idx >= 0, gather_rows(all_w, recv_src), 0.0)

    experts_per_rank = num_experts // num_ranks
    if not expert_major:
        kept = jnp.minimum(needed_rows, capacity)
        src, ids, weights = recv_src, row_idx, row_w
        needed = needed_rows
        entry_row = entry_choice = row_entries = None
    else:
        row_source = jnp.where(recv_src >= 0, recv_src // num_tokens, -1)
        entries = expert_entries(row_idx, row_w, capacity,
                                 row_source if drop_by_source else None)
        entry_row, entry_choice = entries["entry_row"], entries["entry_choice"]
        row_entries, ids, weights = entries["row_entries"], entries["ids"], entries["weights"]
        needed = entries["needed"]
        kept = jnp.minimum(needed, capacity)
        src = gather_rows(recv_src, entry_row, fill=-1)

    tokens_per_expert = routing.count_ids(ids, experts_per_rank)
    received = Received(
        x=gather_rows(all_x, src),
        scales=None if all_scales is None else gather_rows(all_scales, src),
        topk_idx=ids,
        topk_weights=weights,
        num_tokens=kept,
        tokens_per_expert=tokens_per_expert,
        num_dropped=needed - kept,
        num_invalid=num_invalid,
        group_sizes=tokens_per_expert if expert_major else None,
    )
    handle = DispatchHandle(
        topk_idx=idx,
        recv_src=recv_src,
        src_row=src_row,
        entry_row=entry_row,
        entry_choice=entry_choice,
        row_entries=row_entries,
        num_experts=num_experts,
        num_ranks=num_ranks,
        capacity=capacity,
        expert_major=expert_major,
        axis_name=axis_name,
    )
    return received, handle, needed


def _partial_sums(y: jax.Array, weights: jax.Array | None, handle: DispatchHandle) -> jax.Array:
    """Expert-major rows -> one float32 partial per rank-major row, summed in entry order."""
    terms = y if weights is None else products(y, weights[:, None])
    # The entries of a row are sorted; its -1 slots add exact zeros.
    return sum_in_order(handle.top_k, lambda k: gather_rows(terms, handle.row_entries[:, k]))


def _on_wire(values: jax.Array, wire_format: str, move, dtype=jnp.float32) -> jax.Array:
    """`values` [N, H] quantized to `wire_format`, its data and other bytes each moved by
    `move` (a transport of rows), dequantized to `dtype` where they arrive."""
    sent = quant.quantize(values, wire_format)
    data, words = quant.to_rows(sent)
    return quant.dequantize(quant.from_rows(move(data), move(words), sent), dtype)


def combine(y: jax.Array, weights: jax.Array | None, handle: DispatchHandle, *,
            placement: Placement = ANYWHERE) -> jax.Array:
    """Sum each token's rows over the ranks that received it, in rank order (float32)."""
    num_ranks, num_tokens = handle.num_ranks, handle.num_tokens
    if handle.expert_major:
        y, weights = _partial_sums(y, weights, handle).astype(y.dtype), None
    if handle.ragged is not None:
        return ragged.combine(y, weights, handle)
    # Gathers rather than scatters: the same data movement, and much faster on XLA:CPU.
    blocks = gather_rows(y, handle.src_row)
    parts = _to_home(blocks.reshape(num_ranks, num_tokens, y.shape[1]), handle.axis_name)
    if weights is not None:  # weights travel beside the rows; the product is formed at home
        w_blocks = gather_rows(weights, handle.src_row)
        w_parts = _to_home(w_blocks.reshape(num_ranks, num_tokens), handle.axis_name)
        parts = products(parts, w_parts[:, :, None])
    return sum_in_order(num_ranks, lambda d: parts[d]).astype(y.dtype)


def combine_on_wire(y: jax.Array, weights: jax.Array | None, handle: DispatchHandle,
                    wire_format: str) -> jax.Array:
    """combine whose rows travel as `wire_format`: each rank's float32 row for a token (the
    weighted sum of its entries expert-major, the weighted row rank-major) quantized before
    it leaves, dequantized at home and summed there in float32 in rank order, cast to y's
    dtype. Over XLA's collectives whichever backend dispatched (a handle's src_row and
    row_entries mean the same on every backend), where the cuda kernels do not carry the
    format themselves (jax_ep.dispatch._casts_in_combine)."""
    if handle.expert_major:
        rows = _partial_sums(y, weights, handle)
    else:
        rows = y.astype(jnp.float32) if weights is None else products(y, weights[:, None])
    if handle.ragged is not None:
        arrived = _on_wire(rows, wire_format, lambda a: ragged._home(a, handle))
        return ragged._sum_over_ranks(arrived, handle).astype(y.dtype)
    R, T = handle.num_ranks, handle.num_tokens

    def home(a):
        blocks = gather_rows(a, handle.src_row)
        return _to_home(blocks.reshape(R, T, *a.shape[1:]), handle.axis_name)

    # A rank that holds no row of a token sends zero bytes, which some formats do not
    # dequantize to zero: its term is left out (+0.0).
    present = _to_home((handle.src_row >= 0).reshape(R, T), handle.axis_name)
    arrived = jnp.where(present[..., None], _on_wire(rows, wire_format, home), 0.0)
    return sum_in_order(R, lambda d: arrived[d]).astype(y.dtype)


def rows_for_receivers(values: jax.Array, handle: DispatchHandle, *,
                       placement: Placement = ANYWHERE) -> jax.Array:
    """Per-token `values` [T, ...] delivered to the rows (entries) of the dispatch: [N, ...].

    The data movement of dispatch, reused by the backward of combine.
    """
    if handle.ragged is not None:
        return ragged.rows_for_receivers(values, handle)
    num_ranks, num_tokens = handle.num_ranks, handle.num_tokens
    all_values = _to_experts(values, handle.axis_name)
    all_values = all_values.reshape(num_ranks * num_tokens, *values.shape[1:])
    src = handle.recv_src
    if handle.expert_major:
        src = gather_rows(handle.recv_src, handle.entry_row, fill=-1)
    return gather_rows(all_values, src)


def rows_for_receivers_on_wire(values: jax.Array, handle: DispatchHandle,
                               wire_format: str) -> jax.Array:
    """rows_for_receivers of `values` [T, H] quantized to `wire_format` at home, dequantized
    to values' dtype on arrival (the slots that hold no row get zero bytes: zeros)."""
    return _on_wire(values, wire_format, lambda a: rows_for_receivers(a, handle), values.dtype)


def weights_to_sources(d_weights: jax.Array, received_idx: jax.Array, handle: DispatchHandle,
                       *, placement: Placement = ANYWHERE):
    """Cotangent of the received topk_weights -> cotangent of the source topk_weights [T, K]."""
    num_ranks, num_tokens, top_k = handle.num_ranks, handle.num_tokens, handle.top_k
    d_weights = jnp.where(received_idx >= 0, d_weights, 0.0)
    if handle.expert_major:  # entries back into their (row, k) slots
        slot = jnp.where(
            handle.entry_row >= 0, handle.entry_row * top_k + handle.entry_choice, -1
        )
        d_weights = scatter_rows(handle.recv_src.shape[0] * top_k, slot, d_weights)
        d_weights = d_weights.reshape(-1, top_k)
    if handle.ragged is not None:
        return ragged.weights_to_sources(d_weights, handle)
    blocks = gather_rows(d_weights, handle.src_row)
    parts = _to_home(blocks.reshape(num_ranks, num_tokens, top_k), handle.axis_name)
    # Each choice lives on one rank: the other ranks add exact zeros.
    return sum_in_order(num_ranks, lambda d: parts[d])


# ---------------------------------------------------------------------------------------------
# Low-latency dispatch / combine


def low_latency_dispatch_send(
    x: jax.Array, topk_idx: jax.Array, *, num_experts: int, axis_name: str, wire: str,
    transport_name: str | None = None, placement: Placement = ANYWHERE,
):
    """First half: quantize to the `wire` format (a jax_ep.quant format, or "bf16") and move
    the tokens (data rows, and their other bytes in float32 words: quant.to_rows) and routing
    to every rank; `transport_name` overrides `transport()`."""
    idx, num_invalid = routing.clean_topk_idx(topk_idx, num_experts)
    scales = None
    if wire != "bf16":
        x, scales = quant.to_rows(quant.quantize(x, wire))
    if (transport_name or transport(lax.axis_size(axis_name))) == "ragged":
        return ragged.low_latency_dispatch_send(x, scales, idx, num_invalid,
                                                num_experts=num_experts, axis_name=axis_name)
    sent = {
        "idx": idx,
        "num_invalid": num_invalid,
        "all_idx": _to_experts(idx, axis_name),
        "all_x": _to_experts(x, axis_name),
        "all_scales": None if scales is None else _to_experts(scales, axis_name),
    }
    return sent


def low_latency_dispatch_recv(
    sent, *, num_experts: int, axis_name: str, placement: Placement = ANYWHERE
) -> tuple[LowLatencyReceived, LowLatencyHandle]:
    """Second half: lay the rows out in per-expert slots [E_local, R*T, H]."""
    if "entry_pos" in sent:  # sent by the ragged transport
        return ragged.low_latency_dispatch_recv(sent, num_experts=num_experts,
                                                axis_name=axis_name)
    num_ranks = lax.axis_size(axis_name)
    rank = lax.axis_index(axis_name)
    all_idx = sent["all_idx"]
    _, num_tokens, top_k = all_idx.shape
    experts_per_rank = num_experts // num_ranks
    local = routing.local_choices(all_idx, num_experts, num_ranks, rank)  # [R, T, K]
    flat_local = local.reshape(num_ranks * num_tokens, top_k)

    src_of_slot, slot_of, count = expert_slots(flat_local, experts_per_rank)
    slots = num_ranks * num_tokens
    x = slot_rows(sent["all_x"].reshape(slots, sent["all_x"].shape[2]), src_of_slot)
    scales = None
    if sent["all_scales"] is not None:
        scales = slot_rows(sent["all_scales"].reshape(slots, sent["all_scales"].shape[2]),
                           src_of_slot)

    src_row = choice_rows(flat_local, slot_of)
    received = LowLatencyReceived(x=x, scales=scales, count=count, num_invalid=sent["num_invalid"])
    handle = LowLatencyHandle(
        topk_idx=sent["idx"],
        src_row=src_row.reshape(num_ranks, num_tokens, top_k),
        num_experts=num_experts,
        num_ranks=num_ranks,
        axis_name=axis_name,
    )
    return received, handle


def low_latency_combine_send(y: jax.Array, handle: LowLatencyHandle, *,
                             placement: Placement = ANYWHERE) -> jax.Array:
    """First half: each rank returns, per source token and choice, its expert's output row."""
    if handle.ragged is not None:
        return ragged.low_latency_combine_send(y, handle)
    flat_y = y.reshape(-1, y.shape[2])
    src_row = handle.src_row
    rows = gather_rows(flat_y, src_row.reshape(-1)).reshape(*src_row.shape, y.shape[2])
    return _to_home(rows, handle.axis_name)  # [R(expert rank), T, K, H]


def low_latency_combine_recv(
    parts: jax.Array, topk_weights: jax.Array, handle: LowLatencyHandle, *,
    placement: Placement = ANYWHERE,
) -> jax.Array:
    """Second half: weighted sum over the top-k choices at the home rank (float32, k order)."""
    dest = routing.dest_rank(handle.topk_idx, handle.num_experts, handle.num_ranks)
    if handle.ragged is not None:  # parts: one row per (token, distinct expert)
        picked = gather_rows(parts, handle.ragged.entry_pos)
    else:
        picked = jnp.take_along_axis(parts, jnp.maximum(dest, 0)[None, :, :, None], axis=0)[0]
    weights = jnp.where(dest >= 0, topk_weights, 0.0)
    terms = products(picked, weights[:, :, None])  # [T, K, H]
    out = sum_in_order(terms.shape[1], lambda k: terms[:, k])
    return out.astype(parts.dtype)
