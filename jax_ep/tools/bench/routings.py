"""Routing generators for tests and benchmarks: uniform, skewed, masked, empty ranks.

Each returns rank-stacked `topk_idx` int32 [R, T, K] and `topk_weights` float32 [R, T, K]
(weights of a softmax over random logits, as a router would produce).
"""

from __future__ import annotations

import numpy as np

KINDS = ("uniform", "hot_expert", "masked", "empty_ranks", "duplicates")


def _distinct_choices(rng: np.random.Generator, shape: tuple[int, int], pool: np.ndarray, k: int):
    """k distinct experts per token drawn from `pool` (k <= len(pool))."""
    keys = rng.random((*shape, len(pool)))
    return pool[np.argsort(keys, axis=-1)[..., :k]]


def make_routing(
    rng: np.random.Generator,
    *,
    num_ranks: int,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    kind: str = "uniform",
) -> tuple[np.ndarray, np.ndarray]:
    """A routing of `kind` (one of KINDS); every choice is valid or -1."""
    shape = (num_ranks, num_tokens)
    all_experts = np.arange(num_experts)
    if kind == "uniform":
        idx = _distinct_choices(rng, shape, all_experts, top_k)
    elif kind == "hot_expert":  # every token picks expert 0, the rest from a few experts
        idx = _distinct_choices(rng, shape, all_experts[: max(top_k, 2)], top_k)
        idx[..., 0] = 0
    elif kind == "masked":  # about a third of the choices masked, some tokens entirely
        idx = _distinct_choices(rng, shape, all_experts, top_k)
        idx = np.where(rng.random(idx.shape) < 0.35, -1, idx)
        idx[:, :: max(num_tokens // 3, 1)] = -1
    elif kind == "empty_ranks":  # experts only on even ranks, and rank 0 sends nothing
        per_rank = num_experts // num_ranks
        pool = np.array([e for e in all_experts if (e // per_rank) % 2 == 0])
        k = min(top_k, len(pool))
        idx = np.full((*shape, top_k), -1)
        idx[..., :k] = _distinct_choices(rng, shape, pool, k)
        idx[0] = -1
    elif kind == "duplicates":  # choices drawn with replacement: the same expert twice
        idx = rng.integers(0, num_experts, size=(*shape, top_k))
    else:
        raise ValueError(f"make_routing: kind must be one of {list(KINDS)}; got {kind!r}.")
    logits = rng.standard_normal(idx.shape).astype(np.float32)
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return idx.astype(np.int32), weights.astype(np.float32)
