"""Published MoE shapes as ready `jax_ep.nn.MoE` configurations.

`deepseek_v3()` is DeepSeek-V3's MoE block (routing as published; widths scaled down so that
it runs on CPU devices); `deepseek_v3(hidden=7168, ffn_hidden=2048)` is the full width.
"""

from __future__ import annotations

import dataclasses

from flax import nnx
from jax.sharding import Mesh

from jax_ep.nn.moe import MoE
from jax_ep.nn.router import RouterConfig


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The shape of an MoE block: what `MoE` needs besides the mesh and options.

    Attributes:
      hidden: H, the model width.
      ffn_hidden: each routed (and shared) expert's SwiGLU width.
      router: the routing rule.
      num_shared_experts: experts every token goes through.
    """

    hidden: int
    ffn_hidden: int
    router: RouterConfig
    num_shared_experts: int = 0

    def layer(self, *, mesh: Mesh, rngs: nnx.Rngs, **options) -> MoE:
        """The layer on `mesh`; `options` are `MoE`'s keyword arguments (ep_axis, capacity,
        wire_format, dtype, ...)."""
        return MoE(self.hidden, self.ffn_hidden, self.router, mesh=mesh,
                   num_shared_experts=self.num_shared_experts, rngs=rngs, **options)


def deepseek_v3(hidden: int = 64, ffn_hidden: int = 32) -> MoEConfig:
    """DeepSeek-V3's MoE block: 256 routed experts, top-8 chosen from the best 4 of 8 groups,
    sigmoid scores normalized over the chosen experts, routed scaling 2.5, one shared expert.

    The published widths are hidden=7168 and ffn_hidden=2048 (moe_intermediate_size); the
    defaults here are scaled down for CPU runs and tests.
    """
    router = RouterConfig(num_experts=256, top_k=8, score="sigmoid", num_groups=8,
                          top_groups=4, routed_scaling=2.5)
    return MoEConfig(hidden=hidden, ffn_hidden=ffn_hidden, router=router, num_shared_experts=1)
