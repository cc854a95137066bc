"""Result and handle types of the ops: frozen dataclasses registered as JAX pytrees.

Array fields are pytree leaves (they flow through jit, grad, shard_map and scan); static
configuration (sizes, the axis name) is pytree metadata, so a handle carries everything that
combine needs to undo its dispatch. Field shapes use the notation of docs/contract.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax_ep.placement import ANYWHERE, Placement


def _pytree(cls: type) -> type:
    """Frozen dataclass whose `meta` fields are static and all other fields are leaves."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    meta = [f.name for f in fields if f.metadata.get("static")]
    data = [f.name for f in fields if not f.metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def static(default: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, metadata={"static": True})


@jax.jit  # (eagerly, each reshape would be a device copy of its own)
def _zero_past(rows: jax.Array | None, count: jax.Array) -> jax.Array | None:
    """rows [..., N] or [..., N, C] (count [...]) with rows n >= count[...] set to zero."""
    if rows is None:
        return None
    count = jnp.asarray(count)
    keep = jnp.arange(rows.shape[count.ndim]) < count[..., None]
    keep = keep.reshape(keep.shape + (1,) * (rows.ndim - keep.ndim))
    return jnp.where(keep, rows, jnp.zeros((), rows.dtype))


def _zero_rows_past(x: Any, count: jax.Array) -> Any:
    """_zero_past on every array of x (an array, or a Quantized's data, scales and, one value
    a row, global scale)."""
    return jax.tree.map(lambda rows: _zero_past(rows, count), x)


@_pytree
class DispatchLayout:
    """Where this rank's tokens go (purely local).

    Attributes:
      num_tokens_per_rank: int32 [R], tokens of this rank that go to each rank.
      num_tokens_per_expert: int32 [E], valid choices of each expert (duplicates count twice).
      is_token_in_rank: bool [T, R].
      num_invalid: int32 [], ids in topk_idx outside [-1, E).
    """

    num_tokens_per_rank: jax.Array
    num_tokens_per_expert: jax.Array
    is_token_in_rank: jax.Array
    num_invalid: jax.Array


@_pytree
class Received:
    """What normal dispatch delivers to this rank (docs/contract.md, "dispatch").

    Attributes:
      x: [capacity, H] in the input dtype, or float8_e4m3fn when FP8 was dispatched, or a
        jax_ep.quant.Quantized of capacity rows when one was; rows past num_tokens are
        unspecified (see with_zero_padding).
      scales: float32 [capacity, H/128] for FP8 dispatch, else None; likewise.
      topk_idx: int32 local expert ids, [capacity, K] (rank-major) or [capacity]
        (expert-major, one entry per row); -1 where masked or past the count.
      topk_weights: float32, same shape as topk_idx; 0 where topk_idx is -1.
      num_tokens: int32 [], rows (entries, when expert-major) kept; with
        `expert_alignment`, the rows in use, padding included (sum(group_sizes)).
      tokens_per_expert: int32 [E_local], kept choices per local expert.
      num_dropped: int32 [], rows (entries) that did not fit in the capacity.
      num_invalid: int32 [], ids outside [-1, E) in this rank's own topk_idx.
      group_sizes: int32 [E_local] for expert-major (== tokens_per_expert; with
        `expert_alignment`, each rounded up to a multiple of it), else None.
    """

    x: jax.Array
    scales: jax.Array | None
    topk_idx: jax.Array
    topk_weights: jax.Array
    num_tokens: jax.Array
    tokens_per_expert: jax.Array
    num_dropped: jax.Array
    num_invalid: jax.Array
    group_sizes: jax.Array | None

    def with_zero_padding(self) -> Received:
        """These results with zeros in the rows of x and scales past num_tokens, which are
        otherwise unspecified (docs/contract.md, "Padding"): for consumers that read every
        row, at the cost of one pass over x (every array of a Quantized x)."""
        return dataclasses.replace(self, x=_zero_rows_past(self.x, self.num_tokens),
                                   scales=_zero_past(self.scales, self.num_tokens))


@_pytree
class RaggedRows:
    """How the portable backend's ragged transport moved a dispatch's rows.

    A sender packs its rows by destination rank, in token order; a receiver gets them packed
    by source rank. Both the dispatch and its transpose (combine) use this layout.

    Attributes:
      counts: int32 [R, R], rows rank s sent to rank d (after the capacity cut), the same on
        every rank.
      slots: int32 [T, min(K, R)], the packed row of each of this rank's tokens for its
        destination ranks in ascending order, -1 past them (or where the row was dropped).
    """

    counts: jax.Array
    slots: jax.Array


@_pytree
class AlignedEntries:
    """Where `jax_ep.alignment` moved a dispatch's expert-major entries.

    Attributes:
      rows: int32 [capacity], the unaligned entry in each aligned row, -1 in the padding.
      entries: int32 [capacity], the aligned row of each unaligned entry, -1 where the
        alignment did not keep it (or past the count).
      alignment: A, the multiple every local expert's entries start at.
    """

    rows: jax.Array
    entries: jax.Array
    alignment: int = static()


@_pytree
class DispatchHandle:
    """Everything combine (and the backward passes) need to undo a dispatch.

    Attributes:
      topk_idx: int32 [T, K], this rank's routing with invalid ids replaced by -1.
      recv_src: int32 [N], source of each rank-major row: s * T + t, or -1 past the count.
        N = capacity (rank-major) or R*T (expert-major, where capacity applies to entries;
        min(capacity, R*T) with the ragged transport, below).
      src_row: int32 [R*T], the inverse of recv_src: the rank-major row of each source token
        s * T + t on this rank, or -1 when it was not received (or dropped).
      entry_row: int32 [capacity], rank-major row of each entry (expert-major), else None.
      entry_choice: int32 [capacity], top-k slot k of each entry (expert-major), else None.
      row_entries: int32 [N, K], entries of each rank-major row in their sorted order,
        -1 padded (expert-major), else None.
      ragged: the rows' layout when the portable backend's ragged transport moved them, else
        None. Its expert-major rows are only those that hold a kept entry, so there
        N = min(capacity, R*T).
      alignment: where `expert_alignment` moved the entries (then entry_row, entry_choice
        and row_entries describe the unaligned layout it started from), else None.
      drop_by_source: its capacity kept entries by source, then expert (`drop_order`); a
        dispatch along it again must too.
    """

    topk_idx: jax.Array
    recv_src: jax.Array
    src_row: jax.Array
    entry_row: jax.Array | None
    entry_choice: jax.Array | None
    row_entries: jax.Array | None
    num_experts: int = static()
    num_ranks: int = static()
    capacity: int = static()
    expert_major: bool = static()
    axis_name: str = static()
    ragged: RaggedRows | None = None
    alignment: AlignedEntries | None = None
    drop_by_source: bool = static(False)

    @property
    def num_tokens(self) -> int:
        return self.topk_idx.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_idx.shape[1]


@_pytree
class LowLatencyReceived:
    """What low-latency dispatch delivers to this rank.

    Attributes:
      x: [E_local, R*T, H] bfloat16, or float8_e4m3fn with `scales`; rows past the
        expert's count are unspecified (see with_zero_padding).
      scales: float32 [E_local, R*T, H/128] for FP8, else None; likewise.
      count: int32 [E_local], rows used per local expert.
      num_invalid: int32 [], ids outside [-1, E) in this rank's own topk_idx.
    """

    x: jax.Array
    scales: jax.Array | None
    count: jax.Array
    num_invalid: jax.Array

    def with_zero_padding(self) -> LowLatencyReceived:
        """These results with zeros in the rows of x and scales past each expert's count,
        which are otherwise unspecified (docs/contract.md, "Padding"); every array of a
        Quantized x."""
        return dataclasses.replace(self, x=_zero_rows_past(self.x, self.count),
                                   scales=_zero_past(self.scales, self.count))


@_pytree
class RaggedEntries:
    """How the portable backend's ragged transport brings low-latency expert outputs home:
    one row per (token, distinct expert) pair.

    Attributes:
      counts: int32 [R, R], pairs of home rank s whose expert lives on rank d, the same on
        every rank.
      entry_src: int32 [R*T*min(K, E_local)], the expert side: the row of the flattened slots
        [E_local * R*T] that each packed pair returns, packed by home rank, -1 past them.
      entry_pos: int32 [T, K], the home side: the packed row that brings back each choice
        (a duplicate choice shares its first one's), -1 where masked.
    """

    counts: jax.Array
    entry_src: jax.Array
    entry_pos: jax.Array


@_pytree
class LowLatencyHandle:
    """Routing that low-latency combine needs to bring expert outputs home.

    Attributes:
      topk_idx: int32 [T, K], this rank's routing with invalid ids replaced by -1.
      src_row: int32 [R, T, K], for every source rank's choices, the row in this rank's
        slots flattened to [E_local * R*T] (local expert j, slot i -> j * R*T + i), -1 where
        the choice does not live on this rank (the expert side of the exchange).
    """

    topk_idx: jax.Array
    src_row: jax.Array
    num_experts: int = static()
    num_ranks: int = static()
    axis_name: str = static()
    buffer: int = static(0)  # the low-latency region of the exchange (jax_ep.placement)
    ragged: RaggedEntries | None = None  # set by the portable backend's ragged transport


@_pytree
class LowLatencyDispatchPending:
    """A low-latency dispatch whose sends are issued and whose receive is still to come."""

    data: Any
    num_experts: int = static()
    axis_name: str = static()
    backend: str = static()
    placement: Placement = static(ANYWHERE)
    wire_format: str | None = static(None)  # the rows arrive as a Quantized of it


@_pytree
class LowLatencyCombinePending:
    """A low-latency combine whose sends are issued and whose receive is still to come."""

    data: Any
    topk_weights: jax.Array
    handle: LowLatencyHandle
    backend: str = static()
    placement: Placement = static(ANYWHERE)
