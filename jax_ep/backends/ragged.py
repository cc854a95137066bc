"""The portable backend's ragged transport: only the routed rows travel.

Each payload (rows, their routing, FP8 scales) crosses in one `jax.lax.ragged_all_to_all`.
A sender packs its rows by destination rank, in token order; a receiver gets them packed by
source rank, so rank-major order comes out of the exchange itself. Sizes and offsets come from
one matrix, counts[s, d] = rows rank s sends to rank d, which one small `all_gather` of each
rank's counts gives every rank: `ragged_all_to_all` takes the offset of a sender's rows in the
*receiver's* buffer, and that depends on what the ranks before it send there. The way back
(combine, and the backward of dispatch) is the same exchange with the matrix transposed.

Receive buffers are static: `capacity` rows for rank-major dispatch; for expert-major,
min(capacity, R*T) rows, only those that hold a kept entry; R*T rows for low-latency
dispatch; on the way home, min(K, R) rows per token (K for low-latency combine).

Expert-major dispatch with a capacity that can overflow needs a second small `all_gather`:
which rows hold a kept entry depends on every rank's entry counts per expert (the first), and
the receivers' offsets on how many such rows each rank sends (the second).

XLA:CPU cannot run `ragged_all_to_all` (jax 0.10.2). There a pure-JAX model of its
documented semantics, built on `all_to_all`, runs in its place (chosen per platform when the
program is lowered), so CI checks every size and offset of this transport.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_ep import routing
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
from jax_ep.structs import (
    DispatchHandle,
    LowLatencyHandle,
    LowLatencyReceived,
    RaggedEntries,
    RaggedRows,
    Received,
)

_NONE = jnp.iinfo(jnp.int32).max  # sorts after every packed row


def _exclusive_cumsum(a: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(a, axis=axis, dtype=jnp.int32) - a


# ---------------------------------------------------------------------------------------------
# The exchange


def modelled_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """`lax.ragged_all_to_all`'s documented semantics in pure JAX, on `all_to_all`.

    Rank r sends operand[input_offsets[d] : + send_sizes[d]] to each rank d, which writes it
    at output[output_offsets[d] : + send_sizes[d]] (offsets in the receiver's buffer) and
    expects recv_sizes[r] rows from r; rows nobody writes keep `output`'s values. Each
    destination's rows travel padded to the operand's length.
    """
    length = operand.shape[0]
    if length == 0:  # nothing to send (and so, in a consistent call, nothing to receive)
        return output
    i = jnp.arange(length, dtype=jnp.int32)
    src = jnp.where(i < send_sizes[:, None], input_offsets[:, None] + i, length)
    blocks = jnp.take(operand, src, axis=0, mode="fill", fill_value=0)  # [R, length, ...]
    got = lax.all_to_all(blocks, axis_name, 0, 0)
    where = lax.all_to_all(output_offsets, axis_name, 0, 0)  # each sender's offset here
    dst = jnp.where(i < recv_sizes[:, None], where[:, None] + i, output.shape[0])
    return output.at[dst.reshape(-1)].set(got.reshape(-1, *operand.shape[1:]), mode="drop")


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      *, axis_name):
    """`lax.ragged_all_to_all` where XLA runs it (GPU, TPU), its model on the CPU."""
    return lax.platform_dependent(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
        cpu=partial(modelled_ragged_all_to_all, axis_name=axis_name),
        default=partial(lax.ragged_all_to_all, axis_name=axis_name),
    )


def exchange(rows: jax.Array, num_out: int, counts: jax.Array, axis_name: str) -> jax.Array:
    """rows [N, ...] packed by destination rank -> [num_out, ...] packed by source rank,
    zeros after them; counts[s, d]: rows rank s sends to rank d."""
    rank = lax.axis_index(axis_name)
    sends = counts[rank]
    # Typed like the rows (varying over the same mesh axes): the platforms' branches agree.
    output = lax.full_like(rows, 0, shape=(num_out, *rows.shape[1:]))
    return ragged_all_to_all(rows, output, _exclusive_cumsum(sends), sends,
                             _exclusive_cumsum(counts)[rank], counts[:, rank],
                             axis_name=axis_name)


# ---------------------------------------------------------------------------------------------
# Packing


def _plan(keep: jax.Array, counts: jax.Array, axis_name: str, top_k: int) -> RaggedRows:
    """The layout of the rows this rank sends: keep[t, d], token t sends a row to rank d."""
    rank = lax.axis_index(axis_name)
    within = jnp.cumsum(keep, axis=0, dtype=jnp.int32) - 1
    packed = jnp.where(keep, _exclusive_cumsum(counts[rank]) + within, _NONE)
    # A token's rows are packed in rank order, so sorting its slots sorts its destinations.
    slots = jnp.sort(packed, axis=1)[:, : min(top_k, keep.shape[1])]
    return RaggedRows(counts=counts, slots=jnp.where(slots < _NONE, slots, -1))


def _packed_tokens(slots: jax.Array) -> jax.Array:
    """int32 [T * min(K, R)]: the token of each packed row, -1 past them."""
    num_tokens, width = slots.shape
    tokens = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], slots.shape)
    return scatter_rows(num_tokens * width, slots.reshape(-1), tokens.reshape(-1), fill=-1)


def _packed_routing(plan: RaggedRows, keep, idx, experts_per_rank, weights=None):
    """int32 [T * min(K, R), C] for each packed row: the local expert of each choice on its
    destination (-1 elsewhere), the weights' bits if given, then the token."""
    num_tokens, top_k = idx.shape
    width = plan.slots.shape[1]
    num_ranks = keep.shape[1]
    dests = jnp.sort(jnp.where(keep, jnp.arange(num_ranks), num_ranks), axis=1)[:, :width]
    dest = routing.dest_rank(idx, experts_per_rank * num_ranks, num_ranks)
    on = dest[:, None, :] == dests[:, :, None]  # [T, width, K]
    columns = [jnp.where(on, idx[:, None, :] - dests[:, :, None] * experts_per_rank, -1)]
    if weights is not None:
        bits = lax.bitcast_convert_type(weights.astype(jnp.float32), jnp.int32)
        columns.append(jnp.where(on, bits[:, None, :], 0))
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)[:, None, None]
    columns.append(jnp.broadcast_to(tokens, (num_tokens, width, 1)))
    table = jnp.concatenate(columns, axis=2)
    table = table.reshape(num_tokens * width, table.shape[2])
    return scatter_rows(num_tokens * width, plan.slots.reshape(-1), table)


def _received(meta: jax.Array, counts: jax.Array, axis_name: str, num_tokens: int, top_k: int):
    """From the packed routing received: (row_local [N, K], -1 past the rows; recv_src [N],
    s * T + t of each row, -1 past them)."""
    rank = lax.axis_index(axis_name)
    arrived = counts[:, rank]
    i = jnp.arange(meta.shape[0], dtype=jnp.int32)
    here = i < jnp.sum(arrived)
    source = jnp.searchsorted(jnp.cumsum(arrived), i, side="right").astype(jnp.int32)
    recv_src = jnp.where(here, source * num_tokens + meta[:, -1], -1)
    return jnp.where(here[:, None], meta[:, :top_k], -1), recv_src


def _rows_with_kept_entries(idx, capacity: int, num_experts: int, axis_name: str,
                            drop_by_source: bool):
    """Expert-major dispatch whose capacity can overflow: (keep [T, R], the rows of this
    rank that hold an entry among the first `capacity` of its destination's entries, in
    sorted order or, `drop_by_source`, in order of source, then local expert; the entries
    this rank receives before the cut)."""
    num_ranks, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
    num_tokens, top_k = idx.shape
    experts_per_rank = num_experts // num_ranks
    mine = routing.count_ids(idx, num_experts)
    per_rank = lax.all_gather(mine, axis_name)  # [R, E]: entries of rank s for expert e
    total = jnp.sum(per_rank, axis=0).reshape(num_ranks, experts_per_rank)
    if drop_by_source:
        # An entry's place among its destination's entries in source order: those of the
        # earlier ranks there, this rank's of the lower local experts, its earlier ones.
        to_dest = jnp.sum(per_rank.reshape(num_ranks, num_ranks, experts_per_rank), axis=2)
        earlier = _exclusive_cumsum(to_dest)[rank]  # [R]: per destination
        lower = _exclusive_cumsum(mine.reshape(num_ranks, experts_per_rank), 1)
        base = (earlier[:, None] + lower).reshape(-1)
    else:
        # An entry's place among its destination's sorted entries: those of the lower local
        # experts there, those of its expert from earlier ranks, then this rank's earlier
        # ones.
        base = _exclusive_cumsum(total, 1).reshape(-1) + _exclusive_cumsum(per_rank)[rank]
    flat = idx.reshape(-1)
    order = jnp.argsort(jnp.where(flat >= 0, flat, num_experts), stable=True)
    first = gather_rows(_exclusive_cumsum(mine), flat[order])
    within = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.shape[0]) - first)
    position = gather_rows(base, flat, fill=capacity) + within
    kept = ((flat >= 0) & (position < capacity)).reshape(num_tokens, top_k)
    keep = routing.is_token_in_rank(jnp.where(kept, idx, -1), num_experts, num_ranks)
    return keep, jnp.sum(total[rank])


# ---------------------------------------------------------------------------------------------
# Normal dispatch / combine


def dispatch(x, scales, topk_idx, topk_weights, *, num_experts: int, axis_name: str,
             capacity: int, expert_major: bool, drop_by_source: bool = False):
    """As the all_gather transport's `dispatch` (same results), moving only routed rows."""
    num_ranks, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
    num_tokens, top_k = topk_idx.shape
    experts_per_rank = num_experts // num_ranks
    idx, num_invalid = routing.clean_topk_idx(topk_idx, num_experts)
    in_rank = routing.is_token_in_rank(idx, num_experts, num_ranks)

    needed = None
    if expert_major and capacity < num_ranks * num_tokens * min(top_k, experts_per_rank):
        num_rows = min(capacity, num_ranks * num_tokens)
        keep, needed = _rows_with_kept_entries(idx, capacity, num_experts, axis_name,
                                               drop_by_source)
        counts = lax.all_gather(jnp.sum(keep, axis=0, dtype=jnp.int32), axis_name)
    else:
        num_rows = num_ranks * num_tokens if expert_major else capacity
        wanted = lax.all_gather(jnp.sum(in_rank, axis=0, dtype=jnp.int32), axis_name)
        counts = jnp.clip(num_rows - _exclusive_cumsum(wanted), 0, wanted)
        keep = in_rank & (jnp.cumsum(in_rank, axis=0, dtype=jnp.int32) <= counts[rank])
        if not expert_major:
            needed = jnp.sum(wanted[:, rank])
    plan = _plan(keep, counts, axis_name, top_k)
    send_src = _packed_tokens(plan.slots)

    def send(rows):
        return exchange(rows, num_rows, counts, axis_name)

    meta = send(_packed_routing(plan, keep, idx, experts_per_rank, topk_weights))
    got_x = send(gather_rows(x, send_src))
    got_scales = None if scales is None else send(gather_rows(scales, send_src))
    row_idx, recv_src = _received(meta, counts, axis_name, num_tokens, top_k)
    row_w = jnp.where(row_idx >= 0,
                      lax.bitcast_convert_type(meta[:, top_k:2 * top_k], jnp.float32), 0.0)
    src_row = scatter_rows(num_ranks * num_tokens, recv_src,
                           jnp.arange(num_rows, dtype=jnp.int32), fill=-1)

    entry_row = entry_choice = row_entries = None
    ids, weights = row_idx, row_w
    if expert_major:
        row_source = jnp.where(recv_src >= 0, recv_src // num_tokens, -1)
        entries = expert_entries(row_idx, row_w, capacity,
                                 row_source if drop_by_source else None)
        entry_row, entry_choice = entries["entry_row"], entries["entry_choice"]
        row_entries, ids, weights = entries["row_entries"], entries["ids"], entries["weights"]
        kept = jnp.minimum(entries["needed"], capacity)
        needed = entries["needed"] if needed is None else needed
        got_x = gather_rows(got_x, entry_row)
        got_scales = None if got_scales is None else gather_rows(got_scales, entry_row)
    else:
        kept = jnp.sum(counts[:, rank])

    tokens_per_expert = routing.count_ids(ids, experts_per_rank)
    received = Received(
        x=got_x, scales=got_scales, topk_idx=ids, topk_weights=weights, num_tokens=kept,
        tokens_per_expert=tokens_per_expert, num_dropped=needed - kept, num_invalid=num_invalid,
        group_sizes=tokens_per_expert if expert_major else None,
    )
    handle = DispatchHandle(
        topk_idx=idx, recv_src=recv_src, src_row=src_row, entry_row=entry_row,
        entry_choice=entry_choice, row_entries=row_entries, num_experts=num_experts,
        num_ranks=num_ranks, capacity=capacity, expert_major=expert_major,
        axis_name=axis_name, ragged=plan,
    )
    return received, handle, needed


def _home(rows: jax.Array, handle: DispatchHandle) -> jax.Array:
    """Rank-major rows [N, ...] back to their home rank, packed like its sends."""
    plan = handle.ragged
    return exchange(rows, plan.slots.size, plan.counts.T, handle.axis_name)


def _sum_over_ranks(back: jax.Array, handle: DispatchHandle) -> jax.Array:
    """Each token's rows in `back` summed in float32 over its ranks in ascending order (the
    ranks it did not go to add zeros in the all_gather transport, which leave a float32 sum
    from 0.0 unchanged)."""
    slots = handle.ragged.slots
    return sum_in_order(slots.shape[1], lambda j: gather_rows(back, slots[:, j]))


def combine(rows: jax.Array, weights: jax.Array | None, handle: DispatchHandle) -> jax.Array:
    """Rank-major rows (expert-major ones already reduced per row) summed at home."""
    back = _home(rows, handle)
    if weights is not None:  # weights travel beside the rows; the product is formed at home
        back = products(back, _home(weights, handle)[:, None])
    return _sum_over_ranks(back, handle).astype(rows.dtype)


def rows_for_receivers(values: jax.Array, handle: DispatchHandle) -> jax.Array:
    """Per-token `values` [T, ...] delivered to the rows (entries) of the dispatch."""
    plan = handle.ragged
    rows = exchange(gather_rows(values, _packed_tokens(plan.slots)), handle.recv_src.shape[0],
                    plan.counts, handle.axis_name)
    return gather_rows(rows, handle.entry_row) if handle.expert_major else rows


def weights_to_sources(d_weights: jax.Array, handle: DispatchHandle) -> jax.Array:
    """Rank-major rows of weight cotangents [N, K] -> [T, K] (each choice lives on one
    rank: its row elsewhere holds zeros there)."""
    return _sum_over_ranks(_home(d_weights, handle), handle)


# ---------------------------------------------------------------------------------------------
# Low-latency dispatch / combine


def _first_choices(idx: jax.Array) -> jax.Array:
    """int32 [T, K]: for each choice, the first k with the same id in its row."""
    return jnp.argmax(idx[:, :, None] == idx[:, None, :], axis=2).astype(jnp.int32)


def low_latency_dispatch_send(x, scales, idx, num_invalid, *, num_experts: int,
                              axis_name: str):
    """First half: each token's row once to each rank that holds one of its experts."""
    num_ranks, rank = lax.axis_size(axis_name), lax.axis_index(axis_name)
    num_tokens, top_k = idx.shape
    in_rank = routing.is_token_in_rank(idx, num_experts, num_ranks)
    dest = routing.dest_rank(idx, num_experts, num_ranks)
    # One row per (token, distinct expert) comes back: a duplicate shares its first's.
    first = _first_choices(idx)
    pairs = (first == jnp.arange(top_k)) & (idx >= 0)
    pair_on = (pairs[:, :, None] & (dest[:, :, None] == jnp.arange(num_ranks)))
    pair_on = pair_on.reshape(num_tokens * top_k, num_ranks)
    both = lax.all_gather(
        jnp.stack([jnp.sum(in_rank, axis=0, dtype=jnp.int32),
                   jnp.sum(pair_on, axis=0, dtype=jnp.int32)]), axis_name)
    counts, pair_counts = both[:, 0], both[:, 1]

    plan = _plan(in_rank, counts, axis_name, top_k)
    num_rows = num_ranks * num_tokens
    send_src = _packed_tokens(plan.slots)
    experts_per_rank = num_experts // num_ranks
    meta = exchange(_packed_routing(plan, in_rank, idx, experts_per_rank), num_rows, counts,
                    axis_name)
    got_x = exchange(gather_rows(x, send_src), num_rows, counts, axis_name)
    got_scales = None
    if scales is not None:
        got_scales = exchange(gather_rows(scales, send_src), num_rows, counts, axis_name)

    # Where each choice's row comes back at home: its destination's pairs start there.
    within = jnp.cumsum(pair_on, axis=0, dtype=jnp.int32) - 1
    within = jnp.take_along_axis(within.reshape(num_tokens, top_k, num_ranks),
                                 jnp.maximum(dest, 0)[:, :, None], axis=2)[:, :, 0]
    pos = _exclusive_cumsum(pair_counts[rank])[jnp.maximum(dest, 0)] + within
    entry_pos = jnp.where(idx >= 0, jnp.take_along_axis(pos, first, axis=1), -1)
    return {"idx": idx, "num_invalid": num_invalid, "x": got_x, "scales": got_scales,
            "meta": meta, "counts": counts, "pair_counts": pair_counts, "entry_pos": entry_pos}


def low_latency_dispatch_recv(sent, *, num_experts: int, axis_name: str):
    """Second half: the rows received (by source rank, then token) into per-expert slots."""
    num_ranks = lax.axis_size(axis_name)
    num_tokens, top_k = sent["idx"].shape
    experts_per_rank = num_experts // num_ranks
    row_local, recv_src = _received(sent["meta"], sent["counts"], axis_name, num_tokens, top_k)
    src_of_slot, slot_of, count = expert_slots(row_local, experts_per_rank)
    x = slot_rows(sent["x"], src_of_slot)
    scales = None if sent["scales"] is None else slot_rows(sent["scales"], src_of_slot)
    rows = choice_rows(row_local, slot_of)  # [R*T, K]

    # The way back: one row per (received row, distinct expert), in order of row then choice.
    pairs = (_first_choices(row_local) == jnp.arange(top_k)) & (row_local >= 0)
    pair_slot = jnp.cumsum(pairs.reshape(-1), dtype=jnp.int32) - 1
    entry_src = scatter_rows(num_ranks * num_tokens * min(top_k, experts_per_rank),
                             jnp.where(pairs.reshape(-1), pair_slot, -1), rows.reshape(-1),
                             fill=-1)
    src_row = scatter_rows(num_ranks * num_tokens, recv_src, rows, fill=-1)
    received = LowLatencyReceived(x=x, scales=scales, count=count, num_invalid=sent["num_invalid"])
    handle = LowLatencyHandle(
        topk_idx=sent["idx"], src_row=src_row.reshape(num_ranks, num_tokens, top_k),
        num_experts=num_experts, num_ranks=num_ranks, axis_name=axis_name,
        ragged=RaggedEntries(counts=sent["pair_counts"], entry_src=entry_src,
                             entry_pos=sent["entry_pos"]),
    )
    return received, handle


def low_latency_combine_send(y: jax.Array, handle: LowLatencyHandle) -> jax.Array:
    """First half: each (token, distinct expert) row home: [T*K, H], by expert rank."""
    plan = handle.ragged
    rows = gather_rows(y.reshape(-1, y.shape[2]), plan.entry_src)
    return exchange(rows, handle.topk_idx.size, plan.counts.T, handle.axis_name)
