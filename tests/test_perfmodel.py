"""The performance model (jax_ep.tools.perfmodel): expected traffic against exhaustive enumeration,
a closed form and sampled routings; byte counts per link against a NumPy count on random
routings; the time formulas by hand; monotonicity; DeepEP's published rows; bad input."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from jax_ep.tools import perfmodel as pm

# ---------------------------------------------------------------------------------------------
# Independent reference: DeepEP's benchmark routing, sampled or enumerated with NumPy.


def deepep_routing(scores: np.ndarray, num_topk: int, groups: tuple[int, int] | None):
    """Top-k experts per row of `scores` [N, E]; with groups (G, g): only inside the g groups
    whose best expert scores highest (DeepEP's test_internode.py)."""
    n, num_experts = scores.shape
    if groups is not None:
        num_groups, topk_groups = groups
        best = scores.reshape(n, num_groups, -1).max(-1)
        chosen = np.argsort(-best, axis=1)[:, :topk_groups]
        allowed = np.zeros((n, num_groups), bool)
        np.put_along_axis(allowed, chosen, True, axis=1)
        scores = np.where(np.repeat(allowed, num_experts // num_groups, axis=1), scores, -np.inf)
    return np.argsort(-scores, axis=1)[:, :num_topk]


def distinct_units(idx: np.ndarray, unit_size: int) -> np.ndarray:
    """Per row: how many distinct blocks of `unit_size` experts the row's experts fall on."""
    units = np.sort(idx // unit_size, axis=1)
    return 1 + (np.diff(units, axis=1) != 0).sum(axis=1)


# ---------------------------------------------------------------------------------------------
# Expected destinations


@pytest.mark.parametrize(
    "num_experts, num_topk, num_units, groups",
    [
        (6, 2, 3, (2, 1)),  # units of 2 straddle groups of 3
        (6, 3, 2, (3, 2)),
        (8, 3, 4, (4, 2)),
        (8, 2, 2, (4, 3)),  # a unit holds two whole groups
        (8, 4, 8, None),
        (8, 3, 4, (2, 1)),
    ],
)
def test_destinations_equal_enumeration_of_every_score_order(
    num_experts, num_topk, num_units, groups
):
    # Only the order of the scores matters: every permutation is equally likely.
    orders = np.array(list(itertools.permutations(range(num_experts))), dtype=float)
    idx = deepep_routing(orders, num_topk, groups)
    exact = distinct_units(idx, num_experts // num_units).mean()
    got = pm.expected_destinations(num_experts, num_topk, num_units, *(groups or (None, None)))
    assert got == pytest.approx(exact, rel=1e-12)


def test_destinations_without_groups_match_closed_form():
    rng = np.random.default_rng(11)
    for _ in range(10):
        num_units = int(rng.choice([2, 4, 8, 16, 32]))
        num_experts = num_units * int(rng.integers(1, 17))
        num_topk = int(rng.integers(1, min(num_experts, 12) + 1))
        size = num_experts // num_units
        # A unit is missed when all k choices fall among the other E - size experts.
        closed = num_units * (
            1 - math.comb(num_experts - size, num_topk) / math.comb(num_experts, num_topk)
        )
        got = pm.expected_destinations(num_experts, num_topk, num_units)
        assert got == pytest.approx(closed, rel=1e-12)


@pytest.mark.parametrize(
    "num_experts, num_topk, num_units, groups",
    [
        (256, 8, 8, (8, 4)),  # EP64 nodes in DeepEP's test: one group per node
        (256, 8, 64, (8, 4)),  # EP64 ranks
        (256, 8, 2, (8, 4)),  # DeepSeek-V3 groups on 2 nodes
        (288, 8, 3, (8, 4)),  # nodes of 96 experts straddle groups of 36
        (288, 8, 24, (8, 4)),
        (160, 6, 20, None),
    ],
)
def test_destinations_match_sampled_routing(num_experts, num_topk, num_units, groups):
    rng = np.random.default_rng(num_experts * 1000 + num_units)
    scores = np.abs(rng.standard_normal((20000, num_experts))) + 1
    counts = distinct_units(deepep_routing(scores, num_topk, groups), num_experts // num_units)
    got = pm.expected_destinations(num_experts, num_topk, num_units, *(groups or (None, None)))
    stderr = counts.std() / math.sqrt(len(counts))
    assert abs(got - counts.mean()) < 5 * stderr + 1e-9


def test_group_limit_by_best_expert_spreads_tokens_over_more_nodes():
    # Choosing 4 groups by their best expert nearly always keeps one expert in each; 4 groups
    # drawn at random with 8 experts drawn at random among them would give fewer nodes.
    by_best = pm.expected_destinations(256, 8, 8, 8, 4)
    uniform = 4 * (1 - math.comb(96, 8) / math.comb(128, 8))
    assert by_best > 3.95 > uniform + 0.3


# ---------------------------------------------------------------------------------------------
# Bytes per link against a NumPy count


def sampled_traffic(rng, num_ranks, gpus, num_tokens, num_experts, num_topk, groups):
    """Per rank averages of DeepEP's counts and of the rows/messages crossing each link."""
    nodes = num_ranks // gpus
    scores = rng.random((num_ranks, num_tokens, num_experts))
    idx = deepep_routing(scores.reshape(-1, num_experts), num_topk, groups)
    idx = idx.reshape(num_ranks, num_tokens, num_topk)
    dest = idx // (num_experts // num_ranks)
    src = np.broadcast_to(np.arange(num_ranks)[:, None, None], dest.shape)
    # received[s, d]: tokens of source rank s that rank d receives (once per token).
    hit = np.zeros((num_ranks, num_tokens, num_ranks), bool)
    np.put_along_axis(hit, dest, True, axis=2)
    received = hit.sum(axis=1)
    node_hit = hit.reshape(num_ranks, num_tokens, nodes, gpus).any(axis=3)
    local = np.arange(num_ranks) % gpus
    node = np.arange(num_ranks) // gpus
    own_node_hit = node_hit[np.arange(num_ranks), :, node]  # [R, T]
    same_node = node[src] == node[dest]
    return {
        "rows": received.sum() / num_ranks,
        # Rows from a source of another local index cross NVLink (directly, or forwarded).
        "rows_nvlink": received[local[:, None] != local[None, :]].sum() / num_ranks,
        # Flat puts: each row straight from its source to its destination rank.
        "rows_flat_nvlink": received[(node[:, None] == node[None, :])
                                     & ~np.eye(num_ranks, dtype=bool)].sum() / num_ranks,
        "rows_flat_rdma": received[node[:, None] != node[None, :]].sum() / num_ranks,
        "tokens_nodes": node_hit.sum() / num_ranks,
        "tokens_remote_nodes": (node_hit.sum() - own_node_hit.sum()) / num_ranks,
        "messages": idx.size / num_ranks,
        "messages_nvlink": (same_node & (src != dest)).sum() / num_ranks,
        "messages_rdma": (~same_node).sum() / num_ranks,
    }


@pytest.mark.parametrize("groups", [(4, 2), None])
def test_bytes_per_link_match_a_numpy_count(groups):
    rng = np.random.default_rng(5)
    R, gpus, T, E, K, H = 16, 4, 256, 64, 4, 256
    s = sampled_traffic(rng, R, gpus, T, E, K, groups)
    hw = dataclasses.replace(pm.H800, gpus_per_node=gpus)
    num_groups, num_topk_groups = groups or (None, None)
    config = pm.Config(T, H, K, E, R, True, num_groups, num_topk_groups)
    fp8_row, bf16_row = H + H / 128 * 4, 2 * H

    normal = pm.predict(config, hw, "normal")
    for op, row in ((normal.dispatch, fp8_row), (normal.combine, bf16_row)):
        assert op.deepep_link == "RDMA"
        assert op.deepep_bytes == pytest.approx(s["tokens_nodes"] * row, rel=0.02)
        assert op.link_bytes["rdma"] == pytest.approx(s["tokens_remote_nodes"] * row, rel=0.03)
        assert op.link_bytes["nvlink"] == pytest.approx(s["rows_nvlink"] * row, rel=0.02)

    flat = pm.predict(config, hw, "normal", internode="flat")
    for op, row in ((flat.dispatch, fp8_row), (flat.combine, bf16_row)):
        assert op.deepep_bytes == pytest.approx(s["tokens_nodes"] * row, rel=0.02)
        assert op.link_bytes["rdma"] == pytest.approx(s["rows_flat_rdma"] * row, rel=0.02)
        assert op.link_bytes["nvlink"] == pytest.approx(s["rows_flat_nvlink"] * row, rel=0.03)

    low = pm.predict(config, hw, "low_latency")
    for op, message in ((low.dispatch, fp8_row + 16), (low.combine, bf16_row)):
        assert op.deepep_bytes == pytest.approx(s["messages"] * message, rel=1e-12)
        assert op.link_bytes["nvlink"] == pytest.approx(s["messages_nvlink"] * message, rel=0.05)
        assert op.link_bytes["rdma"] == pytest.approx(s["messages_rdma"] * message, rel=0.02)

    single_node = pm.predict(dataclasses.replace(config, num_ranks=4), pm.H800, "normal")
    s4 = sampled_traffic(rng, 4, 4, T, E, K, groups)
    assert single_node.dispatch.deepep_link == "NVLink"
    assert single_node.dispatch.deepep_bytes == pytest.approx(s4["rows"] * fp8_row, rel=0.02)
    assert single_node.dispatch.link_bytes["rdma"] == 0
    assert single_node.dispatch.link_bytes["nvlink"] == pytest.approx(
        s4["rows_nvlink"] * fp8_row, rel=0.02
    )


# ---------------------------------------------------------------------------------------------
# Time formulas by hand, and their trends


def test_low_latency_intranode_time_by_hand():
    hw = pm.H800
    p = pm.predict(pm.Config(128, 7168, 8, 256, 8, fp8_dispatch=True), hw, "low_latency")
    message = 7168 + 7168 // 128 * 4 + 16  # 7408 bytes: FP8 row, scales, header
    nvlink = 128 * 8 * message * 7 / 8  # every message but the rank's own crosses NVLink
    assert p.dispatch.link_bytes == {"nvlink": pytest.approx(nvlink), "rdma": 0.0}
    expected = (hw.launch_us + hw.nvlink_latency_us) * 1e-6 + nvlink / (hw.nvlink_gbps * 1e9)
    assert p.dispatch_s == pytest.approx(expected, rel=1e-12)
    assert p.dispatch.bottleneck == "nvlink"
    assert p.dispatch.gbps == pytest.approx(128 * 8 * message / expected / 1e9)


def test_normal_internode_time_by_hand():
    hw = pm.H800
    config = pm.Config(4096, 7168, 8, 256, 32, fp8_dispatch=True)  # 4 nodes, no group limit
    p = pm.predict(config, hw, "normal")
    miss_node = math.comb(192, 8) / math.comb(256, 8)
    miss_rank = math.comb(248, 8) / math.comb(256, 8)
    row = 7168 * 2  # combine, BF16
    rdma = 4096 * 4 * (1 - miss_node) * 3 / 4 * row
    nvlink = 4096 * 32 * (1 - miss_rank) * 7 / 8 * row
    assert p.combine.link_bytes["rdma"] == pytest.approx(rdma, rel=1e-12)
    assert p.combine.link_bytes["nvlink"] == pytest.approx(nvlink, rel=1e-12)
    assert p.combine.deepep_bytes == pytest.approx(4096 * 4 * (1 - miss_node) * row, rel=1e-12)
    fixed = hw.launch_us + hw.nvlink_latency_us + hw.rdma_latency_us
    legs = max(rdma / (hw.nic_gbps * 1e9), nvlink / (hw.nvlink_gbps * 1e9))
    assert p.combine_s == pytest.approx(fixed * 1e-6 + legs, rel=1e-12)
    assert p.combine.bottleneck == "rdma"


def test_flat_internode_time_by_hand_and_against_node_aware():
    """Flat puts: one row per destination rank, the links side by side, each with its own
    latency. At DeepEP's internode settings they send 2-3.5x the RDMA bytes and take longer;
    inside one node both schemes are the same."""
    hw = pm.H800
    config = pm.Config(4096, 7168, 8, 256, 32, fp8_dispatch=True)  # 4 nodes, no group limit
    p = pm.predict(config, hw, "normal", internode="flat")
    ranks_per_token = 32 * (1 - math.comb(248, 8) / math.comb(256, 8))
    row = 7168 * 2
    rdma = 4096 * ranks_per_token * 24 / 32 * row
    nvlink = 4096 * ranks_per_token * 7 / 32 * row
    assert p.combine.link_bytes == {"nvlink": pytest.approx(nvlink, rel=1e-12),
                                    "rdma": pytest.approx(rdma, rel=1e-12)}
    legs = max((hw.rdma_latency_us * 1e-6 + rdma / (hw.nic_gbps * 1e9)),
               (hw.nvlink_latency_us * 1e-6 + nvlink / (hw.nvlink_gbps * 1e9)))
    assert p.combine_s == pytest.approx(hw.launch_us * 1e-6 + legs, rel=1e-12)
    assert "(flat puts)" in p.describe()

    rows = pm.internode_table()
    assert [(r.num_ranks, r.op) for r in rows] == [
        (ep, op) for ep in (16, 32, 64) for op in ("dispatch", "combine")]
    for r in rows:
        ratio = r.flat.link_bytes["rdma"] / r.node_aware.link_bytes["rdma"]
        assert 1.5 < ratio < 3.5 and r.flat.seconds > r.node_aware.seconds, r
        assert r.flat.deepep_bytes == r.node_aware.deepep_bytes
    intranode = pm.Config(4096, 7168, 8, 256, 8, fp8_dispatch=True)
    assert pm.predict(intranode, hw, "normal", internode="flat").dispatch == pm.predict(
        intranode, hw, "normal").dispatch


def test_phased_internode_time_by_hand_and_against_streamed():
    """Phased (jax_ep's normal mode over puts today): the send's NVLink rows to the own node
    and RDMA rows to the relays side by side, then a launch in which the relays forward the
    rest of the node-aware NVLink rows; the combine is flat puts plus the launch that sums.
    Never faster than streamed; inside one node the same as the other schemes."""
    hw = pm.H800
    config = pm.Config(4096, 7168, 8, 256, 32, fp8_dispatch=True)  # 4 nodes, no group limit
    p = pm.predict(config, hw, "normal", internode="phased")
    aware = pm.predict(config, hw, "normal")
    row = config.dispatch_row_bytes
    ranks_per_token = 32 * (1 - math.comb(248, 8) / math.comb(256, 8))
    own_node = 4096 * ranks_per_token * 7 / 32 * row
    relayed = aware.dispatch.link_bytes["nvlink"] - own_node
    rdma = aware.dispatch.link_bytes["rdma"]
    send = max(hw.rdma_latency_us * 1e-6 + rdma / (hw.nic_gbps * 1e9),
               hw.nvlink_latency_us * 1e-6 + own_node / (hw.nvlink_gbps * 1e9))
    relay = (hw.launch_us + hw.nvlink_latency_us) * 1e-6 + relayed / (hw.nvlink_gbps * 1e9)
    assert p.dispatch_s == pytest.approx(hw.launch_us * 1e-6 + send + relay, rel=1e-12)
    assert p.dispatch.link_bytes == aware.dispatch.link_bytes
    flat = pm.predict(config, hw, "normal", internode="flat")
    assert p.combine_s == pytest.approx(flat.combine_s + hw.launch_us * 1e-6, rel=1e-12)
    assert "(phased)" in p.describe()
    for r in pm.internode_table():
        assert r.phased.seconds >= r.node_aware.seconds, r
    intranode = pm.Config(4096, 7168, 8, 256, 8, fp8_dispatch=True)
    phased = pm.predict(intranode, hw, "normal", internode="phased")
    assert phased.dispatch == pm.predict(intranode, hw, "normal").dispatch


def test_shared_device_moves_every_rank_bytes_through_one_memory():
    device = pm.SharedDevice("test", copy_gbps=1000.0, launch_us=2.0)
    config = pm.Config(64, 1024, 4, 32, 8)
    p = pm.predict(config, device, "low_latency")
    per_rank = 64 * 4 * 1024 * 2
    assert p.combine.link_bytes == {"hbm": 2 * per_rank}
    assert p.combine_s == pytest.approx(2e-6 + 8 * 2 * per_rank / 1e12)
    normal = pm.predict(config, device, "normal")
    rows = 64 * pm.expected_destinations(32, 4, 8)
    assert normal.dispatch.deepep_bytes == pytest.approx(rows * 1024 * 2)


@pytest.mark.parametrize("mode", pm.MODES)
@pytest.mark.parametrize("hardware", [pm.H800, pm.H200, pm.H100_VIRTUAL])
@pytest.mark.parametrize("ep", [8, 32])
def test_more_tokens_take_longer_and_fp8_beats_bf16(mode, hardware, ep):
    base = pm.Config(128, 4096, 8, 256, ep, fp8_dispatch=True)
    times = [
        pm.predict(dataclasses.replace(base, num_tokens=t), hardware, mode)
        for t in (16, 128, 1024, 8192)
    ]
    for op in ("dispatch_s", "combine_s"):
        values = [getattr(p, op) for p in times]
        assert all(a < b for a, b in zip(values, values[1:], strict=False))
    bf16 = pm.predict(dataclasses.replace(base, fp8_dispatch=False), hardware, mode)
    fp8 = pm.predict(base, hardware, mode)
    assert fp8.dispatch_s < bf16.dispatch_s
    assert fp8.combine_s == bf16.combine_s


def test_faster_links_help_only_where_they_are_the_bottleneck():
    config = pm.Config(4096, 7168, 8, 256, 64, True, 8, 4)
    p800, p200 = (pm.predict(config, hw, "normal") for hw in (pm.H800, pm.H200))
    assert p800.dispatch.bottleneck == "rdma"
    assert p200.dispatch_s == pytest.approx(p800.dispatch_s)  # same NIC
    intranode = dataclasses.replace(config, num_ranks=8, num_groups=None, num_topk_groups=None)
    q800, q200 = (pm.predict(intranode, hw, "normal") for hw in (pm.H800, pm.H200))
    assert q200.dispatch_s < q800.dispatch_s / 2


# ---------------------------------------------------------------------------------------------
# DeepEP's published rows


def test_every_published_row_within_15_percent():
    rows = pm.calibration_table()
    tables = (pm.DEEPEP_NORMAL, pm.DEEPEP_LOW_LATENCY, pm.DEEPEP_LOW_LATENCY_RDMA)
    assert len(rows) == 2 * sum(len(t) for t in tables) == 28
    bad = [
        (r.table, r.num_ranks, r.op, f"{r.time_error:+.1%}", f"{r.gbps_error:+.1%}")
        for r in rows
        if abs(r.time_error) > 0.15 or abs(r.gbps_error) > 0.15
    ]
    assert not bad


def test_published_normal_rows_use_deepeps_byte_count():
    rows = {(r.table, r.num_ranks, r.op): r for r in pm.calibration_table()}
    # Intranode EP8: every rank's received rows (own included), FP8 row 7392 bytes.
    ranks = 8 * (1 - math.comb(224, 8) / math.comb(256, 8))
    r = rows["normal", 8, "dispatch"]
    assert r.published_s == pytest.approx(4096 * ranks * 7392 / 153e9, rel=1e-12)
    # Low-latency rows publish their time.
    assert rows["low_latency", 16, "combine"].published_s == pytest.approx(195e-6)
    assert rows["low_latency_rdma", 8, "dispatch"].fitted is False


def test_docs_show_the_current_table():
    doc = Path(__file__).resolve().parents[1] / "docs" / "perfmodel.md"
    assert pm.markdown_table(pm.calibration_table()) in doc.read_text()
    assert pm.internode_markdown(pm.internode_table()) in doc.read_text()


def test_command_line(capsys):
    pm.main(["--table"])
    out = capsys.readouterr().out
    assert out.count("| normal |") == 8 and out.count("| low_latency |") == 12
    assert "| 64 | combine |" in out  # the internode schemes' table
    pm.main(["--ep", "32", "--mode", "normal", "--internode", "flat"])
    assert capsys.readouterr().out.startswith("H800 normal (flat puts) EP32")
    pm.main(["--ep", "16", "--mode", "low_latency", "--hardware", "H100"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("H100 low_latency EP16 T=128") and "rdma-bound" in line
    with pytest.raises(SystemExit):
        pm.main(["--ep", "7"])
    assert "multiple of num_ranks" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_ranks": 6}, "num_experts .* multiple of num_ranks"),
        ({"num_tokens": 0}, "num_tokens must be positive"),
        ({"num_topk": 300}, "num_topk must be in"),
        ({"num_groups": 8}, "set together"),
        ({"num_groups": 7, "num_topk_groups": 2}, "num_groups .* divisor"),
        ({"num_groups": 8, "num_topk_groups": 9}, "num_topk_groups must be in"),
        ({"num_groups": 64, "num_topk_groups": 1}, "raise num_topk_groups"),
        ({"hidden": 100, "fp8_dispatch": True}, "multiple of 128"),
        ({"dtype_bytes": 0}, "dtype_bytes must be positive"),
    ],
)
def test_config_rejects_bad_input(kwargs, message):
    args = {"num_tokens": 128, "hidden": 7168, "num_topk": 8, "num_experts": 256, "num_ranks": 8}
    with pytest.raises(ValueError, match=message):
        pm.Config(**{**args, **kwargs})


def test_predict_and_hardware_reject_bad_input():
    config = pm.Config(128, 7168, 8, 256, 32)
    with pytest.raises(ValueError, match="mode must be one of"):
        pm.predict(config, pm.H800, "fast")
    with pytest.raises(ValueError, match="internode must be one of"):
        pm.predict(config, pm.H800, "normal", internode="ring")
    with pytest.raises(ValueError, match="Hardware or SharedDevice"):
        pm.predict(config, "H800")
    with pytest.raises(ValueError, match="multiple of it"):
        pm.predict(config, dataclasses.replace(pm.H800, gpus_per_node=12))
    with pytest.raises(ValueError, match="nic_gbps must be positive"):
        dataclasses.replace(pm.H800, nic_gbps=0.0)
    with pytest.raises(ValueError, match="rdma_latency_us must be non-negative"):
        dataclasses.replace(pm.H800, rdma_latency_us=-1.0)
    with pytest.raises(ValueError, match="copy_gbps must be positive"):
        pm.SharedDevice("x", copy_gbps=-5.0)
    with pytest.raises(ValueError, match="num_units .* divisor"):
        pm.expected_destinations(256, 8, 3)
