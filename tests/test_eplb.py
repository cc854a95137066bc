"""The expert-parallel load balancer (jax_ep.eplb): DeepSeek's published example, the
structure of every plan, balance on skewed loads, the greedy steps against plain loops,
replica choice against a NumPy loop, and an MoE through replicas (dispatch, experts, combine
on 8 CPU devices) against the same MoE without them, forward and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import eplb

# ---------------------------------------------------------------------------------------------
# Independent references: the greedy rules written as plain loops over one row.


def packing_loop(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    per_pack = len(weight) // num_packs
    if per_pack == 1:
        return np.arange(len(weight)), np.zeros(len(weight), int)
    load, items = [0.0] * num_packs, [0] * num_packs
    pack_index, rank = np.zeros(len(weight), int), np.zeros(len(weight), int)
    for item in sorted(range(len(weight)), key=lambda i: (-weight[i], i)):
        pack = min((p for p in range(num_packs) if items[p] < per_pack), key=lambda p: (load[p], p))
        pack_index[item], rank[item] = pack, items[pack]
        load[pack] += weight[item]
        items[pack] += 1
    return pack_index, rank


def replicate_loop(weight: np.ndarray, num_physical: int):
    count = [1] * len(weight)
    phy2log, replica_rank = list(range(len(weight))), [0] * len(weight)
    for _ in range(num_physical - len(weight)):
        hottest = max(range(len(weight)), key=lambda e: (weight[e] / count[e], -e))
        phy2log.append(hottest)
        replica_rank.append(count[hottest])
        count[hottest] += 1
    return np.array(phy2log), np.array(replica_rank), np.array(count)


def choose_loop(
    topk_idx: np.ndarray, log2phy: np.ndarray, logcnt: np.ndarray, offset: int
) -> np.ndarray:
    seen = np.zeros(len(logcnt), int)
    out = np.empty_like(topk_idx)
    for t in range(topk_idx.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = topk_idx[t, k]
            if e == -1:
                out[t, k] = -1
            elif not 0 <= e < len(logcnt):
                out[t, k] = -2
            else:
                out[t, k] = log2phy[e, (seen[e] + offset) % logcnt[e]]
                seen[e] += 1
    return out


def contiguous_loads(weight: np.ndarray, num_gpus: int) -> np.ndarray:
    """GPU loads without replicas: E/num_gpus consecutive experts per GPU."""
    return weight.reshape(*weight.shape[:-1], num_gpus, -1).sum(-1)


def check_plan(weight, phy2log, log2phy, logcnt, num_replicas, num_groups, num_nodes):
    """Every structural property a plan must have; hierarchical ones when nodes divide groups."""
    layers, num_logical = weight.shape
    assert phy2log.shape == (layers, num_replicas) and logcnt.shape == (layers, num_logical)
    assert log2phy.shape == (layers, num_logical, logcnt.max())
    for array in (phy2log, log2phy, logcnt):
        assert array.dtype == np.int64
    for layer in range(layers):
        p2l, l2p, cnt = phy2log[layer], log2phy[layer], logcnt[layer]
        assert cnt.min() >= 1 and cnt.sum() == num_replicas
        np.testing.assert_array_equal(np.bincount(p2l, minlength=num_logical), cnt)
        for e in range(num_logical):
            replicas = l2p[e, : cnt[e]]
            assert len(set(replicas.tolist())) == cnt[e]
            np.testing.assert_array_equal(p2l[replicas], e)
            np.testing.assert_array_equal(l2p[e, cnt[e] :], -1)
        if num_groups % num_nodes == 0:
            group_size = num_logical // num_groups
            for node_experts in p2l.reshape(num_nodes, -1):
                experts = np.unique(node_experts)
                groups = np.unique(experts // group_size)
                # whole groups, num_groups / num_nodes of them, and no expert leaves its node
                assert len(groups) == num_groups // num_nodes
                assert len(experts) == len(groups) * group_size


# ---------------------------------------------------------------------------------------------
# The policies


def test_deepseek_published_example():
    # Input and output from the README of github.com/deepseek-ai/EPLB ("Interface and
    # Example"): 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs (hierarchical).
    # The output depends on the reference's tie rule for packing: among equally light packs
    # the lower index wins (every layer's first item meets empty packs).
    weight = np.array(
        [
            [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
            [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
        ]
    )
    want = np.array(
        [
            [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
            [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
        ]
    )
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, 16, 4, 2, 8)
    np.testing.assert_array_equal(phy2log, want)
    check_plan(weight, phy2log, log2phy, logcnt, 16, 4, 2)
    np.testing.assert_array_equal(logcnt[0], [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1])


def test_global_policy_by_hand():
    # Replicas: expert 0 (load 10) twice more. Per-replica loads 10/3 x3, 1, 1, 4 packed into
    # 2 GPUs of 3: 4 -> g0, 10/3 -> g1, 10/3 -> g1, 10/3 -> g0, 1 -> g1 (full), 1 -> g0.
    weight = np.array([10.0, 1.0, 1.0, 4.0])
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, 6, 1, 1, 2)
    np.testing.assert_array_equal(phy2log, [3, 0, 2, 0, 0, 1])
    np.testing.assert_array_equal(logcnt, [3, 1, 1, 1])
    # replica order: the original expert 0 went to slot 3, its replicas to slots 4 and 1
    np.testing.assert_array_equal(log2phy, [[3, 4, 1], [5, -1, -1], [2, -1, -1], [0, -1, -1]])
    loads = eplb.gpu_loads(weight, phy2log, logcnt, 2)
    np.testing.assert_allclose(loads, [4 + 10 / 3 + 1, 10 / 3 + 10 / 3 + 1])
    assert eplb.balance(loads) == pytest.approx((4 + 10 / 3 + 1) / 8)


@pytest.mark.parametrize(
    "num_logical, num_replicas, num_groups, num_nodes, num_gpus",
    [
        (12, 16, 4, 2, 8),  # hierarchical, the published sizes
        (32, 40, 8, 4, 8),  # hierarchical, 2 GPUs per node
        (16, 24, 4, 4, 8),  # hierarchical, one group per node
        (16, 16, 4, 2, 4),  # no redundant experts
        (18, 24, 3, 2, 4),  # groups do not divide nodes: global
        (20, 30, 5, 1, 30),  # one physical expert per GPU
    ],
)
def test_plan_structure_on_random_loads(num_logical, num_replicas, num_groups, num_nodes, num_gpus):
    rng = np.random.default_rng(num_logical * 100 + num_replicas)
    # small integers: many ties; zeros: idle experts
    weight = rng.integers(0, 6, (4, num_logical)) * rng.integers(0, 2, (4, num_logical))
    phy2log, log2phy, logcnt = eplb.rebalance_experts(
        weight, num_replicas, num_groups, num_nodes, num_gpus
    )
    check_plan(weight, phy2log, log2phy, logcnt, num_replicas, num_groups, num_nodes)
    loads = eplb.gpu_loads(weight, phy2log, logcnt, num_gpus)
    assert loads.shape == (4, num_gpus)
    np.testing.assert_allclose(loads.sum(-1), weight.sum(-1))  # load is moved, never lost


def test_global_policy_when_groups_do_not_divide_nodes():
    rng = np.random.default_rng(7)
    weight = rng.gamma(0.5, 1.0, (3, 18))
    got = eplb.rebalance_experts(weight, 24, 3, 2, 4)  # 3 groups, 2 nodes
    want = eplb.rebalance_experts(weight, 24, 1, 1, 4)  # one group, one node
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    # the hierarchical layout would keep groups on nodes; here some group spans both
    group_of = got[0].reshape(3, 2, -1) // 6
    spans = [set(node_a.tolist()) & set(node_b.tolist()) for node_a, node_b in group_of]
    assert any(spans)


def test_one_layer_input_drops_the_layer_axis():
    weight = np.random.default_rng(3).uniform(0, 10, 12)
    one = eplb.rebalance_experts(weight, 16, 4, 2, 8)
    batched = eplb.rebalance_experts(weight[None], 16, 4, 2, 8)
    for a, b in zip(one, batched, strict=True):
        np.testing.assert_array_equal(a, b[0])
    assert eplb.gpu_loads(weight, one[0], one[2], 8).shape == (8,)


@pytest.mark.parametrize("load", ["zipf", "hot"])
@pytest.mark.parametrize("num_nodes, num_gpus", [(4, 32), (1, 8)])
def test_balance_improves_on_skewed_loads(load, num_nodes, num_gpus):
    rng = np.random.default_rng(11)
    layers, num_logical = 8, 256
    if load == "zipf":  # Zipf-like, s = 0.8, hot experts anywhere
        weight = rng.permuted(np.tile(np.arange(1, num_logical + 1) ** -0.8, (layers, 1)), axis=-1)
    else:  # uniform noise with 8 experts 10x hotter
        weight = rng.uniform(0.5, 1.5, (layers, num_logical))
        for row in weight:
            row[rng.choice(num_logical, 8, replace=False)] *= 10
    before = eplb.balance(contiguous_loads(weight, num_gpus))
    phy2log, log2phy, logcnt = eplb.rebalance_experts(
        weight, num_logical + 32, 8, num_nodes, num_gpus
    )
    after = eplb.balance(eplb.gpu_loads(weight, phy2log, logcnt, num_gpus))
    print(
        f"\n{load} load, {num_gpus} GPUs on {num_nodes} node(s): max/mean GPU load "
        f"{before.mean():.3f} -> {after.mean():.3f} (mean over {layers} layers)"
    )
    assert np.all(after < before)
    # one node: replicas go anywhere and the greedy packing is nearly perfect
    assert after.mean() < (1.02 if num_nodes == 1 else 1.25)


def test_balance_of_known_loads():
    assert eplb.balance(np.array([1.0, 3.0])) == 1.5
    np.testing.assert_allclose(eplb.balance(np.array([[2.0, 2.0], [0.0, 4.0]])), [1.0, 2.0])
    assert eplb.balance(np.zeros(4)) == 1.0


@pytest.mark.parametrize("num_packs", [1, 2, 3, 6, 12])
def test_balanced_packing_matches_the_greedy_loop(num_packs):
    rng = np.random.default_rng(num_packs)
    weight = rng.integers(0, 5, (20, 12)).astype(float)  # many ties
    pack_index, rank_in_pack = eplb.balanced_packing(weight, num_packs)
    for row in range(len(weight)):
        want_pack, want_rank = packing_loop(weight[row], num_packs)
        np.testing.assert_array_equal(pack_index[row], want_pack)
        np.testing.assert_array_equal(rank_in_pack[row], want_rank)


def test_balanced_packing_by_hand():
    # sorted 8 7 6 5 4 1: 8 -> p0, 7 -> p1, 6 -> p1 (7 < 8), 5 -> p0 (8 < 13),
    # 4 -> p0 (13 = 13, lower index), 1 -> p1 (p0 full)
    pack_index, rank_in_pack = eplb.balanced_packing(np.array([[8.0, 7, 6, 5, 4, 1]]), 2)
    np.testing.assert_array_equal(pack_index, [[0, 1, 1, 0, 0, 1]])
    np.testing.assert_array_equal(rank_in_pack, [[0, 0, 1, 1, 2, 2]])


def test_replicate_experts_matches_the_greedy_loop():
    rng = np.random.default_rng(5)
    weight = rng.integers(0, 8, (30, 10)).astype(float)
    phy2log, replica_rank, logcnt = eplb.replicate_experts(weight, 17)
    for row in range(len(weight)):
        want = replicate_loop(weight[row], 17)
        for got, w in zip((phy2log[row], replica_rank[row], logcnt[row]), want, strict=True):
            np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize(
    "args, match",
    [
        ((np.ones((2, 2, 4)), 8, 1, 1, 4), "weight must be a real array"),
        ((np.array([1.0, -1.0, 2.0, 0.0]), 8, 1, 1, 4), "non-negative"),
        ((np.array([1.0, np.nan, 2.0, 0.0]), 8, 1, 1, 4), "finite"),
        ((np.ones(8), 6, 1, 1, 2), "num_replicas .* at least"),
        ((np.ones(8), 10, 1, 1, 4), "num_replicas .* multiple of num_gpus"),
        ((np.ones(8), 12, 2, 4, 6), "num_gpus .* multiple of num_nodes"),
        ((np.ones(8), 12, 3, 1, 4), "num_groups .* divide"),
        ((np.ones(8), 12, 2, 1, 0), "num_gpus must be a positive int"),
        ((np.ones(8), 12.0, 2, 1, 4), "num_replicas must be a positive int"),
    ],
)
def test_bad_arguments_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        eplb.rebalance_experts(*args)


def test_bad_maps_name_the_argument():
    phy2log, _, logcnt = eplb.rebalance_experts(np.ones(8), 12, 1, 1, 4)
    with pytest.raises(ValueError, match="num_gpus"):
        eplb.gpu_loads(np.ones(8), phy2log, logcnt, 5)
    with pytest.raises(ValueError, match="weight .* must be"):
        eplb.gpu_loads(np.ones((2, 8)), phy2log, logcnt, 4)
    with pytest.raises(ValueError, match="topk_idx must be int"):
        eplb.choose_replicas(jnp.zeros((4, 2)), jnp.zeros((8, 2), int), jnp.ones(8, int))
    with pytest.raises(ValueError, match="log2phy must be"):
        eplb.choose_replicas(jnp.zeros((4, 2), int), jnp.zeros((8, 2), int), jnp.ones(7, int))


def test_replica_plan():
    weight = np.random.default_rng(2).uniform(0, 5, 12)
    plan = eplb.ReplicaPlan.build(weight, 16, 4, 2, 8)
    phy2log, log2phy, logcnt = eplb.rebalance_experts(weight, 16, 4, 2, 8)
    np.testing.assert_array_equal(plan.phy2log, phy2log)
    np.testing.assert_array_equal(plan.logcnt, logcnt)
    assert plan.log2phy.shape == (12, 16 - 12 + 1)  # the same for every plan of these sizes
    np.testing.assert_array_equal(plan.log2phy[:, : log2phy.shape[1]], log2phy)
    np.testing.assert_array_equal(plan.log2phy[:, log2phy.shape[1] :], -1)
    assert (plan.num_physical, plan.num_logical, plan.num_gpus) == (16, 12, 8)
    with pytest.raises(ValueError, match="one layer"):
        eplb.ReplicaPlan.build(weight[None], 16, 4, 2, 8)

    identity = eplb.ReplicaPlan.identity(12, 4)
    np.testing.assert_allclose(
        eplb.gpu_loads(weight, identity.phy2log, identity.logcnt, 4), contiguous_loads(weight, 4)
    )


# ---------------------------------------------------------------------------------------------
# Inside the layer: replica choice, and an MoE through replicas


def skewed_topk(
    rng: np.random.Generator, num_tokens: int, num_experts: int, top_k: int, hot: float = 3.0
) -> np.ndarray:
    """Distinct choices per token, most of them on a few hot experts (Gumbel top-k)."""
    logits = np.zeros(num_experts)
    logits[rng.choice(num_experts, 3, replace=False)] = hot
    noisy = logits + rng.gumbel(size=(num_tokens, num_experts))
    return np.argsort(-noisy, axis=-1)[:, :top_k].astype(np.int32)


@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_choose_replicas_matches_the_numpy_loop(kind):
    rng = np.random.default_rng(21 if kind == "uniform" else 22)
    num_logical, top_k, num_tokens = 16, 4, 96
    if kind == "uniform":
        idx = rng.integers(0, num_logical, (num_tokens, top_k)).astype(np.int32)
    else:
        idx = skewed_topk(rng, num_tokens, num_logical, top_k)
    idx[rng.random(idx.shape) < 0.1] = -1  # masked choices
    idx[rng.random(idx.shape) < 0.03] = num_logical + 2  # invalid ids
    idx[0, 0] = -7
    load = np.bincount(idx[(idx >= 0) & (idx < num_logical)], minlength=num_logical)
    plan = eplb.ReplicaPlan.build(load.astype(float), 32, 4, 2, 8)
    assert plan.logcnt.max() >= 3  # the test exercises several replicas

    run = jax.jit(eplb.choose_replicas)
    for offset in (0, 5):
        got = np.asarray(run(idx, plan.log2phy, plan.logcnt, offset=offset))
        assert got.dtype == np.int32 and got.shape == idx.shape
        np.testing.assert_array_equal(got, choose_loop(idx, plan.log2phy, plan.logcnt, offset))
    # each replica of e takes its share of e's choices, within one
    for e in range(num_logical):
        replicas = plan.log2phy[e, : plan.logcnt[e]]
        shares = [(got == r).sum() for r in replicas]
        assert sum(shares) == load[e] and max(shares) - min(shares) <= 1


def test_moe_through_replicas_equals_the_plain_moe():
    """Per-expert linear maps, top-k weighted: the physical-expert MoE on 8 devices (choose
    replicas, dispatch over P physical experts, ragged_dot, combine) equals the dense
    logical one, and the gradient of the logical weights sums over their replicas."""
    ranks, tokens, hidden, top_k, num_logical, num_physical = 8, 24, 8, 3, 16, 24
    rng = np.random.default_rng(31)
    idx = skewed_topk(rng, ranks * tokens, num_logical, top_k)
    idx[rng.random(idx.shape) < 0.1] = -1
    weights = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
    x = rng.normal(size=(ranks * tokens, hidden)).astype(np.float32)
    w_logical = (rng.normal(size=(num_logical, hidden, hidden)) / hidden**0.5).astype(np.float32)
    load = np.bincount(idx[idx >= 0], minlength=num_logical).astype(float)
    plan = eplb.ReplicaPlan.build(load, num_physical, 4, 2, ranks)
    assert plan.logcnt.max() >= 2

    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(AxisType.Auto,))
    log2phy, logcnt = jnp.asarray(plan.log2phy), jnp.asarray(plan.logcnt)

    def per_shard(x, idx, weights, w_physical):  # w_physical: this rank's [P/R, H, H]
        physical = eplb.choose_replicas(idx, log2phy, logcnt, offset=jax.lax.axis_index("ep"))
        recv, handle = jax_ep.dispatch(
            x, physical, weights, num_experts=num_physical, expert_major=True, backend="xla"
        )
        y = jax.lax.ragged_dot(recv.x, w_physical, recv.group_sizes)
        return jax_ep.combine(y, handle, topk_weights=recv.topk_weights, backend="xla")

    moe = jax.shard_map(per_shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))

    def forward(x, w_logical):
        w_physical = eplb.physical_expert_weights(w_logical, plan.phy2log)
        return moe(x, idx, weights, w_physical)

    def loss(x, w_logical):
        return jnp.sum(jnp.sin(forward(x, w_logical)))

    with jax.set_mesh(mesh):
        out = np.asarray(jax.jit(forward)(x, w_logical))
        g_x, g_w = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w_logical)

    # The plain MoE in float64: out[t] = sum_k weights[t, k] * x[t] @ W[idx[t, k]]
    gate = np.zeros((len(x), num_logical))
    rows = np.repeat(np.arange(len(x)), top_k)
    np.add.at(
        gate,
        (rows[idx.ravel() >= 0], idx.ravel()[idx.ravel() >= 0]),
        weights.ravel()[idx.ravel() >= 0],
    )
    per_expert = np.einsum("th,ehg->teg", x.astype(float), w_logical.astype(float))
    want = np.einsum("te,teg->tg", gate, per_expert)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)

    d_out = np.cos(want)  # d sum(sin(y)) / dy
    want_g_x = np.einsum("te,tg,ehg->th", gate, d_out, w_logical.astype(float))
    want_g_w = np.einsum("te,th,tg->ehg", gate, x.astype(float), d_out)
    np.testing.assert_allclose(g_x, want_g_x, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g_w, want_g_w, rtol=1e-4, atol=1e-5)
