"""`jax_ep.nn.MoE` as a Linen module, for Linen models (MaxText and most existing Flax code).

`MoE` takes the NNX layer's arguments (without `rngs`: Linen's "params" RNG initializes it)
and returns the same `(y, MoEStats)`. Its parameters are `nn.LogicallyPartitioned` boxes in
the layer's logical axis names ("expert", "embed", "mlp"), carrying the mesh and the rules
that map those names to mesh axes: `nn.get_partition_spec(variables)` gives the logical
names, `nn.logical_to_mesh_sharding(specs, mesh, rules)` the placement, and the initialized
arrays are already placed so (experts over the EP axis).

Auxiliary-loss-free balancing and EPLB state live outside "params" (collections "ExpertBias"
and "ReplicaMap"); the layer's methods update them through `apply`:

    variables = layer.init(key, x)
    (y, stats) = layer.apply(variables, x)
    _, updated = layer.apply(variables, stats.load, nnx_method="update_bias",
                             mutable=["ExpertBias"])
"""

from __future__ import annotations

from flax import linen as nn
from flax import nnx

from jax_ep.nn import moe


def _box(variable: nnx.Variable):
    """An NNX parameter with logical axis names as Linen's box for them."""
    metadata = variable.get_metadata()
    if metadata.get("out_sharding") is None:
        return variable.get_value()
    return nn.LogicallyPartitioned(variable.get_value(), names=metadata["out_sharding"],
                                   mesh=metadata.get("mesh"),
                                   rules=metadata.get("sharding_rules"))


def MoE(hidden: int, ffn_hidden: int, router: moe.RouterConfig, *, name: str | None = None,
        **kwargs) -> nn.Module:
    """The Linen module of `jax_ep.nn.MoE(hidden, ffn_hidden, router, **kwargs)` (every
    argument but `rngs`); `name` names it in its parent."""
    if "rngs" in kwargs:
        raise TypeError("jax_ep.nn.linen.MoE: pass no rngs; Linen's 'params' RNG (the key "
                        "given to init) initializes the layer.")
    return nnx.bridge.to_linen(moe.MoE, hidden, ffn_hidden, router, metadata_fn=_box,
                               name=name, **kwargs)


__all__ = ["MoE"]
