"""jax_ep's MoE layer under MaxText's names, in place of MaxText's `RoutedMoE` (docs/maxtext.md).

`RoutedMoE` is `jax_ep.nn.MoE` holding its parameters where MaxText's `RoutedMoE` holds its
own, so that a MaxText model's parameter tree (and checkpoint) keeps its shape:

| MaxText | shape | jax_ep.nn.MoE |
|---|---|---|
| `gate.kernel` | [emb, E] | `router` |
| `gate.bias` | [E] | `expert_bias` (the selection bias; not trained) |
| `wi_0` | [E, emb, mlp] | `w_gate` (through the activation) |
| `wi_1` | [E, emb, mlp] | `w_up` |
| `wo` | [E, mlp, emb] | `w_down` |

named by MaxText's logical axes ("exp", "embed_no_exp", "mlp"), and it returns what MaxText's
returns: `(output, lb_loss, bias_updates)`.
"""

from __future__ import annotations

import jax
from flax import nnx

from jax_ep.nn import moe
from jax_ep.nn import router as routing

# MaxText's names for the layer's logical axes (its rules map "exp" to the expert axes and
# leave "embed_no_exp" unsharded by them).
LOGICAL_AXES = {"expert": "exp", "embed": "embed_no_exp"}


class Gate(nnx.Module):
    """MaxText's gate: `kernel` [emb, E], the router's weights, and `bias` [E], the selection
    bias of auxiliary-loss-free balancing (moved by `bias_updates`, never by gradients)."""

    def __init__(self, kernel: nnx.Param, bias: nnx.Variable):
        self.kernel = kernel
        self.bias = bias


class RoutedMoE(moe.MoE):
    """`jax_ep.nn.MoE` with MaxText's parameter names and return (the module's docstring).

    Args:
      hidden, ffn_hidden, router: as `jax_ep.nn.MoE` (MaxText's emb_dim, moe_mlp_dim, and
        num_experts with num_experts_per_tok in `RouterConfig`; its softmax over the top-k
        is `RouterConfig(normalize_topk=True)`).
      load_balance_loss_weight: `lb_loss` is this times the balance loss (`MoEStats.aux_loss`);
        0: `lb_loss` is None, as MaxText returns it.
      bias_rate: the step of auxiliary-loss-free balancing (MaxText's
        routed_bias_update_rate); 0: `bias_updates` is None.
      logical_axes: default MaxText's names (`LOGICAL_AXES`).
      **kwargs: the other arguments of `jax_ep.nn.MoE` (shared experts excepted: MaxText's
        `RoutedAndSharedMoE` adds its own beside this layer).
    """

    def __init__(self, hidden: int, ffn_hidden: int, router: routing.RouterConfig, *,
                 load_balance_loss_weight: float = 0.0, bias_rate: float = 0.0,
                 logical_axes: dict[str, str] | None = None, **kwargs):
        if kwargs.get("num_shared_experts"):
            raise ValueError("RoutedMoE: MaxText's routed experts have no shared experts (its "
                             "RoutedAndSharedMoE adds them beside the layer); use "
                             "jax_ep.nn.MoE for a block with both.")
        if not isinstance(load_balance_loss_weight, (int, float)) or load_balance_loss_weight < 0:
            raise ValueError(f"RoutedMoE: load_balance_loss_weight must be a number >= 0; got "
                             f"{load_balance_loss_weight!r}.")
        super().__init__(hidden, ffn_hidden, router, bias_rate=bias_rate,
                         logical_axes=LOGICAL_AXES if logical_axes is None else logical_axes,
                         **kwargs)
        self.load_balance_loss_weight = load_balance_loss_weight
        # The parent's parameters, moved to MaxText's places.
        self.gate = Gate(self.router, self.expert_bias)
        self.wi_0, self.wi_1, self.wo = self.w_gate, self.w_up, self.w_down
        del self.router, self.expert_bias, self.w_gate, self.w_up, self.w_down

    def _routing_params(self) -> tuple[nnx.Variable, ...]:
        return self.gate.kernel, self.gate.bias, self.wi_0, self.wi_1, self.wo

    def __call__(self, inputs: jax.Array, mask: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """inputs [..., emb] -> (output [..., emb], lb_loss [] or None, bias_updates [E] or
        None). bias_updates: what this call's load moves `gate.bias` by (add it between
        steps, or call `update_bias(load)`); `mask` as `jax_ep.nn.MoE`."""
        output, stats = super().__call__(inputs, mask)
        lb_loss = (self.load_balance_loss_weight * stats.aux_loss
                   if self.load_balance_loss_weight else None)
        bias_updates = None
        if self.bias_rate:
            bias = self.gate.bias[...]
            bias_updates = routing.updated_bias(bias, stats.load, self.bias_rate) - bias
        return output, lb_loss, bias_updates


__all__ = ["LOGICAL_AXES", "Gate", "RoutedMoE"]
