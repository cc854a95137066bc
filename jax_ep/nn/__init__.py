"""Flax layers on jax_ep's ops: `MoE` (NNX) and its routing (`router`), the same layer for
Linen models (`linen.MoE`), under MaxText's names (`maxtext.RoutedMoE`), and published shapes
(`configs`)."""

from jax_ep.nn import configs, linen, maxtext
from jax_ep.nn.configs import MoEConfig
from jax_ep.nn.moe import LOGICAL_AXES, MoE, MoEStats, default_sharding_rules
from jax_ep.nn.router import RouterConfig

__all__ = ["LOGICAL_AXES", "MoE", "MoEConfig", "MoEStats", "RouterConfig", "configs",
           "default_sharding_rules", "linen", "maxtext"]
