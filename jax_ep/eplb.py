"""Expert-parallel load balancing (EPLB): redundant experts and their placement on GPUs.

Some experts receive far more tokens than others, and the GPU that holds the hottest ones
sets the pace of every step. The balancer copies heavy ("logical") experts into extra
"physical" experts and places the physical experts on GPUs so that the expected load per GPU
is even. It follows the policies of DeepSeek's EPLB:

- hierarchical (when the nodes divide the expert groups): whole groups are packed to nodes
  (so that group-limited routing keeps its traffic inside a node), replicas are added within
  each node, and each node's physical experts are packed to its GPUs;
- global (otherwise): the same with one group and one node, replicas placed anywhere.

Both run on the host with NumPy (`rebalance_experts`). The functions used inside the MoE
layer, under `jit`/`shard_map`, are `choose_replicas` (logical choices to physical ids, with
static shapes) and `physical_expert_weights` (one parameter block per physical expert).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ReplicaPlan",
    "balance",
    "balanced_packing",
    "choose_replicas",
    "gpu_loads",
    "physical_expert_weights",
    "rebalance_experts",
    "replicate_experts",
]


# ---------------------------------------------------------------------------------------------
# The policies (host, NumPy)


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Packs the n items of each row into `num_packs` packs of n/num_packs items each.

    Items are taken heaviest first (ties: lower index first) and each goes to the lightest
    pack that still has room (ties: lower pack index). With one item per pack, item i goes to
    pack i: every assignment is then equally balanced, and keeping the order keeps the
    placement stable.

    Args:
      weight: float [X, n] item weights, n a multiple of num_packs.
      num_packs: m.

    Returns:
      (pack_index, rank_in_pack), int64 [X, n]: the pack of each item and its position there
      (the order in which items entered the pack).
    """
    rows, num_items = weight.shape
    per_pack = num_items // num_packs
    if per_pack == 1:
        return (
            np.broadcast_to(np.arange(num_items), weight.shape).copy(),
            np.zeros(weight.shape, np.int64),
        )
    order = np.argsort(-weight, axis=-1, kind="stable")
    row = np.arange(rows)
    pack_index = np.empty(weight.shape, np.int64)
    rank_in_pack = np.empty(weight.shape, np.int64)
    pack_load = np.zeros((rows, num_packs))
    pack_items = np.zeros((rows, num_packs), np.int64)
    for step in range(num_items):  # greedy: sequential in the items, vectorized over rows
        item = order[:, step]
        pack = np.where(pack_items < per_pack, pack_load, np.inf).argmin(axis=-1)
        pack_index[row, item] = pack
        rank_in_pack[row, item] = pack_items[row, pack]
        pack_load[row, pack] += weight[row, item]
        pack_items[row, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(
    weight: np.ndarray, num_physical: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Adds replicas one at a time, each to the expert with the largest load per replica.

    Args:
      weight: float [X, E] loads of the logical experts.
      num_physical: P >= E, the experts after replication.

    Returns:
      phy2log int64 [X, P]: physical expert j copies logical expert phy2log[j]; the first E
        are the experts themselves, the others the replicas in the order they were added.
      replica_rank int64 [X, P]: which replica of its logical expert j is (0 for the first).
      logcnt int64 [X, E]: replicas of each logical expert (>= 1).
    """
    rows, num_logical = weight.shape
    row = np.arange(rows)
    phy2log = np.tile(np.arange(num_physical), (rows, 1))
    replica_rank = np.zeros((rows, num_physical), np.int64)
    logcnt = np.ones((rows, num_logical), np.int64)
    for j in range(num_logical, num_physical):
        hottest = (weight / logcnt).argmax(axis=-1)  # ties: lower expert id
        phy2log[:, j] = hottest
        replica_rank[:, j] = logcnt[row, hottest]
        logcnt[row, hottest] += 1
    return phy2log, replica_rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    """The inverse of each row of a permutation [X, n]."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[-1]), perm.shape), -1)
    return inv


def _rebalance_hierarchical(
    weight: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [L, E] -> (phy2log [L, P], replica_rank [L, P], logcnt [L, E])."""
    layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical // num_nodes
    per_gpu = num_physical // num_gpus

    # 1. Whole groups to nodes. Renumber the logical experts node-major ("nlog" ids): node n
    # owns nlog ids [n * E/N, (n+1) * E/N), its groups in the order they were packed.
    group_load = weight.reshape(layers, num_groups, group_size).sum(-1)
    group_node, group_slot = balanced_packing(group_load, num_nodes)
    group_start = (group_node * (num_groups // num_nodes) + group_slot) * group_size
    log2nlog = (group_start[:, :, None] + np.arange(group_size)).reshape(layers, num_logical)
    nlog2log = _inverse(log2nlog)

    # 2. Replicas within each node; one row per (layer, node).
    node_load = np.take_along_axis(weight, nlog2log, -1).reshape(-1, logical_per_node)
    rep2nlog, rep_rank, nlogcnt = replicate_experts(node_load, physical_per_node)

    # 3. Each node's replicas to its GPUs, weighed by the load each replica takes.
    rep_load = np.take_along_axis(node_load / nlogcnt, rep2nlog, -1)
    gpu, slot = balanced_packing(rep_load, num_gpus // num_nodes)
    phy2rep = _inverse(gpu * per_gpu + slot)  # physical slot on the node -> replica

    phy2nlog = np.take_along_axis(rep2nlog, phy2rep, -1).reshape(layers, num_nodes, -1)
    phy2nlog = phy2nlog + (np.arange(num_nodes) * logical_per_node)[:, None]
    phy2log = np.take_along_axis(nlog2log, phy2nlog.reshape(layers, num_physical), -1)
    replica_rank = np.take_along_axis(rep_rank, phy2rep, -1).reshape(layers, num_physical)
    logcnt = np.take_along_axis(nlogcnt.reshape(layers, num_logical), log2nlog, -1)
    return phy2log, replica_rank, logcnt


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"rebalance_experts: {name} must be a positive int; got {value!r}.")
    return int(value)


def _check_rebalance_args(
    weight: Any, num_replicas: Any, num_groups: Any, num_nodes: Any, num_gpus: Any
) -> tuple[np.ndarray, int, int, int, int]:
    w = np.asarray(weight)
    if (
        w.ndim not in (1, 2)
        or w.shape[-1] == 0
        or not (np.issubdtype(w.dtype, np.integer) or np.issubdtype(w.dtype, np.floating))
    ):
        raise ValueError(
            f"rebalance_experts: weight must be a real array [L, E] or [E] of expert loads "
            f"with E >= 1; got {w.dtype} {list(w.shape)}."
        )
    w = w.astype(np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(
            "rebalance_experts: weight must hold finite, non-negative loads "
            "(e.g. tokens per expert); clip or fill the bad entries first."
        )
    counts = [
        _check_count(name, value)
        for name, value in (
            ("num_replicas", num_replicas),
            ("num_groups", num_groups),
            ("num_nodes", num_nodes),
            ("num_gpus", num_gpus),
        )
    ]
    replicas, groups, nodes, gpus = counts
    num_logical = w.shape[-1]
    if replicas < num_logical:
        raise ValueError(
            f"rebalance_experts: num_replicas ({replicas}) must be at least the number of "
            f"logical experts ({num_logical}); add redundant experts, never remove any."
        )
    if replicas % gpus:
        raise ValueError(
            f"rebalance_experts: num_replicas ({replicas}) must be a multiple of num_gpus "
            f"({gpus}) so that every GPU holds as many experts; round it up to "
            f"{-(-replicas // gpus) * gpus}."
        )
    if gpus % nodes:
        raise ValueError(
            f"rebalance_experts: num_gpus ({gpus}) must be a multiple of "
            f"num_nodes ({nodes}): every node has as many GPUs."
        )
    if num_logical % groups:
        raise ValueError(
            f"rebalance_experts: num_groups ({groups}) must divide the number of logical "
            f"experts ({num_logical}); pass the router's group count, or 1 without groups."
        )
    return w, replicas, groups, nodes, gpus


def rebalance_experts(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicates and places experts so that the expected load per GPU is balanced.

    The hierarchical policy runs when num_nodes divides num_groups, the global one otherwise.
    Physical expert j lives on GPU j // (P / num_gpus) (and node j // (P / num_nodes)).

    Args:
      weight: [L, E] (or [E] for one layer) non-negative load of each logical expert, e.g. a
        moving average of tokens per expert.
      num_replicas: P, physical experts per layer: at least E and a multiple of num_gpus.
      num_groups: expert groups of the router (E a multiple of it); 1 without groups.
      num_nodes: server nodes (the fast links, e.g. NVLink, are inside a node).
      num_gpus: GPUs in all, a multiple of num_nodes.

    Returns:
      phy2log: int64 [L, P], the logical expert each physical expert holds.
      log2phy: int64 [L, E, max_replicas], the physical experts of each logical expert, in the
        order the replicas were added, padded with -1 (max_replicas = logcnt.max()).
      logcnt: int64 [L, E], replicas of each logical expert (>= 1; sums to P).
      For a 1-D weight [E] the layer axis is dropped: [P], [E, max_replicas], [E].

    Raises:
      ValueError: for a weight that is not a finite non-negative [L, E] or [E] array, or
        counts that do not fit together (the message names the argument and the fix).
    """
    w, replicas, groups, nodes, gpus = _check_rebalance_args(
        weight, num_replicas, num_groups, num_nodes, num_gpus
    )
    loads = w.reshape(-1, w.shape[-1])
    if groups % nodes == 0:
        phy2log, replica_rank, logcnt = _rebalance_hierarchical(
            loads, replicas, groups, nodes, gpus
        )
    else:
        phy2log, replica_rank, logcnt = _rebalance_hierarchical(loads, replicas, 1, 1, gpus)
    layers, num_logical = loads.shape
    log2phy = np.full((layers, num_logical, int(logcnt.max())), -1, np.int64)
    log2phy[np.arange(layers)[:, None], phy2log, replica_rank] = np.arange(replicas)
    if w.ndim == 1:
        return phy2log[0], log2phy[0], logcnt[0]
    return phy2log, log2phy, logcnt


def gpu_loads(
    weight: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray, num_gpus: int
) -> np.ndarray:
    """Expected load per GPU when each logical expert's load splits evenly over its replicas.

    Args:
      weight: [L, E] or [E] logical loads.
      phy2log: int [L, P] or [P] (P a multiple of num_gpus; physical j on GPU j // (P/G)).
      logcnt: int [L, E] or [E].
      num_gpus: G.

    Returns:
      float64 [L, G] (or [G] for 1-D inputs).
    """
    w = np.asarray(weight, np.float64)
    phy2log, logcnt = np.asarray(phy2log), np.asarray(logcnt)
    if phy2log.shape[-1] % num_gpus:
        raise ValueError(
            f"gpu_loads: phy2log has {phy2log.shape[-1]} physical experts, not a "
            f"multiple of num_gpus ({num_gpus}); pass the GPU count it was "
            f"built for."
        )
    if not w.ndim == phy2log.ndim == logcnt.ndim or w.shape != logcnt.shape:
        raise ValueError(
            f"gpu_loads: weight {list(w.shape)}, phy2log {list(phy2log.shape)} and logcnt "
            f"{list(logcnt.shape)} must be [L, E], [L, P], [L, E] (or all without L)."
        )
    per_replica = np.take_along_axis(w / logcnt, phy2log, -1)
    return per_replica.reshape(*phy2log.shape[:-1], num_gpus, -1).sum(-1)


def balance(loads: np.ndarray) -> np.ndarray | float:
    """max / mean over the last axis (1.0 is perfect balance; all-zero loads count as 1.0)."""
    loads = np.asarray(loads, np.float64)
    mean = loads.mean(-1)
    ratio = np.divide(loads.max(-1), mean, out=np.ones_like(mean), where=mean > 0)
    return float(ratio) if ratio.ndim == 0 else ratio


@dataclasses.dataclass(frozen=True, eq=False)
class ReplicaPlan:
    """One layer's physical experts: what the MoE layer needs to route through replicas.

    Attributes:
      phy2log: int64 [P], the logical expert of each physical expert (P/num_gpus per GPU).
      log2phy: int64 [E, P - E + 1], the replicas of each logical expert, -1 padded. The
        width is the most replicas any plan of these sizes can give, so a new plan has the
        same shapes (swapping it in needs no recompilation).
      logcnt: int64 [E], replicas per logical expert.
      num_gpus: GPUs (EP ranks) the physical experts are spread over.
    """

    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    num_gpus: int

    @classmethod
    def build(
        cls, load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
    ) -> ReplicaPlan:
        """The plan of `rebalance_experts` for one layer's load [E]."""
        if np.ndim(load) != 1:
            raise ValueError(
                f"ReplicaPlan.build: load must be one layer's loads [E]; got "
                f"shape {list(np.shape(load))}. Build one plan per layer."
            )
        phy2log, log2phy, logcnt = rebalance_experts(
            load, num_replicas, num_groups, num_nodes, num_gpus
        )
        width = num_replicas - logcnt.shape[0] + 1
        padded = np.full((logcnt.shape[0], width), -1, np.int64)
        padded[:, : log2phy.shape[1]] = log2phy
        return cls(phy2log, padded, logcnt, num_gpus)

    @classmethod
    def identity(cls, num_experts: int, num_gpus: int) -> ReplicaPlan:
        """No replicas: physical expert e is logical expert e (E/num_gpus per GPU)."""
        if num_experts % num_gpus:
            raise ValueError(
                f"ReplicaPlan.identity: num_experts ({num_experts}) must be a "
                f"multiple of num_gpus ({num_gpus})."
            )
        experts = np.arange(num_experts)
        return cls(experts, experts[:, None].copy(), np.ones(num_experts, np.int64), num_gpus)

    @property
    def num_physical(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_logical(self) -> int:
        return int(self.logcnt.shape[0])


# ---------------------------------------------------------------------------------------------
# Inside the MoE layer (JAX: static shapes, no host synchronization)


def choose_replicas(
    topk_idx: jax.Array, log2phy: jax.Array, logcnt: jax.Array, *, offset: int | jax.Array = 0
) -> jax.Array:
    """Sends each logical choice to one replica of its expert (per shard, jit-friendly).

    The n-th occurrence of logical expert e in this shard's `topk_idx` (token-major order)
    goes to replica (n + offset) mod logcnt[e], so the replicas of e share this shard's
    choices of e evenly (within one). An `offset` that differs per rank, e.g.
    `jax.lax.axis_index("ep")`, spreads those remainders over the replicas too.

    Args:
      topk_idx: int [T, K] logical expert ids in [0, E); -1 masks a choice.
      log2phy: int [E, W] physical ids of each expert's replicas (-1 padded), W >= max logcnt.
      logcnt: int [E] replicas per expert (>= 1).
      offset: int scalar added to every occurrence count.

    Returns:
      int32 [T, K] physical expert ids; -1 stays -1, and ids outside [-1, E) become -2, which
      dispatch counts as invalid (they are never addresses).
    """
    if topk_idx.ndim != 2 or not jnp.issubdtype(topk_idx.dtype, jnp.integer):
        raise ValueError(
            f"choose_replicas: topk_idx must be int [T, K]; got "
            f"{topk_idx.dtype} {list(topk_idx.shape)}."
        )
    if log2phy.ndim != 2 or logcnt.shape != log2phy.shape[:1]:
        raise ValueError(
            f"choose_replicas: log2phy must be [E, W] and logcnt [E]; got "
            f"{list(log2phy.shape)} and {list(logcnt.shape)}. Pass one "
            f"layer's maps (ReplicaPlan.log2phy, ReplicaPlan.logcnt)."
        )
    num_logical = logcnt.shape[0]
    flat = topk_idx.reshape(-1).astype(jnp.int32)
    valid = (flat >= 0) & (flat < num_logical)
    key = jnp.where(valid, flat, num_logical)  # masked and invalid ids sort last
    # Occurrence number of each choice among the choices of its expert: a stable sort groups
    # them in token-major order; the distance to the start of its run is the count.
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    position = jnp.arange(flat.shape[0], dtype=jnp.int32)
    is_start = (position == 0) | (sorted_key != jnp.roll(sorted_key, 1))
    run_start = jax.lax.cummax(jnp.where(is_start, position, 0))
    occurrence = jnp.zeros_like(flat).at[order].set(position - run_start)

    expert = jnp.where(valid, flat, 0)
    count = jnp.maximum(jnp.asarray(logcnt, jnp.int32)[expert], 1)
    replica = (occurrence + jnp.asarray(offset, jnp.int32)) % count
    physical = jnp.asarray(log2phy, jnp.int32)[expert, replica]
    physical = jnp.where(valid, physical, jnp.where(flat == -1, -1, -2))
    return physical.reshape(topk_idx.shape)


def physical_expert_weights(logical_params: Any, phy2log: jax.Array, *, axis: int = 0) -> Any:
    """Per-physical-expert parameters gathered from the logical ones.

    Applies `jnp.take(leaf, phy2log, axis)` to every leaf of a pytree, e.g. [E, H, F] ->
    [P, H, F]. Under autodiff the gradient of a logical expert is the sum of its replicas'
    gradients, so training updates the logical parameters as if there were no replicas.
    """
    index = jnp.asarray(phy2log)
    return jax.tree.map(lambda leaf: jnp.take(leaf, index, axis=axis), logical_params)
