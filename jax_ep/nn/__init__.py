"""Flax (NNX) layers on jax_ep's ops: `MoE` and its routing (`router`)."""

from jax_ep.nn.moe import MoE, MoEStats
from jax_ep.nn.router import RouterConfig

__all__ = ["MoE", "MoEStats", "RouterConfig"]
