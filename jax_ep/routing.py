"""Routing arithmetic shared by the ops: which choices are valid and where they live.

Everything here is per shard and purely local (no communication). Expert `e` lives on rank
`e // E_local` as local expert `e % E_local`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def clean_topk_idx(topk_idx: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Replaces ids outside [-1, E) by -1; returns (cleaned ids, int32 count of invalid ids)."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    invalid = ~valid & (topk_idx != -1)
    return jnp.where(valid, topk_idx, -1), jnp.sum(invalid, dtype=jnp.int32)


def dest_rank(topk_idx: jax.Array, num_experts: int, num_ranks: int) -> jax.Array:
    """Rank that holds each choice of a cleaned topk_idx, -1 where masked."""
    experts_per_rank = num_experts // num_ranks
    return jnp.where(topk_idx >= 0, topk_idx // experts_per_rank, -1)


def is_token_in_rank(topk_idx: jax.Array, num_experts: int, num_ranks: int) -> jax.Array:
    """bool [T, R]: token t has a valid choice on rank r."""
    dest = dest_rank(topk_idx, num_experts, num_ranks)
    return jnp.any(dest[:, :, None] == jnp.arange(num_ranks)[None, None, :], axis=1)


def count_ids(ids: jax.Array, num_ids: int) -> jax.Array:
    """int32 [num_ids]: how many entries of `ids` equal each id; -1 entries are not counted."""
    flat = jnp.where(ids >= 0, ids, num_ids).reshape(-1)
    return jnp.zeros((num_ids,), jnp.int32).at[flat].add(1, mode="drop")


def local_choices(
    topk_idx: jax.Array, num_experts: int, num_ranks: int, rank: jax.Array
) -> jax.Array:
    """Local expert id of each choice that lives on `rank`, -1 for every other choice."""
    experts_per_rank = num_experts // num_ranks
    local = topk_idx - rank * experts_per_rank
    mine = (topk_idx >= 0) & (local >= 0) & (local < experts_per_rank)
    return jnp.where(mine, local, -1)
