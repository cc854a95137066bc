"""Local row work of the portable backend, shared by its two transports (all_gather, ragged):
gathers and scatters with -1 as "none", float32 sums in a fixed order, and the layouts a
receiver builds from the rows it got (expert-major entries, low-latency slots).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def gather_rows(table: jax.Array, index: jax.Array, fill: int | float = 0) -> jax.Array:
    """table[index] along axis 0, with `fill` where index is -1 (or out of range)."""
    n = table.shape[0]
    safe = jnp.where((index >= 0) & (index < n), index, n)
    return jnp.take(table, safe, axis=0, mode="fill", fill_value=fill)


def scatter_rows(
    num_rows: int, index: jax.Array, rows: jax.Array, fill: int | float = 0
) -> jax.Array:
    """[num_rows, ...] of `fill` with rows[i] written at index[i]; index -1 is skipped."""
    safe = jnp.where(index >= 0, index, num_rows)
    out = jnp.full((num_rows, *rows.shape[1:]), fill, rows.dtype)
    return out.at[safe].set(rows, mode="drop")


def sum_in_order(count: int, term) -> jax.Array:
    """float32 `term(0) + term(1) + ...` strictly in that order, starting from 0.0.

    The sum runs in a loop, so the additions stay in a computation of their own: XLA then
    cannot fuse a product computed outside into an addition as a fused multiply-add (which
    rounds once instead of twice and would change the bits). The start is hidden from XLA's
    simplifier too, which would drop `0.0 + term(0)` when the loop runs once and so keep a
    -0.0 that the sum from +0.0 turns into +0.0.
    """
    zero = jnp.zeros_like(term(0), jnp.float32)  # typed like the terms (shard_map varying axes)
    zero = lax.optimization_barrier(zero)
    return lax.fori_loop(0, count, lambda i, acc: acc + term(i).astype(jnp.float32), zero)


def products(a: jax.Array, b: jax.Array) -> jax.Array:
    """float32 a * b (summed later with sum_in_order, outside this computation)."""
    return a.astype(jnp.float32) * b.astype(jnp.float32)


def expert_entries(row_idx: jax.Array, row_w: jax.Array, capacity: int,
                   row_source: jax.Array | None = None):
    """Expert-major entries of rank-major rows (docs/contract.md, "Expert-major layout").

    Args:
      row_idx: int32 [N, K], local expert of each row's choices, -1 elsewhere.
      row_w: float32 [N, K], their weights.
      capacity: entries kept at most.
      row_source: int32 [N], each row's source rank (-1: no row), to keep the first entries
        in order of source, then local expert (`drop_order="source"`); None: in the
        layout's order.

    Returns:
      dict of: entry_row, entry_choice (int32 [capacity], -1 past the count), ids, weights
      (the entries' local expert and weight), row_entries (int32 [N, K], each row's entries in
      sorted order, -1 padded), needed (int32 [], entries before the capacity cut).
    """
    num_rows, top_k = row_idx.shape
    flat_idx = row_idx.reshape(-1)
    num_slots = flat_idx.shape[0]
    is_entry = flat_idx >= 0
    last = jnp.iinfo(jnp.int32).max  # non-entries sort after every expert
    needed = jnp.sum(is_entry, dtype=jnp.int32)
    kept = jnp.minimum(needed, capacity)
    if row_source is not None:  # the entries the capacity keeps, in source order
        by_expert = jnp.argsort(jnp.where(is_entry, flat_idx, last), stable=True)
        source = jnp.where(is_entry, jnp.repeat(row_source, top_k), last)[by_expert]
        by_source = by_expert[jnp.argsort(source, stable=True)]
        rank = jnp.zeros((num_slots,), jnp.int32).at[by_source].set(
            jnp.arange(num_slots, dtype=jnp.int32))
        is_entry = is_entry & (rank < capacity)
    order = jnp.argsort(jnp.where(is_entry, flat_idx, last), stable=True)
    padding = jnp.full((max(capacity - num_slots, 0),), -1, order.dtype)
    padded = jnp.concatenate([order, padding])
    entry_slot = jnp.where(jnp.arange(capacity) < kept, padded[:capacity], -1)
    entry_slot = entry_slot.astype(jnp.int32)

    # Position of each (row, k) in the sorted entries, then each row's entries in order.
    position = jnp.zeros((num_slots,), jnp.int32).at[order].set(jnp.arange(num_slots))
    position = jnp.where(is_entry & (position < capacity), position, num_slots)
    row_entries = jnp.sort(position.reshape(num_rows, top_k), axis=1)
    return {
        "entry_row": jnp.where(entry_slot >= 0, entry_slot // top_k, -1),
        "entry_choice": jnp.where(entry_slot >= 0, entry_slot % top_k, -1),
        "ids": gather_rows(flat_idx, entry_slot, fill=-1),
        "weights": gather_rows(row_w.reshape(-1), entry_slot),
        "row_entries": jnp.where(row_entries < num_slots, row_entries, -1),
        "needed": needed,
    }


def expert_slots(row_local: jax.Array, experts_per_rank: int):
    """Low-latency slots of rows in source order (docs/contract.md, "low_latency_dispatch").

    Args:
      row_local: int32 [N, K], local expert of each row's choices, -1 elsewhere; rows in
        order of source rank, then source token.
      experts_per_rank: E_local.

    Returns:
      (src_of_slot int32 [E_local, N]: the row in each expert's slots, -1 past the count;
       slot_of int32 [N, E_local]: the slot of each row at each expert it chose;
       count int32 [E_local]).
    """
    num_rows = row_local.shape[0]
    # chose[f, j]: row f chose local expert j (duplicates collapse to one message).
    chose = jnp.any(row_local[:, :, None] == jnp.arange(experts_per_rank), axis=1)
    slot_of = jnp.cumsum(chose, axis=0, dtype=jnp.int32) - 1
    count = jnp.sum(chose, axis=0, dtype=jnp.int32)
    src_of_slot = jax.vmap(
        lambda ok, pos: scatter_rows(
            num_rows, jnp.where(ok, pos, -1), jnp.arange(num_rows, dtype=jnp.int32), fill=-1
        ),
        in_axes=1,
    )(chose, slot_of)
    return src_of_slot, slot_of, count


def slot_rows(rows: jax.Array, src_of_slot: jax.Array) -> jax.Array:
    """rows [N, C] laid out in per-expert slots: [E_local, N, C]."""
    return jax.vmap(gather_rows, in_axes=(None, 0))(rows, src_of_slot)


def choice_rows(row_local: jax.Array, slot_of: jax.Array) -> jax.Array:
    """int32 [N, K]: the row of each choice in the slots flattened to [E_local * N]
    (local expert j, slot i -> j * N + i), -1 where row_local is -1."""
    num_rows = row_local.shape[0]
    slot = jnp.take_along_axis(slot_of, jnp.maximum(row_local, 0), axis=1)
    return jnp.where(row_local >= 0, row_local * num_rows + slot, -1)
