"""Bytes each rank sends over the wire (to the other ranks), per op and transport.

Counted from the routing with NumPy, averaged over the ranks, for the transports of the
portable backend ("all_gather", "ragged": jax_ep.backends.xla.transport) and the "cuda"
backend's kernels, next to the routed minimum: the rows that must reach another rank.

- Normal mode: the minimum is one row per (token, other rank it goes to) each way.
  all_gather sends every token's row (with its K ids and K weights) to every other rank;
  combine returns a [T, H] block to every other rank. ragged sends the routed rows with their
  routing (2K + 1 int32) and one all_gather of R counts. cuda sends the routed rows (their
  few bytes of bookkeeping left out, as in jax_ep.tools.account).
- Low latency: dispatch's minimum is one row per (token, other rank), combine's one row per
  (token, distinct expert on another rank) (the experts' outputs differ). all_gather sends
  every token (with its K ids) to every other rank and returns [T, K, H] to each; ragged sends
  rows with K + 1 int32 and one all_gather of 2R counts, and returns one row per pair; cuda
  sends one message per (token, expert) both ways.
"""

from __future__ import annotations

import numpy as np

TRANSPORTS = ("all_gather", "ragged", "cuda")
COUNT_BYTES = 4  # int32 ids, weights, counts


def _routing(topk_idx: np.ndarray, num_experts: int):
    """(dest [R, T, K] rank of each valid choice or -1, first [R, T, K] True at the first
    choice of each distinct expert, other [R, T, K] True where the rank is not the home)."""
    idx = np.asarray(topk_idx)
    num_ranks = idx.shape[0]
    valid = (idx >= 0) & (idx < num_experts)
    dest = np.where(valid, idx // (num_experts // num_ranks), -1)
    k = idx.shape[2]
    earlier = np.triu(np.ones((k, k), bool), 1)  # earlier[j, i]: j < i
    same = (idx[..., :, None] == idx[..., None, :]) & earlier.T[None, None]
    first = valid & ~np.any(same, axis=-1)
    other = dest != np.arange(num_ranks)[:, None, None]
    return dest, first, other


def rows_to_others(topk_idx: np.ndarray, num_experts: int) -> float:
    """(token, rank) pairs with the rank not the token's home, per rank."""
    dest, _, other = _routing(topk_idx, num_experts)
    num_ranks = dest.shape[0]
    goes = np.zeros(dest.shape[:2] + (num_ranks,), bool)
    r, t, _ = np.nonzero(dest >= 0)
    goes[r, t, dest[dest >= 0]] = True
    goes[np.arange(num_ranks), :, np.arange(num_ranks)] = False
    return goes.sum() / num_ranks


def pairs_to_others(topk_idx: np.ndarray, num_experts: int) -> float:
    """(token, distinct expert) pairs on another rank, per rank."""
    _, first, other = _routing(topk_idx, num_experts)
    return (first & other).sum() / first.shape[0]


def messages_to_others(topk_idx: np.ndarray, num_experts: int) -> float:
    """Valid choices on another rank (a duplicate sends again), per rank."""
    dest, _, other = _routing(topk_idx, num_experts)
    return ((dest >= 0) & other).sum() / dest.shape[0]


def normal(topk_idx: np.ndarray, num_experts: int, row_bytes: int, transport: str,
           direction: str) -> float:
    """Bytes a rank sends for dispatch ("dispatch") or combine ("combine"); row_bytes: a
    row's payload (FP8: with its scales)."""
    num_ranks, num_tokens, top_k = np.shape(topk_idx)
    rows = rows_to_others(topk_idx, num_experts)
    dispatching = direction == "dispatch"
    if transport == "all_gather":
        per_token = row_bytes + (2 * top_k * COUNT_BYTES if dispatching else 0)
        return (num_ranks - 1) * num_tokens * per_token
    if transport == "ragged":
        if not dispatching:
            return rows * row_bytes
        return rows * (row_bytes + (2 * top_k + 1) * COUNT_BYTES) + (
            num_ranks - 1) * num_ranks * COUNT_BYTES
    return rows * row_bytes


def low_latency(topk_idx: np.ndarray, num_experts: int, message_bytes: int, hidden: int,
                transport: str, direction: str) -> float:
    """Bytes a rank sends for low-latency dispatch (messages of message_bytes) or combine
    (bfloat16 rows of `hidden`)."""
    num_ranks, num_tokens, top_k = np.shape(topk_idx)
    back = 2 * hidden
    dispatching = direction == "dispatch"
    if transport == "all_gather":
        if dispatching:
            return (num_ranks - 1) * num_tokens * (message_bytes + top_k * COUNT_BYTES)
        return (num_ranks - 1) * num_tokens * top_k * back
    if transport == "ragged":
        if dispatching:
            rows = rows_to_others(topk_idx, num_experts)
            return rows * (message_bytes + (top_k + 1) * COUNT_BYTES) + (
                num_ranks - 1) * 2 * num_ranks * COUNT_BYTES
        return pairs_to_others(topk_idx, num_experts) * back
    return messages_to_others(topk_idx, num_experts) * (message_bytes if dispatching else back)


def minimum(topk_idx: np.ndarray, num_experts: int, payload_bytes: int, low_latency: bool,
            direction: str) -> float:
    """The routed minimum of one direction: see the module docstring."""
    if low_latency and direction == "combine":
        return pairs_to_others(topk_idx, num_experts) * payload_bytes
    return rows_to_others(topk_idx, num_experts) * payload_bytes
