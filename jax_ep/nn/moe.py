"""The MoE layer (Flax NNX): router, routed SwiGLU experts over expert parallelism, shared
experts.

Tokens are split over every axis of the mesh; the experts over the EP axis (expert e on EP
rank e // (E/R)), so each group of devices along the EP axis is one EP group. Inside
`shard_map` each device routes its tokens, `jax_ep.dispatch`es them expert-major, runs its
local experts with `jax.lax.ragged_dot` and `jax_ep.combine`s the weighted outputs home. The
layer owns the parameters only; all communication is jax_ep's ops.

Parameters carry Flax sharding metadata in logical axis names (`LOGICAL_AXES`) and the rules
that map them to mesh axes, so `nnx.get_partition_spec` and `nnx.get_named_sharding` give
their placement: "expert" on the EP axis; "embed" and "mlp" replicated unless
`sharding_rules` maps them to another mesh axis, where they are stored sharded and gathered
for each call (the FSDP pattern).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _checks, backends, eplb, quant
from jax_ep.nn import router as routing
from jax_ep.nn.router import RouterConfig
from jax_ep.overlap import Comm, Compute

# Each parameter's axes in logical names; `sharding_rules` maps the names to mesh axes.
LOGICAL_AXES = {
    "router": ("embed", None),
    "w_gate": ("expert", "embed", "mlp"),
    "w_up": ("expert", "embed", "mlp"),
    "w_down": ("expert", "mlp", "embed"),
    "shared": (("embed", "mlp"), ("embed", "mlp"), ("mlp", "embed")),
}


def default_sharding_rules(ep_axis: str = "ep", logical_axes: dict[str, str] | None = None
                           ) -> tuple[tuple[str, str | None], ...]:
    """The layer's logical-to-mesh axis rules: experts over `ep_axis`, the rest replicated
    (in the names of `logical_axes`, as `MoE` takes it)."""
    names = _axis_names(logical_axes)
    return ((names["expert"], ep_axis), (names["embed"], None), (names["mlp"], None))


def _axis_names(logical_axes) -> dict[str, str]:
    """The names the parameters carry for the layer's logical axes."""
    names = {name: name for name in ("expert", "embed", "mlp")}
    for axis, name in dict(logical_axes or {}).items():
        if axis not in names or not isinstance(name, str):
            raise ValueError(f"MoE: logical_axes maps the layer's axes {sorted(names)} to the "
                             f"names its parameters carry (e.g. MaxText's {{'expert': 'exp', "
                             f"'embed': 'embed_no_exp'}}); got {axis!r}: {name!r}.")
        names[axis] = name
    if len(set(names.values())) != len(names):
        raise ValueError(f"MoE: logical_axes gives two of the layer's axes one name: {names}.")
    return names


def _merged_rules(rules, mesh: Mesh, ep_axis: str, names: dict[str, str]
                  ) -> tuple[tuple[str, str | None], ...]:
    expert, embed, mlp = names["expert"], names["embed"], names["mlp"]
    merged = dict(default_sharding_rules(ep_axis, names))
    for name, axis in rules or ():
        if name not in merged:
            raise ValueError(f"MoE: sharding_rules names the logical axis {name!r}; the layer's"
                             f" axes are {sorted(merged)}.")
        if name == expert and axis != ep_axis:
            raise ValueError(f"MoE: sharding_rules maps {expert!r} to {axis!r}, but the experts "
                             f"live on the EP axis {ep_axis!r}; pass ep_axis={axis!r} instead.")
        if axis is not None and (axis not in mesh.axis_names or axis == ep_axis):
            raise ValueError(f"MoE: sharding_rules maps {name!r} to {axis!r}, which is not a "
                             f"mesh axis other than the EP axis {ep_axis!r} (mesh axes: "
                             f"{mesh.axis_names}).")
        merged[name] = axis
    if merged[embed] is not None and merged[embed] == merged[mlp]:
        raise ValueError(f"MoE: sharding_rules maps both {embed!r} and {mlp!r} to "
                         f"{merged[embed]!r}; one mesh axis can shard only one of a "
                         f"weight's dimensions.")
    return tuple(merged.items())


class ExpertBias(nnx.Variable):
    """The per-expert selection bias of auxiliary-loss-free balancing (not trained by
    gradients: `MoE.update_bias` moves it from the observed load)."""


class ReplicaMap(nnx.Variable):
    """A piece of the layer's redundant-expert placement (`jax_ep.eplb.ReplicaPlan`): not
    trained, replaced by `MoE.rebalance`. Held as arrays so a new plan needs no recompile."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEStats:
    """What a forward pass observed.

    Attributes:
      load: float32 [E], choices per expert over the whole batch (all devices).
      aux_loss: float32 [], the auxiliary balance loss (1.0 when balanced); add
        `aux_loss_weight * aux_loss` to the training loss if you use it.
      dropped: int32 [], expert entries dropped by the dispatch capacity (0 by default).
      rank_load: int32 [R], expert entries each EP rank received (summed over the other
        mesh axes): the balance the devices see, after replication.
      nonfinite: int32 [], tokens whose input held a NaN or infinity: routed as zero rows
        and left out of aux_loss (their own outputs are not finite).
    """

    load: jax.Array
    aux_loss: jax.Array
    dropped: jax.Array
    rank_load: jax.Array
    nonfinite: jax.Array


def _chosen(choice, tokens: int, top_k: int) -> tuple[jax.Array, jax.Array]:
    """A router_fn's (topk_idx, topk_weights), checked, as int32 and float32."""
    ok = isinstance(choice, tuple) and len(choice) == 2
    idx, weights = choice if ok else (None, None)
    want = (tokens, top_k)
    if not ok or getattr(idx, "shape", None) != want or getattr(weights, "shape", None) != want \
            or not jnp.issubdtype(idx.dtype, jnp.integer) \
            or not jnp.issubdtype(weights.dtype, jnp.floating):
        got = choice if not ok else f"{jax.typeof(idx)}, {jax.typeof(weights)}"
        raise ValueError(f"MoE: router_fn must return (topk_idx int [{tokens}, {top_k}], "
                         f"topk_weights float [{tokens}, {top_k}]) for logits of {tokens} "
                         f"tokens (top_k = router.top_k); got {got}.")
    return idx.astype(jnp.int32), weights.astype(jnp.float32)


def _swiglu(x, w_gate, w_up, w_down, group_sizes=None):
    if group_sizes is None:
        h = jax.nn.silu(x @ w_gate) * (x @ w_up)
        return h @ w_down
    gate = jax.lax.ragged_dot(x, w_gate, group_sizes)
    up = jax.lax.ragged_dot(x, w_up, group_sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)


class MoE(nnx.Module):
    """A DeepSeek-V3-style MoE block with expert parallelism through jax_ep.

    Args:
      hidden: H, the model width.
      ffn_hidden: width of each routed expert's SwiGLU (and of each shared expert).
      router: the routing rule (`RouterConfig`: E, top-k, score, groups, scaling).
      mesh: the device mesh; tokens are split over all its axes, experts over `ep_axis`.
      ep_axis: the mesh axis of expert parallelism (its size must divide E).
      num_shared_experts: experts every token goes through (0: none).
      capacity: expert entries per device after dispatch (default: never drops).
      capacity_factor: instead of `capacity`, a multiple of the entries a device receives on
        average under uniform routing (T*K for T tokens per device; see
        `jax_ep.capacity_from_factor`).
      expert_alignment: start every local expert's rows at a multiple of this many rows (as
        grouped GEMM kernels want; see `jax_ep.dispatch`); None: packed.
      drop_order: which entries a full capacity keeps (`jax_ep.dispatch`'s: None, the
        layout's order; "source", MaxText's).
      partial_dtype: the dtype each rank's partial sum of a token travels home in
        (`jax_ep.combine`'s; default the computation dtype); jnp.float32 rounds only the
        output (MaxText's float32_weight_sum), for twice the combine's bytes.
      wire_format: send the tokens to the experts as this `jax_ep.quant` format ("e4m3",
        "e4m3_ue8m0", "mxfp8", "nvfp4"; `jax_ep.dispatch`'s): they arrive dequantized in
        the computation dtype, and their gradients go back straight through the rounding in
        that dtype.
      grad_wire_format: the output's gradients travel to the experts as this format (the
        combine's backward, a dispatch: `jax_ep.combine`'s grad_wire_format; DeepSeek-V3
        sends them in FP8); the combines stay in the computation dtype.
      fp8_dispatch: deprecated: wire_format="e4m3" (the same bits), which it warns of.
      bias_rate: step of the auxiliary-loss-free bias update.
      redundant_experts: extra physical experts holding copies of hot ones (EPLB); E plus
        this must be a multiple of the EP axis size. `rebalance(stats.load)` places them;
        replicas share their logical expert's parameters, so results do not change. Each
        call gathers the replicas' weights from all experts (memory for every expert on
        every device): meant for layers whose experts fit on one device.
      num_nodes: nodes the EP group spans, for EPLB's hierarchical policy (groups of
        experts kept on nodes when the nodes divide `router.num_groups`).
      overlap: split each device's tokens into two micro-batches and interleave them
        (`jax_ep.overlap.run`) so that one's dispatch and combine can run under the
        other's compute; the token count per device must then be even. The dispatch and
        combine then run on GPU stream `jax_ep.overlap.COMM_STREAM`, beside the compute.
      backend: jax_ep backend ("auto", "xla", "cuda").
      num_sms: SMs each kernel launch of the dispatch and combine may take (the "cuda"
        backend; None: every SM).
      sharding_rules: (logical axis, mesh axis or None) pairs over `default_sharding_rules`:
        e.g. (("mlp", "tp"),) stores the experts' FFN dimension sharded over a "tp" axis
        (parameters and optimizer state take 1/size of the memory; each call gathers the
        local experts' weights). "expert" always maps to `ep_axis`.
      logical_axes: other names for the logical axes "expert", "embed" and "mlp", which the
        parameters' metadata and `sharding_rules` then use (e.g. MaxText's {"expert": "exp",
        "embed": "embed_no_exp"}, so that MaxText's rules resolve them as its own MoE's).
      param_dtype: the parameters' dtype (e.g. float32 master weights).
      dtype: the computation dtype (e.g. bfloat16); None: the inputs' and parameters'
        promoted dtype.
      router_fn: any other router: `router_fn(logits [T, E]) -> (topk_idx int [T, K],
        topk_weights float [T, K])` (K = router.top_k; -1 masks a choice) chooses instead of
        `router`'s rule, which still gives the scores of the statistics (aux_loss); the
        expert bias does not steer it.
      rngs: nnx.Rngs for the initial parameters.
    """

    def __init__(self, hidden: int, ffn_hidden: int, router: RouterConfig, *, mesh: Mesh,
                 ep_axis: str = "ep", num_shared_experts: int = 0, capacity: int | None = None,
                 capacity_factor: float | None = None, expert_alignment: int | None = None,
                 drop_order: Literal["expert", "source"] | None = None,
                 partial_dtype=None, wire_format: str | None = None,
                 grad_wire_format: str | None = None,
                 fp8_dispatch: bool = False, bias_rate: float = 1e-3,
                 overlap: bool = False,
                 redundant_experts: int = 0, num_nodes: int = 1,
                 backend: Literal["auto", "xla", "cuda"] = "auto",
                 num_sms: int | None = jax_ep.DEFAULT_NUM_SMS,
                 sharding_rules=None, param_dtype=jnp.float32, dtype=None,
                 router_fn: Callable[[jax.Array], tuple[jax.Array, jax.Array]] | None = None,
                 logical_axes: dict[str, str] | None = None, rngs: nnx.Rngs):
        if not _checks.is_finite_number(bias_rate) or bias_rate < 0:
            raise ValueError(f"MoE: bias_rate must be a finite number >= 0 (0: no bias "
                             f"update); got {bias_rate!r}.")
        if ep_axis not in mesh.axis_names:
            raise ValueError(f"MoE: ep_axis {ep_axis!r} is not an axis of the mesh "
                             f"{mesh.axis_names}.")
        if router.num_experts % mesh.shape[ep_axis]:
            raise ValueError(f"MoE: num_experts ({router.num_experts}) must be a multiple of "
                             f"the EP axis size ({mesh.shape[ep_axis]}).")
        E, H, F = router.num_experts, hidden, ffn_hidden
        self.config = router
        self.mesh, self.ep_axis, self.capacity = mesh, ep_axis, capacity
        self.capacity_factor, self.expert_alignment = capacity_factor, expert_alignment
        self.bias_rate, self.backend = bias_rate, backend
        self.overlap, self.num_sms, self.partial_dtype = overlap, num_sms, partial_dtype
        self.drop_order = drop_order
        if fp8_dispatch:
            if wire_format is not None:
                raise ValueError("MoE: pass wire_format or fp8_dispatch, not both (fp8_dispatch "
                                 "is wire_format='e4m3').")
            warnings.warn("MoE(fp8_dispatch=True) is deprecated: pass wire_format='e4m3' (the "
                          "same rounding, gradients straight through it).", DeprecationWarning,
                          stacklevel=2)
            wire_format = "e4m3"
        for name, f in (("wire_format", wire_format), ("grad_wire_format", grad_wire_format)):
            if f is not None:
                quant.check_format("MoE", name, f, hidden, "the hidden size")
        self.wire_format, self.grad_wire_format = wire_format, grad_wire_format
        self.dtype, self.param_dtype = dtype, param_dtype
        if router_fn is not None and not callable(router_fn):
            raise TypeError(f"MoE: router_fn must be a function of the router's logits "
                            f"[T, E] returning (topk_idx [T, K], topk_weights [T, K]); got "
                            f"{router_fn!r}.")
        self.router_fn = router_fn
        names = _axis_names(logical_axes)
        self.sharding_rules = rules = _merged_rules(sharding_rules, mesh, ep_axis, names)
        R = mesh.shape[ep_axis]
        if redundant_experts < 0 or (E + redundant_experts) % R:
            raise ValueError(f"MoE: num_experts + redundant_experts ({E} + {redundant_experts})"
                             f" must be a multiple of the EP axis size ({R}).")
        self.placement = (E + redundant_experts, router.num_groups, num_nodes, R)
        # Until the first rebalance, placed as if every expert were as hot as the others.
        self.replicas = nnx.List([ReplicaMap(jnp.asarray(a)) for a in self._plan(
            np.ones(E))]) if redundant_experts else None

        mesh_axes = dict(rules)

        def normal(key, shape, fan_in, axes):
            axes = tuple(names[a] if a else None for a in axes)  # as the parameters carry them
            spec = P(*(mesh_axes.get(n) for n in axes))
            for size, axis in zip(shape, spec, strict=True):
                if axis is not None and size % mesh.shape[axis]:
                    raise ValueError(f"MoE: a weight of shape {shape} cannot be sharded over "
                                     f"mesh axis {axis!r} of size {mesh.shape[axis]} (logical "
                                     f"axes {axes}); change sharding_rules or the widths.")
            value = jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5
            # Placed here, whatever Flax's eager-sharding setting; the metadata tells Flax
            # (get_partition_spec, a jitted init, Linen boxes) where it lives.
            return nnx.Param(jax.device_put(value.astype(param_dtype), NamedSharding(mesh, spec)),
                             out_sharding=axes, sharding_rules=rules, mesh=mesh,
                             eager_sharding=False)

        axes = LOGICAL_AXES
        self.router = normal(rngs.params(), (H, E), H, axes["router"])
        self.expert_bias = ExpertBias(jnp.zeros((E,), jnp.float32))
        # expert e lives on EP rank e // (E/R)
        self.w_gate = normal(rngs.params(), (E, H, F), H, axes["w_gate"])
        self.w_up = normal(rngs.params(), (E, H, F), H, axes["w_up"])
        self.w_down = normal(rngs.params(), (E, F, H), F, axes["w_down"])
        S = num_shared_experts * F  # the shared experts as one SwiGLU of width S
        self.shared = nnx.List([
            normal(rngs.params(), shape, shape[0], names)
            for shape, names in zip(((H, S), (H, S), (S, H)), axes["shared"], strict=True)
        ]) if S else None

    def __call__(self, x: jax.Array, mask: jax.Array | None = None
                 ) -> tuple[jax.Array, MoEStats]:
        """x [..., H] -> (y [..., H], MoEStats). The token count must be a multiple of the
        number of devices of the mesh. `mask` (bool, x.shape[:-1]) marks real tokens: the
        others (padding) go to no routed expert and count in no statistic."""
        shape = x.shape
        router, expert_bias, w_gate, w_up, w_down = self._routing_params()
        hidden = router.shape[0]
        if x.ndim < 1 or shape[-1] != hidden:
            raise ValueError(f"MoE: x must be [..., hidden] with the layer's hidden size "
                             f"{hidden}; got shape {list(shape)}.")
        axes = tuple(self.mesh.axis_names)
        tokens = x.reshape(-1, shape[-1])
        if mask is None:
            mask = jnp.ones(shape[:-1], bool)
        if mask.shape != shape[:-1]:
            raise ValueError(f"MoE: mask must have the shape of x without its last axis, "
                             f"{shape[:-1]}; got {mask.shape}.")
        valid = mask.reshape(-1)
        shared = () if self.shared is None else tuple(w[...] for w in self.shared)
        # Computed in `dtype` (the parameters cast from `param_dtype` before they move).
        tokens, router_w, *weights = dtypes.promote_dtype(
            (tokens, router[...], w_gate[...], w_up[...], w_down[...], *shared),
            dtype=self.dtype)
        weights, shared = tuple(weights[:3]), weights[3:]
        placed = jax.typeof(tokens).sharding.spec  # restored on the way out
        devices = self.mesh.size
        if tokens.shape[0] % devices:
            raise ValueError(f"MoE: {tokens.shape[0]} tokens do not split evenly over the "
                             f"{devices} devices of the mesh; pad the batch.")
        cfg, ep, E = self.config, self.ep_axis, self.config.num_experts
        bias = jax.lax.stop_gradient(expert_bias[...])

        num_physical = self.placement[0]
        stream = jax_ep.overlap.COMM_STREAM if self.overlap else None

        def per_device(x, valid, router_w, bias, w_gate, w_up, w_down, *maps):
            log2phy, logcnt = maps if maps else (None, None)
            options = (("num_experts", num_physical), ("axis_name", ep),
                       ("capacity", self.capacity), ("capacity_factor", self.capacity_factor),
                       ("expert_alignment", self.expert_alignment),
                       ("on_overflow", "drop"), ("drop_order", self.drop_order),
                       ("backend", backends.resolve(self.backend)), ("num_sms", self.num_sms),
                       ("stream", stream))

            def route(c):
                # A token whose input is not finite is routed as a zero row and left out of
                # the score statistics, so that it cannot make aux_loss (or the router's
                # gradient through it) NaN; its own output stays non-finite.
                finite = jnp.all(jnp.isfinite(c["x"]), axis=1)
                router_x = jnp.where(finite[:, None], c["x"], 0)
                logits = router_x @ router_w
                if self.router_fn is None:
                    idx, weights, scores = routing.select(logits, cfg, bias)
                else:
                    idx, weights = _chosen(self.router_fn(logits), logits.shape[0], cfg.top_k)
                    scores = routing.scores(logits, cfg)
                idx = jnp.where(c["valid"][:, None], idx, -1)  # padding goes nowhere
                physical = idx if log2phy is None else eplb.choose_replicas(
                    idx, log2phy, logcnt, offset=jax.lax.axis_index(ep))
                return {**c, "idx": idx, "physical": physical, "weights": weights,
                        "scores": scores, "counted": c["valid"] & finite}

            def send(c):
                recv, handle = jax_ep.dispatch(c["x"], c["physical"], c["weights"],
                                               expert_major=True, wire_format=self.wire_format,
                                               **dict(options))
                return {**c, "rows": recv.x, "recv": recv, "handle": handle}

            def experts(c):
                rows, recv = c.pop("rows"), c["recv"]
                return {**c, "y": _swiglu(rows, w_gate, w_up, w_down, recv.group_sizes)}

            def combine(c):
                recv, handle = c.pop("recv"), c.pop("handle")
                out = jax_ep.combine(c.pop("y"), handle, topk_weights=recv.topk_weights,
                                     partial_dtype=self.partial_dtype,
                                     grad_wire_format=self.grad_wire_format,
                                     backend=self.backend,
                                     num_sms=self.num_sms, stream=stream)
                return {**c, "out": out, "dropped": recv.num_dropped[None],
                        "received": jnp.sum(recv.tokens_per_expert)[None]}

            block = [Compute("route", route), Comm("dispatch", send),
                     Compute("experts", experts), Comm("combine", combine)]
            inputs = {"x": x, "valid": valid}
            schedule = jax_ep.overlap.run if self.overlap else jax_ep.overlap.apply
            c = schedule(block, inputs)
            # Statistics leave per device, [1, ...] each, and are summed outside: the sums
            # (all-reduces) exist only where a caller uses them, never inside the block.
            valid, idx, counted = c["valid"], c["idx"], c["counted"]
            here = jax.nn.one_hot(jax.lax.axis_index(ep), self.placement[3], dtype=jnp.int32)
            stats = (routing.expert_load(idx, E), jnp.sum(counted, dtype=jnp.float32),
                     jnp.sum(jnp.where(counted[:, None], c["scores"], 0), axis=0),
                     jnp.sum(c["dropped"]), here * jnp.sum(c["received"]),
                     jnp.sum(valid & ~counted, dtype=jnp.int32))
            return c["out"], *(a[None] for a in stats)

        maps = ()
        if self.replicas is not None:  # one weight block per physical expert, and the maps
            phy2log, log2phy, logcnt = (m[...] for m in self.replicas)
            # Gathered from the whole logical set (an all-gather over the EP axis per call):
            # simple and exact for gradients, but it holds every expert on every device.
            weights = eplb.physical_expert_weights(
                tuple(self._place(w, P()) for w in weights), phy2log)
            maps = (log2phy, logcnt)
        specs = (P(axes), P(axes), P(), P(), P(ep), P(ep), P(ep)) + (P(),) * len(maps)
        # Under jit: called eagerly (a Linen init, a first try in a notebook), the layer
        # compiles one program instead of running its body primitive by primitive.
        run = jax.jit(jax.shard_map(per_device, mesh=self.mesh, in_specs=specs,
                                    out_specs=(P(axes),) * 7))
        # Each operand placed as the program expects (a no-op when it already is).
        operands = [self._place(a, spec) for a, spec in zip(
            (tokens, valid, router_w, bias, *weights, *maps), specs, strict=True)]
        out, *per_device_stats = run(*operands)
        load, count, score_sums, dropped, rank_load, nonfinite = (
            self._place(jnp.sum(a, axis=0), P()) for a in per_device_stats)
        aux = routing.balance_loss(load, score_sums / jnp.maximum(count, 1.0))
        if shared:  # gathered where sharding_rules shard them, like the experts
            out = out + _swiglu(tokens, *(self._place(w, P()) for w in shared))
        if self.mesh.are_all_axes_explicit:  # auto axes: XLA's propagation places it
            out = jax.reshard(out, placed)
        out = out.reshape(shape)
        return out, MoEStats(load=load, aux_loss=aux, dropped=dropped,
                             rank_load=rank_load, nonfinite=nonfinite)

    def _routing_params(self) -> tuple[nnx.Variable, ...]:
        """The router [H, E], its selection bias [E] and the routed experts' weights (w_gate
        and w_up [E, H, F], w_down [E, F, H]); a subclass may hold them under other names."""
        return self.router, self.expert_bias, self.w_gate, self.w_up, self.w_down

    def _place(self, a: jax.Array, spec: P) -> jax.Array:
        """`a` placed as `spec` on the layer's mesh: resharded on a mesh of explicit axes,
        constrained on one of auto axes (as MaxText's meshes are)."""
        if self.mesh.are_all_axes_explicit:
            return jax.reshard(a, spec)
        return jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh, spec))

    def _plan(self, load) -> tuple:
        plan = eplb.ReplicaPlan.build(np.asarray(load, np.float64), *self.placement)
        return plan.phy2log, plan.log2phy, plan.logcnt

    def rebalance(self, load: jax.Array) -> None:
        """Places the redundant experts for an observed `MoEStats.load` (or a moving average
        of it) with DeepSeek's EPLB policy; runs on the host, between steps."""
        if self.replicas is None:
            raise ValueError("MoE.rebalance: the layer has no redundant experts; construct "
                             "it with redundant_experts > 0.")
        for variable, value in zip(self.replicas, self._plan(load), strict=True):
            variable[...] = jnp.asarray(value, variable[...].dtype)

    def update_bias(self, load: jax.Array) -> None:
        """Moves the selection bias toward balance from an observed `MoEStats.load`."""
        E = self.config.num_experts
        if getattr(load, "shape", None) != (E,):
            raise ValueError(f"MoE.update_bias: load must be [num_experts] = [{E}] (the "
                             f"MoEStats.load of a step of this layer); got "
                             f"{_checks.describe(load)}.")
        expert_bias = self._routing_params()[1]
        expert_bias[...] = routing.updated_bias(expert_bias[...], load, self.bias_rate)
