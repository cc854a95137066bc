"""Expert alignment (`dispatch(..., expert_major=True, expert_alignment=A)`): the expert-major
layout with every local expert's entries starting at a multiple of A rows, as grouped GEMM
kernels want (docs/contract.md, "Expert alignment").

The exchange is the unaligned one; the aligned rows are one local gather of the received rows
(and combine gathers the experts' outputs back), so every backend and path gives the same
bytes. Entries are kept in the unaligned order while their aligned row is under the capacity:
an expert whose padded start is past it keeps nothing, the expert it cuts keeps a prefix.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_ep import _checks
from jax_ep.backends._rows import gather_rows, scatter_rows
from jax_ep.structs import AlignedEntries, DispatchHandle, Received


def round_up(n, multiple: int):
    """The smallest multiple of `multiple` >= n (ints or int arrays)."""
    return -(-n // multiple) * multiple


def with_padding(rows: int, experts_per_rank: int, alignment: int) -> int:
    """A capacity of `rows` entries grown by what the padding can take at most (A - 1 rows
    behind each local expert's entries), rounded up to a multiple of A."""
    return round_up(rows + experts_per_rank * (alignment - 1), alignment)


def check(op: str, expert_alignment, expert_major: bool) -> int | None:
    """The alignment an op's `expert_alignment` asks for (None: none, as for 1)."""
    _checks.check_positive_int(op, "expert_alignment", expert_alignment, allow_none=True)
    if expert_alignment not in (None, 1) and not expert_major:  # 1 aligns nothing anywhere
        raise ValueError(f"{op}: expert_alignment={expert_alignment} aligns the entries of "
                         f"the expert-major layout; pass expert_major=True with it.")
    return None if expert_alignment in (None, 1) else int(expert_alignment)


def check_capacity(op: str, capacity: int | None, alignment: int, default: int) -> None:
    """An explicit capacity must hold whole groups: a multiple of the alignment."""
    if capacity is not None and capacity % alignment:
        raise ValueError(
            f"{op}: capacity={capacity} must be a multiple of expert_alignment={alignment}, so "
            f"that every expert's padded group fits; pass capacity="
            f"{round_up(capacity, alignment)}, or leave it unset for the default ({default}, "
            f"with room for the padding).")


@jax.custom_vjp
def _moved(rows: jax.Array, index: jax.Array, inverse: jax.Array) -> jax.Array:
    """rows[index] (zero where index is -1); `inverse` is the partial inverse of `index` (each
    row's place, or -1), so the transpose is a gather too: bit for bit, no scatter-add."""
    return gather_rows(rows, index)


def _moved_fwd(rows, index, inverse):
    return gather_rows(rows, index), inverse


def _moved_bwd(inverse, d_out):
    return gather_rows(d_out, inverse), None, None


_moved.defvjp(_moved_fwd, _moved_bwd)


def align(received: Received, handle: DispatchHandle, alignment: int
          ) -> tuple[Received, DispatchHandle]:
    """The expert-major results of a dispatch moved to the aligned layout (per rank).

    `received.num_dropped + received.num_tokens` entries were needed; the aligned results
    keep those whose aligned row is under the capacity.
    """
    capacity = handle.capacity
    counts = received.tokens_per_expert  # entries of each expert in the unaligned layout
    padded = round_up(counts, alignment)
    start = jnp.cumsum(padded) - padded
    kept = jnp.clip(capacity - start, 0, counts)
    group_sizes = round_up(kept, alignment)  # every padded group ends by the capacity

    # The aligned row of each unaligned entry m of expert j: its place among j's entries
    # plus j's aligned start, or -1 past j's kept entries (or past the count).
    j = received.topk_idx
    valid = j >= 0
    safe_j = jnp.where(valid, j, 0)
    place = jnp.arange(capacity, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[safe_j]
    entries = jnp.where(valid & (place < kept[safe_j]), start[safe_j] + place, -1)
    entries = entries.astype(jnp.int32)
    rows = scatter_rows(capacity, entries, jnp.arange(capacity, dtype=jnp.int32), fill=-1)

    needed = received.num_tokens + received.num_dropped
    moves = AlignedEntries(rows=rows, entries=entries, alignment=alignment)
    x, scales = moved_rows(received.x, received.scales, moves)
    aligned = dataclasses.replace(
        received,
        x=x,
        scales=scales,
        topk_idx=gather_rows(received.topk_idx, rows, fill=-1),
        topk_weights=_moved(received.topk_weights, rows, entries),
        num_tokens=jnp.sum(group_sizes).astype(jnp.int32),
        tokens_per_expert=kept.astype(jnp.int32),
        num_dropped=(needed - jnp.sum(kept)).astype(jnp.int32),
        group_sizes=group_sizes.astype(jnp.int32),
    )
    return aligned, dataclasses.replace(handle, alignment=moves)


def needed_rows(received: Received, num_needed: jax.Array, alignment: int) -> jax.Array:
    """Rows this rank needs, padding included, from the unaligned results (before `align`):
    exact when the unaligned layout kept every entry, else a lower bound (the padding of the
    entries it cut is not known here)."""
    counts = received.tokens_per_expert
    return jnp.sum(round_up(counts, alignment)) + num_needed - jnp.sum(counts)


def unaligned(values: jax.Array, handle: DispatchHandle, fill: int | float = 0) -> jax.Array:
    """Per-row `values` of the aligned rows back at their unaligned entries (`fill` where the
    alignment did not keep one); the identity without alignment. For backward passes written
    by hand against the unaligned handle."""
    if handle.alignment is None:
        return values
    return gather_rows(values, handle.alignment.entries, fill=fill)


def moved_rows(data: jax.Array, scales: jax.Array | None, moves: AlignedEntries):
    """Received rows (and their scales, or None) of the unaligned layout at their aligned rows
    (the results of `align`, and of a dispatch along an aligned handle)."""
    return (_moved(data, moves.rows, moves.entries),
            None if scales is None else gather_rows(scales, moves.rows))


def unalign(y: jax.Array, weights: jax.Array | None, handle: DispatchHandle):
    """The experts' outputs (and weights) of the aligned rows, back in the unaligned layout
    that combine undoes; entries the alignment did not keep get zero rows and weights."""
    moves = handle.alignment
    y = _moved(y, moves.entries, moves.rows)
    if weights is not None:
        weights = _moved(weights, moves.entries, moves.rows)
    return y, weights
