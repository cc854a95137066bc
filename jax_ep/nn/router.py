"""Routing of an MoE layer, as functions of arrays (no parameters, no Flax).

DeepSeek-V3's gate: scores (softmax or sigmoid of the logits); a per-expert bias that steers
*which* experts are selected but not their weights (auxiliary-loss-free load balancing);
group-limited selection (experts in groups; the best groups first, then the top-k experts
inside them); sigmoid weights normalized over the chosen experts (any score's, with
`normalize_topk`); a routed scaling factor.
Plus the load statistics the layer needs: each expert's share of the choices (to move the
bias toward balance) and the optional auxiliary balance loss.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _checks


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """How tokens choose experts.

    Attributes:
      num_experts: E.
      top_k: K experts per token.
      score: "softmax" (over the experts) or "sigmoid" (per expert; weights are then
        normalized over the chosen experts, as in DeepSeek-V3).
      num_groups: experts form this many equal groups (1: no group limit).
      top_groups: groups a token may choose from; a group's score is the sum of its two best
        (biased) expert scores.
      routed_scaling: factor on the routed weights.
      normalize_topk: divide the chosen experts' weights by their sum (MaxText's and
        Hugging Face's `norm_topk_prob`; with softmax scores it is the softmax over the top-k
        logits, MaxText's default); None: for sigmoid scores only (DeepSeek-V3).
    """

    num_experts: int
    top_k: int
    score: Literal["softmax", "sigmoid"] = "softmax"
    num_groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0
    normalize_topk: bool | None = None

    def __post_init__(self):
        E, K, G = self.num_experts, self.top_k, self.num_groups
        for name in ("num_experts", "top_k", "num_groups", "top_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"RouterConfig.{name} must be an int; got {value!r}.")
        if not _checks.is_finite_number(self.routed_scaling) or self.routed_scaling <= 0:
            raise ValueError(f"RouterConfig.routed_scaling must be a positive finite number; "
                             f"got {self.routed_scaling!r}.")
        if self.normalize_topk is not None and not isinstance(self.normalize_topk,
                                                              (bool, np.bool_)):
            raise TypeError(f"RouterConfig.normalize_topk must be True, False or None (for "
                            f"sigmoid scores only); got {self.normalize_topk!r}.")
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"score must be 'softmax' or 'sigmoid'; got {self.score!r}.")
        if not 1 <= K <= E:
            raise ValueError(f"top_k must be in [1, num_experts={E}]; got {K}.")
        if G < 1 or E % G:
            raise ValueError(f"num_groups ({G}) must divide num_experts ({E}).")
        if not 1 <= self.top_groups <= G:
            raise ValueError(f"top_groups must be in [1, num_groups={G}]; got {self.top_groups}.")
        if G > 1 and self.top_groups * (E // G) < K:
            raise ValueError(
                f"top_groups ({self.top_groups}) x experts per group ({E // G}) must be at "
                f"least top_k ({K}), or a token cannot pick {K} experts."
            )


def scores(logits: jax.Array, config: RouterConfig) -> jax.Array:
    """Per-expert scores in float32, [T, E]."""
    logits = logits.astype(jnp.float32)
    return jax.nn.softmax(logits, axis=-1) if config.score == "softmax" else jax.nn.sigmoid(logits)


def select(
    logits: jax.Array, config: RouterConfig, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Chooses top_k experts per token.

    Args:
      logits: [T, E].
      config: the routing rule.
      bias: optional float32 [E] added to the scores for the choice only.

    Returns:
      (topk_idx int32 [T, K], topk_weights float32 [T, K], scores float32 [T, E]).
    """
    s = scores(logits, config)
    choice = s if bias is None else s + bias.astype(jnp.float32)
    if config.num_groups > 1:
        T, E, G = s.shape[0], config.num_experts, config.num_groups
        grouped = choice.reshape(T, G, E // G)
        best_two = jax.lax.top_k(grouped, min(2, E // G))[0].sum(-1)  # [T, G]
        _, groups = jax.lax.top_k(best_two, config.top_groups)
        allowed = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], groups].set(True)
        choice = jnp.where(jnp.repeat(allowed, E // G, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, config.top_k)
    weights = jnp.take_along_axis(s, idx, axis=1)
    normalize = config.normalize_topk
    if normalize or (normalize is None and config.score == "sigmoid"):
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)
    return idx.astype(jnp.int32), weights * config.routed_scaling, s


def expert_load(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """Choices per expert, float32 [E] (masked -1 choices count nowhere)."""
    hits = topk_idx[..., None] == jnp.arange(num_experts)
    return jnp.sum(hits, axis=tuple(range(hits.ndim - 1)), dtype=jnp.float32)


def balance_loss(load: jax.Array, mean_scores: jax.Array) -> jax.Array:
    """Switch-style auxiliary loss E * sum_e f_e * P_e: f_e the fraction of the choices that
    went to expert e (from `load` [E]), P_e its mean score over the tokens ([E]). 1 when
    perfectly balanced; grows with skew."""
    fraction = load / jnp.maximum(jnp.sum(load), 1.0)
    return load.shape[0] * jnp.sum(fraction * mean_scores)


def updated_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """One step of auxiliary-loss-free balancing: raise the bias of under-loaded experts and
    lower that of over-loaded ones by `rate` (the sign of the gap to the mean load)."""
    return bias + rate * jnp.sign(jnp.mean(load) - load)
