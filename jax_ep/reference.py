"""NumPy reference of the jax_ep contract (docs/contract.md), for tests and kernel checks.

Written from the contract alone, with plain loops over ranks, tokens and choices so that each
rule can be read off the code. It works on all ranks at once: every per-rank array is stacked
on a leading axis of size R (rank d's input is `a[d]`). Float32 sums are formed in exactly the
order the contract states, so results can be compared bit for bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8 = ml_dtypes.float8_e4m3fn
BLOCK = 128


# ---------------------------------------------------------------------------------------------
# Routing


def _check_routing(topk_idx: np.ndarray, num_experts: int) -> tuple[int, int, int, int]:
    if topk_idx.ndim != 3:
        raise ValueError(f"topk_idx must be [R, T, K]; got shape {topk_idx.shape}")
    num_ranks, num_tokens, top_k = topk_idx.shape
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of R ({num_ranks})")
    return num_ranks, num_tokens, top_k, num_experts // num_ranks


def _clean(topk_idx: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids with invalid entries replaced by -1, invalid count per rank)."""
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    invalid = ~valid & (topk_idx != -1)
    return np.where(valid, topk_idx, -1), invalid.reshape(len(topk_idx), -1).sum(1)


def _rank_major_rows(idx: np.ndarray, per_rank: int, d: int) -> list[tuple[int, int]]:
    """(source rank, token) of every row rank d receives, in order."""
    rows = []
    for s in range(idx.shape[0]):
        for t in range(idx.shape[1]):
            if any(e >= 0 and e // per_rank == d for e in idx[s, t]):
                rows.append((s, t))
    return rows


def _local(e: int, per_rank: int, d: int) -> int:
    return e - d * per_rank if e >= 0 and e // per_rank == d else -1


def _entries(idx: np.ndarray, rows: list[tuple[int, int]], per_rank: int, d: int):
    """Expert-major entries (local expert j, rank-major row i, choice k), sorted."""
    entries = []
    for i, (s, t) in enumerate(rows):
        for k, e in enumerate(idx[s, t]):
            j = _local(int(e), per_rank, d)
            if j >= 0:
                entries.append((j, i, k))
    return sorted(entries)  # by j, then i, then k


def dispatch_layout(topk_idx: np.ndarray, *, num_experts: int) -> dict:
    num_ranks, num_tokens, top_k, per_rank = _check_routing(topk_idx, num_experts)
    idx, num_invalid = _clean(topk_idx, num_experts)
    in_rank = np.zeros((num_ranks, num_tokens, num_ranks), bool)
    per_expert = np.zeros((num_ranks, num_experts), np.int32)
    for s in range(num_ranks):
        for t in range(num_tokens):
            for e in idx[s, t]:
                if e >= 0:
                    in_rank[s, t, e // per_rank] = True
                    per_expert[s, e] += 1
    return {
        "num_tokens_per_rank": in_rank.sum(1).astype(np.int32),
        "num_tokens_per_expert": per_expert,
        "is_token_in_rank": in_rank,
        "num_invalid": num_invalid.astype(np.int32),
    }


# ---------------------------------------------------------------------------------------------
# Normal dispatch / combine


def _default_capacity(num_ranks, num_tokens, top_k, per_rank, expert_major):
    if expert_major:
        return num_ranks * num_tokens * min(top_k, per_rank)
    return num_ranks * num_tokens


def dispatch(
    x, topk_idx, topk_weights, *, num_experts: int, capacity=None, expert_major=False
) -> dict:
    """Normal dispatch; x is [R, T, H] or the pair (x_fp8 [R, T, H], scales [R, T, H/128])."""
    num_ranks, num_tokens, top_k, per_rank = _check_routing(topk_idx, num_experts)
    idx, num_invalid = _clean(topk_idx, num_experts)
    pair = isinstance(x, tuple)
    data, scales = x if pair else (x, None)
    hidden = data.shape[-1]
    if capacity is None:
        capacity = _default_capacity(num_ranks, num_tokens, top_k, per_rank, expert_major)

    id_shape = (num_ranks, capacity) if expert_major else (num_ranks, capacity, top_k)
    out = {
        "x": np.zeros((num_ranks, capacity, hidden), data.dtype),
        "topk_idx": np.full(id_shape, -1, np.int32),
        "topk_weights": np.zeros(id_shape, np.float32),
        "num_tokens": np.zeros(num_ranks, np.int32),
        "tokens_per_expert": np.zeros((num_ranks, per_rank), np.int32),
        "num_dropped": np.zeros(num_ranks, np.int32),
        "num_invalid": num_invalid.astype(np.int32),
    }
    if pair:
        out["scales"] = np.zeros((num_ranks, capacity, scales.shape[-1]), np.float32)
    if expert_major:
        out["group_sizes"] = out["tokens_per_expert"]

    for d in range(num_ranks):
        rows = _rank_major_rows(idx, per_rank, d)
        items = _entries(idx, rows, per_rank, d) if expert_major else list(enumerate(rows))
        kept = items[:capacity]
        out["num_tokens"][d] = len(kept)
        out["num_dropped"][d] = len(items) - len(kept)
        for n, item in enumerate(kept):
            if expert_major:
                j, i, k = item
                s, t = rows[i]
                out["topk_idx"][d, n] = j
                out["topk_weights"][d, n] = topk_weights[s, t, k]
                out["tokens_per_expert"][d, j] += 1
            else:
                s, t = item[1]
                for k, e in enumerate(idx[s, t]):
                    j = _local(int(e), per_rank, d)
                    if j >= 0:
                        out["topk_idx"][d, n, k] = j
                        out["topk_weights"][d, n, k] = topk_weights[s, t, k]
                        out["tokens_per_expert"][d, j] += 1
            out["x"][d, n] = data[s, t]
            if pair:
                out["scales"][d, n] = scales[s, t]
    return out


def _row_sources(idx, per_rank, d, capacity, expert_major):
    """For rank d: rank-major rows [(s, t)], and per kept row/entry its rank-major row index."""
    rows = _rank_major_rows(idx, per_rank, d)
    if expert_major:
        entries = _entries(idx, rows, per_rank, d)[:capacity]
        return rows, [(i, k) for _, i, k in entries]
    return rows[:capacity], [(i, None) for i in range(min(len(rows), capacity))]


def combine(y, topk_idx, *, num_experts: int, capacity=None, expert_major=False, weights=None):
    """Combine of y [R, cap, H] (rows or entries), optional per-row weights [R, cap]."""
    num_ranks, num_tokens, top_k, per_rank = _check_routing(topk_idx, num_experts)
    idx, _ = _clean(topk_idx, num_experts)
    if capacity is None:
        capacity = _default_capacity(num_ranks, num_tokens, top_k, per_rank, expert_major)
    hidden = y.shape[-1]
    # contributions[d][(s, t)] = float32 row that rank d sends home for token t of rank s
    contributions = []
    for d in range(num_ranks):
        rows, kept = _row_sources(idx, per_rank, d, capacity, expert_major)
        mine = {}
        if expert_major:
            partial: dict[int, np.ndarray] = {}
            for n, (i, _) in enumerate(kept):  # entry order
                w = np.float32(1.0) if weights is None else np.float32(weights[d, n])
                term = y[d, n].astype(np.float32) * w
                partial[i] = (partial.get(i, np.zeros(hidden, np.float32)) + term).astype(
                    np.float32
                )
            for i, p in partial.items():
                mine[rows[i]] = p.astype(y.dtype).astype(np.float32)
        else:
            for n, (s, t) in enumerate(rows):
                row = y[d, n].astype(np.float32)
                if weights is not None:
                    row = row * np.float32(weights[d, n])
                mine[(s, t)] = row
        contributions.append(mine)
    out = np.zeros((num_ranks, num_tokens, hidden), y.dtype)
    for s in range(num_ranks):
        for t in range(num_tokens):
            total = np.zeros(hidden, np.float32)
            for d in range(num_ranks):  # rank order
                if (s, t) in contributions[d]:
                    total = total + contributions[d][(s, t)]
            out[s, t] = total.astype(y.dtype)
    return out


def dispatch_vjp(dx_recv, dw_recv, topk_idx, *, num_experts: int, capacity=None,
                 expert_major=False):
    """Cotangents of the received x and topk_weights -> cotangents of x and topk_weights."""
    num_ranks, num_tokens, top_k, per_rank = _check_routing(topk_idx, num_experts)
    idx, _ = _clean(topk_idx, num_experts)
    if capacity is None:
        capacity = _default_capacity(num_ranks, num_tokens, top_k, per_rank, expert_major)
    dx = combine(dx_recv, topk_idx, num_experts=num_experts, capacity=capacity,
                 expert_major=expert_major)
    dw = np.zeros((num_ranks, num_tokens, top_k), np.float32)
    for d in range(num_ranks):
        rows, kept = _row_sources(idx, per_rank, d, capacity, expert_major)
        for n, (i, k) in enumerate(kept):
            s, t = rows[i]
            choices = [k] if expert_major else range(top_k)
            for kk in choices:
                if _local(int(idx[s, t, kk]), per_rank, d) >= 0:
                    grad = dw_recv[d, n] if expert_major else dw_recv[d, n, kk]
                    dw[s, t, kk] += np.float32(grad)
    return dx, dw


def combine_vjp(dout, y, topk_idx, *, num_experts: int, capacity=None, expert_major=False,
                weights=None):
    """Cotangent of combine's output -> cotangents of y (and of the per-row weights)."""
    num_ranks, num_tokens, top_k, per_rank = _check_routing(topk_idx, num_experts)
    idx, _ = _clean(topk_idx, num_experts)
    if capacity is None:
        capacity = _default_capacity(num_ranks, num_tokens, top_k, per_rank, expert_major)
    dy = np.zeros(y.shape, dout.dtype)
    dw = None if weights is None else np.zeros(weights.shape, np.float32)
    for d in range(num_ranks):
        rows, kept = _row_sources(idx, per_rank, d, capacity, expert_major)
        for n, (i, _) in enumerate(kept):
            s, t = rows[i]
            g = dout[s, t].astype(np.float32)
            w = np.float32(1.0) if weights is None else np.float32(weights[d, n])
            dy[d, n] = (g * w).astype(dout.dtype)
            if dw is not None:
                dw[d, n] = np.dot(g.astype(np.float64), y[d, n].astype(np.float64))
    return dy, dw


# ---------------------------------------------------------------------------------------------
# Low-latency dispatch / combine


def _ll_slots(idx, per_rank, d):
    """For rank d: per local expert j, the sources (s, t) that chose it, in order."""
    slots = [[] for _ in range(per_rank)]
    for s in range(idx.shape[0]):
        for t in range(idx.shape[1]):
            chosen = {_local(int(e), per_rank, d) for e in idx[s, t]} - {-1}
            for j in sorted(chosen):
                slots[j].append((s, t))
    return slots


def low_latency_dispatch(x, topk_idx, *, num_experts: int, use_fp8=False) -> dict:
    num_ranks, num_tokens, _, per_rank = _check_routing(topk_idx, num_experts)
    idx, num_invalid = _clean(topk_idx, num_experts)
    hidden = x.shape[-1]
    data, scales = quantize(x) if use_fp8 else (x, None)
    out = {
        "x": np.zeros((num_ranks, per_rank, num_ranks * num_tokens, hidden), data.dtype),
        "count": np.zeros((num_ranks, per_rank), np.int32),
        "num_invalid": num_invalid.astype(np.int32),
    }
    if use_fp8:
        out["scales"] = np.zeros((num_ranks, per_rank, num_ranks * num_tokens, hidden // BLOCK),
                                 np.float32)
    for d in range(num_ranks):
        for j, sources in enumerate(_ll_slots(idx, per_rank, d)):
            out["count"][d, j] = len(sources)
            for n, (s, t) in enumerate(sources):
                out["x"][d, j, n] = data[s, t]
                if use_fp8:
                    out["scales"][d, j, n] = scales[s, t]
    return out


def low_latency_combine(y, topk_idx, topk_weights, *, num_experts: int) -> np.ndarray:
    num_ranks, num_tokens, top_k, per_rank = _check_routing(topk_idx, num_experts)
    idx, _ = _clean(topk_idx, num_experts)
    slot = {}  # (d, j, s, t) -> row
    for d in range(num_ranks):
        for j, sources in enumerate(_ll_slots(idx, per_rank, d)):
            for n, src in enumerate(sources):
                slot[(d, j, *src)] = n
    out = np.zeros((num_ranks, num_tokens, y.shape[-1]), ml_dtypes.bfloat16)
    for s in range(num_ranks):
        for t in range(num_tokens):
            total = np.zeros(y.shape[-1], np.float32)
            for k in range(top_k):  # k order
                e = int(idx[s, t, k])
                if e < 0:
                    continue
                d, j = e // per_rank, e % per_rank
                row = y[d, j, slot[(d, j, s, t)]].astype(np.float32)
                total = total + np.float32(topk_weights[s, t, k]) * row
            out[s, t] = total.astype(ml_dtypes.bfloat16)
    return out


# ---------------------------------------------------------------------------------------------
# FP8


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float8_e4m3fn, one float32 scale per 128 channels: max(amax, 1e-4) * float32(1/448)."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"hidden size {x.shape[-1]} is not a multiple of {BLOCK}")
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = np.maximum(np.abs(blocks).max(-1), np.float32(1e-4)).astype(np.float32)
    scales = (amax * np.float32(1.0 / 448.0)).astype(np.float32)
    inverse = (np.float32(1.0) / scales).astype(np.float32)
    q = (blocks * inverse[..., None]).astype(np.float32).astype(FP8)
    return q.reshape(x.shape), scales


def dequantize(x_fp8: np.ndarray, scales: np.ndarray, out_dtype=np.float32) -> np.ndarray:
    blocks = x_fp8.astype(np.float32).reshape(*x_fp8.shape[:-1], -1, BLOCK)
    return (blocks * scales[..., None]).astype(np.float32).reshape(x_fp8.shape).astype(out_dtype)
