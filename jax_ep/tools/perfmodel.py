"""A performance model of expert-parallel dispatch and combine: bytes per link over bandwidth.

For a configuration (tokens per rank, hidden size, top-k, experts, group-limited routing, FP8
or BF16, ranks) and a machine (`Hardware`: NVLink and NIC bandwidths, GPUs per node, a few
latencies) `predict` gives the time of dispatch and combine in DeepEP's normal mode (each token
sent once per destination rank, internode traffic forwarded over NVLink inside the node) and
low-latency mode (one message per (token, expert), straight to the expert's rank). Traffic is
the expectation under random routing, computed exactly (`expected_destinations`). Between
nodes, normal mode is modelled three ways (`INTERNODE`): node-aware, DeepEP's scheme, whose
legs stream; flat puts, each token sent once per destination rank wherever it is; and phased,
jax_ep's node-aware scheme today, whose legs run one after another; `internode_table()` sets
them beside DeepEP's internode rows.

The H800 constants were fit once to DeepEP's published tables; `calibration_table()` compares
every published row with the model, and `python -m jax_ep.tools.perfmodel --table` prints it
(docs/perfmodel.md explains the model, the constants and its limits).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from functools import lru_cache

__all__ = [
    "H100",
    "H200",
    "H800",
    "INTERNODE",
    "MODES",
    "PRESETS",
    "CalibrationRow",
    "Config",
    "Hardware",
    "OpTime",
    "Prediction",
    "SharedDevice",
    "calibration_table",
    "expected_destinations",
    "internode_markdown",
    "internode_table",
    "markdown_table",
    "predict",
    "table_config",
]

MODES = ("normal", "low_latency")
# Normal mode between nodes. node_aware: a token crosses the network once per destination
# node, to the GPU of its own local index there, which forwards it over NVLink (DeepEP's
# internode kernels). flat: one put per destination rank, over the network to every rank
# outside the node (what a put between any two ranks gives without the relay). phased: the
# node-aware dispatch as phases that each wait for the last (jax_ep's normal mode over puts
# today: the send, both links at once, then the relays' NVLink leg), its combine flat puts
# then the sums; the streamed node_aware scheme is what channels give.
INTERNODE = ("node_aware", "flat", "phased")
FP8_BLOCK = 128  # channels per FP8 scale
SCALE_BYTES = 4  # one float32 scale per block
LL_HEADER_BYTES = 16  # source info and layout sent with every low-latency dispatch message


# ---------------------------------------------------------------------------------------------
# Helpers


def _check_routing(
    num_experts: int, num_topk: int, num_groups: int | None, num_topk_groups: int | None
) -> None:
    if num_topk < 1 or num_topk > num_experts:
        raise ValueError(f"num_topk must be in [1, num_experts={num_experts}]; got {num_topk}.")
    if num_groups is None:
        return
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(
            f"num_groups ({num_groups}) must be a positive divisor of num_experts ({num_experts})."
        )
    if num_topk_groups is None or not 1 <= num_topk_groups <= num_groups:
        raise ValueError(
            f"num_topk_groups must be in [1, num_groups={num_groups}]; got {num_topk_groups}."
        )
    if num_topk_groups * (num_experts // num_groups) < num_topk:
        raise ValueError(
            f"num_topk_groups ({num_topk_groups}) x experts per group "
            f"({num_experts // num_groups}) must be at least num_topk ({num_topk}): raise "
            "num_topk_groups."
        )


def _check_positive(obj: object, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be positive; got {value!r}.")


def _check_non_negative(obj: object, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value >= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be non-negative; got {value!r}.")


def _fmt_time(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


# ---------------------------------------------------------------------------------------------
# Machines


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A GPU cluster: per-GPU link bandwidths and the fixed costs of an op.

    Attributes:
      name: label for printing.
      nvlink_gbps: achievable NVLink bandwidth per GPU and direction, GB/s (1e9 bytes/s).
      nic_gbps: achievable RDMA bandwidth per GPU (its NIC) and direction, GB/s.
      gpus_per_node: GPUs that share an NVLink domain.
      nvlink_latency_us: fixed time of a transfer over NVLink (start-up handshakes, flags,
        pipeline fill and drain), microseconds.
      rdma_latency_us: the same for a transfer over RDMA.
      launch_us: kernel launch and grid synchronization, paid once per op.
    """

    name: str
    nvlink_gbps: float
    nic_gbps: float
    gpus_per_node: int
    nvlink_latency_us: float
    rdma_latency_us: float
    launch_us: float

    def __post_init__(self) -> None:
        _check_positive(self, ("nvlink_gbps", "nic_gbps", "gpus_per_node"))
        _check_non_negative(self, ("nvlink_latency_us", "rdma_latency_us", "launch_us"))


@dataclasses.dataclass(frozen=True)
class SharedDevice:
    """All ranks as slices of one device's memory (`jax_ep.virtual`, or CPU devices).

    Every byte each rank receives, its own rows included, is read and written once in the one
    memory, so the time is a floor: launch + 2 x bytes x ranks / copy bandwidth.

    Attributes:
      name: label for printing.
      copy_gbps: copy bandwidth counting bytes read plus bytes written, GB/s (the bench's
        `timing.copy_bandwidth` / 1e9).
      launch_us: kernel launch, paid once per op.
    """

    name: str
    copy_gbps: float
    launch_us: float = 5.0

    def __post_init__(self) -> None:
        _check_positive(self, ("copy_gbps",))
        _check_non_negative(self, ("launch_us",))


# Fit once (least squares on log time, `launch_us` held at 5) to the 20 rows of DeepEP's
# README tables for H800 with CX7 400 Gb/s InfiniBand: normal intranode EP8 and internode
# EP16/32/64, dispatch and combine; low-latency EP8 to EP256, dispatch and combine. Rounded.
# `calibration_table()` shows the fit; docs/perfmodel.md lists where each value comes from.
H800 = Hardware(
    name="H800",
    nvlink_gbps=133.0,  # DeepEP quotes ~160 GB/s max; 200 GB/s nominal per direction
    nic_gbps=44.5,  # CX7 400 Gb/s = 50 GB/s nominal
    gpus_per_node=8,
    nvlink_latency_us=20.0,
    rdma_latency_us=24.0,
    launch_us=5.0,  # set by hand: the tables fix only its sums with the latencies
)

# H100/H200 SXM: 450 GB/s per direction nominal (H800: 200). Assumption until measured: the
# same fraction of nominal as the H800 fit (133 / 200), and the same NIC and latencies.
_NVLINK_EFFICIENCY = H800.nvlink_gbps / 200.0
H100 = dataclasses.replace(H800, name="H100", nvlink_gbps=450.0 * _NVLINK_EFFICIENCY)
H200 = dataclasses.replace(H800, name="H200", nvlink_gbps=450.0 * _NVLINK_EFFICIENCY)

# One H100 holding every rank: ~3 TB/s measured copy bandwidth (read + write) of 3.35 TB/s HBM3.
H100_VIRTUAL = SharedDevice(name="H100 (virtual ranks)", copy_gbps=3000.0)

PRESETS: dict[str, Hardware | SharedDevice] = {
    "H800": H800,
    "H100": H100,
    "H200": H200,
    "H100-virtual": H100_VIRTUAL,
}


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class Config:
    """One dispatch + combine: the shapes, the routing rule and the data types.

    Attributes:
      num_tokens: tokens per rank.
      hidden: channels per token.
      num_topk: experts per token.
      num_experts: experts in all; rank r holds experts [r E/R, (r+1) E/R).
      num_ranks: EP ranks R.
      fp8_dispatch: dispatch FP8 (one byte per channel and a float32 scale per 128
        channels); else the model dtype.
      num_groups: experts form this many equal contiguous groups (group-limited routing);
        None: no group limit.
      num_topk_groups: groups a token may choose from (the groups whose best expert scores
        highest); set together with num_groups.
      dtype_bytes: bytes per channel of the model dtype (BF16: 2), for combine and for a
        dispatch that is not FP8.
      ll_nvlink: low-latency messages to other GPUs of the node go over NVLink (DeepEP's
        default since its PR #173); False: every message to another rank goes through the NIC.
    """

    num_tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    num_ranks: int
    fp8_dispatch: bool = False
    num_groups: int | None = None
    num_topk_groups: int | None = None
    dtype_bytes: int = 2
    ll_nvlink: bool = True

    def __post_init__(self) -> None:
        _check_positive(self, ("num_tokens", "hidden", "num_topk", "num_experts", "num_ranks"))
        _check_positive(self, ("dtype_bytes",))
        if self.num_experts % self.num_ranks:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be a multiple of num_ranks "
                f"({self.num_ranks}): every rank holds the same number of experts."
            )
        if self.fp8_dispatch and self.hidden % FP8_BLOCK:
            raise ValueError(
                f"hidden ({self.hidden}) must be a multiple of {FP8_BLOCK} with fp8_dispatch: "
                "one scale per 128 channels; set fp8_dispatch=False or pad hidden."
            )
        if (self.num_groups is None) != (self.num_topk_groups is None):
            raise ValueError(
                "num_groups and num_topk_groups must be set together (both None: no group "
                f"limit); got num_groups={self.num_groups}, "
                f"num_topk_groups={self.num_topk_groups}."
            )
        _check_routing(self.num_experts, self.num_topk, self.num_groups, self.num_topk_groups)

    @property
    def dispatch_row_bytes(self) -> float:
        """Bytes of one dispatched token row (FP8: the row and its scales)."""
        if self.fp8_dispatch:
            return self.hidden + self.hidden / FP8_BLOCK * SCALE_BYTES
        return float(self.hidden * self.dtype_bytes)

    @property
    def combine_row_bytes(self) -> float:
        """Bytes of one combined row, in the model dtype."""
        return float(self.hidden * self.dtype_bytes)


# ---------------------------------------------------------------------------------------------
# Expected traffic under random routing


def expected_destinations(
    num_experts: int,
    num_topk: int,
    num_units: int,
    num_groups: int | None = None,
    num_topk_groups: int | None = None,
) -> float:
    """Expected number of distinct units a token's top-k experts fall on.

    Units are `num_units` equal contiguous blocks of experts (ranks, or nodes). The routing is
    DeepEP's benchmark routing: independent random scores for every expert (any continuous
    distribution), the `num_topk_groups` groups whose best expert scores highest, then the
    `num_topk` best experts of those groups. Computed exactly (no sampling).

    Args:
      num_experts: E.
      num_topk: experts per token.
      num_units: blocks of E / num_units experts.
      num_groups: equal contiguous expert groups; None: no group limit.
      num_topk_groups: groups a token may choose from (with num_groups).

    Returns:
      The expectation, in [1, min(num_topk, num_units)].
    """
    if num_units < 1 or num_experts % num_units:
        raise ValueError(
            f"num_units ({num_units}) must be a positive divisor of num_experts ({num_experts})."
        )
    groups, topk_groups = (1, 1) if num_groups is None else (num_groups, num_topk_groups)
    _check_routing(num_experts, num_topk, groups, topk_groups)
    size = num_experts // num_units
    return sum(
        1.0 - _miss_probability(num_experts, num_topk, groups, topk_groups, u * size, size)
        for u in range(num_units)
    )


def _miss_probability(
    num_experts: int, num_topk: int, num_groups: int, num_topk_groups: int, start: int, size: int
) -> float:
    """Probability that none of experts [start, start + size) is chosen."""
    group_size = num_experts // num_groups
    full, partial = 0, []
    for g in range(num_groups):
        overlap = min(start + size, (g + 1) * group_size) - max(start, g * group_size)
        if overlap == group_size:
            full += 1
        elif overlap > 0:
            partial.append(overlap)
    # The result depends only on how the unit overlaps the groups.
    return _miss_by_overlap(
        num_experts, num_topk, num_groups, num_topk_groups, full, tuple(partial)
    )


@lru_cache(maxsize=256)
def _miss_by_overlap(
    num_experts: int,
    num_topk: int,
    num_groups: int,
    num_topk_groups: int,
    full: int,
    partial: tuple[int, ...],
) -> float:
    """`_miss_probability` for a unit covering `full` whole groups and parts of others.

    Walk the experts from the best score down. A group is chosen when its first (best) expert
    appears while fewer than num_topk_groups groups are open, so until then every expert seen
    is chosen, uniformly among those not yet seen; once the groups are all open, the next
    choices are uniform among the unseen experts of the open groups. The walk stops after
    num_topk choices. The state keeps only what the unit needs: open groups and choices outside
    the partial groups, and, per partial group, None (closed) or its choices so far (all outside
    the unit, since paths that choose a unit expert are dropped). What survives never chose
    the unit.
    """
    group_size = num_experts // num_groups
    others = num_groups - full - len(partial)
    State = tuple[int, int, tuple[int | None, ...]]

    def moves(state: State) -> tuple[int, list[tuple[State, int]]]:
        """The experts left to draw from, and how many of them lead to each next state."""
        open_others, chosen_others, parts = state
        chosen = chosen_others + sum(a for a in parts if a is not None)
        filling = open_others + sum(a is not None for a in parts) < num_topk_groups
        total = num_experts - chosen if filling else num_topk_groups * group_size - chosen
        out = [((open_others, chosen_others + 1, parts), open_others * group_size - chosen_others)]
        if filling:
            out.append(
                ((open_others + 1, chosen_others + 1, parts), (others - open_others) * group_size)
            )
        for p, a in enumerate(parts):
            outside = group_size - partial[p]
            if a is not None:
                out.append(((open_others, chosen_others, _set(parts, p, a + 1)), outside - a))
            elif filling:
                out.append(((open_others, chosen_others, _set(parts, p, 1)), outside))
        return total, out

    states: dict[State, float] = {(0, 0, (None,) * len(partial)): 1.0}
    for _ in range(num_topk):
        nxt: dict[State, float] = {}
        for state, weight in states.items():
            total, out = moves(state)
            for key, count in out:
                if count > 0:
                    nxt[key] = nxt.get(key, 0.0) + weight * count / total
        states = nxt
    return sum(states.values())


def _set(values: tuple, index: int, value: int | None) -> tuple:
    return values[:index] + (value,) + values[index + 1 :]


# ---------------------------------------------------------------------------------------------
# Prediction


@dataclasses.dataclass(frozen=True)
class OpTime:
    """The predicted time of one op and the traffic behind it (all per rank).

    Attributes:
      seconds: predicted time.
      link_bytes: bytes each rank moves over each link ("nvlink", "rdma"; "hbm" on a
        SharedDevice, read plus written), one direction.
      bottleneck: the link that sets the time.
      deepep_bytes: the bytes DeepEP's benchmark divides by the time (see `deepep_link`).
      deepep_link: which count that is: "NVLink" (normal intranode: rows received, own rows
        included), "RDMA" (normal internode: tokens x destination nodes, own node included)
        or "all" (low latency: every valid (token, expert) message).
    """

    seconds: float
    link_bytes: dict[str, float]
    bottleneck: str
    deepep_bytes: float
    deepep_link: str

    @property
    def gbps(self) -> float:
        """GB/s as DeepEP prints it: deepep_bytes / seconds / 1e9."""
        return self.deepep_bytes / self.seconds / 1e9


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Dispatch and combine of one configuration on one machine."""

    config: Config
    hardware: str
    mode: str
    dispatch: OpTime
    combine: OpTime
    internode: str = "node_aware"

    @property
    def dispatch_s(self) -> float:
        return self.dispatch.seconds

    @property
    def combine_s(self) -> float:
        return self.combine.seconds

    def describe(self) -> str:
        """One line: the setting, then each op's time, DeepEP GB/s and bottleneck."""
        c = self.config
        kind = "FP8" if c.fp8_dispatch else f"{8 * c.dtype_bytes}-bit"
        groups = f" groups {c.num_topk_groups}/{c.num_groups}" if c.num_groups else ""
        ops = "; ".join(
            f"{name} {_fmt_time(op.seconds)} ({op.gbps:.1f} GB/s {op.deepep_link}, "
            f"{op.bottleneck}-bound)"
            for name, op in (("dispatch", self.dispatch), ("combine", self.combine))
        )
        scheme = {"flat": " (flat puts)", "phased": " (phased)"}.get(self.internode, "")
        scheme = scheme if self.mode == "normal" else ""
        return (
            f"{self.hardware} {self.mode}{scheme} EP{c.num_ranks} T={c.num_tokens} H={c.hidden} "
            f"top-{c.num_topk}/{c.num_experts}{groups}, {kind} dispatch: {ops}"
        )


def predict(
    config: Config, hardware: Hardware | SharedDevice = H800, mode: str = "normal",
    internode: str = "node_aware",
) -> Prediction:
    """Predicted dispatch and combine times of `config` on `hardware` in `mode`.

    Args:
      config: shapes, routing and data types.
      hardware: a cluster (`H800`, `H100`, `H200`, or your own `Hardware`) or a `SharedDevice`.
      mode: "normal" (DeepEP's normal kernels) or "low_latency".
      internode: how normal mode crosses nodes, one of `INTERNODE` (no effect inside a node).

    Returns:
      A `Prediction`; per rank, every rank alike (traffic is the expectation under random
      routing, which loads every rank equally).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}; got {mode!r}.")
    if internode not in INTERNODE:
        raise ValueError(f"internode must be one of {list(INTERNODE)}; got {internode!r}.")
    if isinstance(hardware, SharedDevice):
        return _predict_shared(config, hardware, mode)
    if not isinstance(hardware, Hardware):
        raise ValueError(
            f"hardware must be a Hardware or SharedDevice (e.g. perfmodel.H800); "
            f"got {type(hardware).__name__}."
        )
    gpus = min(hardware.gpus_per_node, config.num_ranks)
    if config.num_ranks % gpus:
        raise ValueError(
            f"num_ranks ({config.num_ranks}) must be at most gpus_per_node "
            f"({hardware.gpus_per_node}) or a multiple of it: nodes are filled."
        )
    if mode == "normal" and internode == "flat":
        ops = _normal_flat(config, hardware, gpus)
    elif mode == "normal" and internode == "phased":
        ops = _normal_phased(config, hardware, gpus)
    elif mode == "normal":
        ops = _normal(config, hardware, gpus)
    else:
        ops = _low_latency(config, hardware, gpus)
    return Prediction(config, hardware.name, mode, *ops, internode=internode)


def _normal(c: Config, hw: Hardware, gpus: int) -> tuple[OpTime, OpTime]:
    """Each token once per destination rank; internode: once per destination node over RDMA
    (to the GPU of the same local index), then over NVLink to the ranks in that node."""
    nodes = c.num_ranks // gpus
    ranks_per_token = _destinations(c, c.num_ranks)
    nodes_per_token = _destinations(c, nodes)
    # Received rows from sources of another local index cross NVLink; for the normal
    # intranode kernels that is every rank but the receiver (gpus = R).
    rows_nvlink = c.num_tokens * ranks_per_token * (gpus - 1) / gpus
    rows_rdma = c.num_tokens * nodes_per_token * (nodes - 1) / nodes
    if nodes == 1:
        deepep_rows, deepep_link = c.num_tokens * ranks_per_token, "NVLink"
    else:
        deepep_rows, deepep_link = c.num_tokens * nodes_per_token, "RDMA"

    def op(row_bytes: float) -> OpTime:
        nvlink, rdma = rows_nvlink * row_bytes, rows_rdma * row_bytes
        # The legs are pipelined, so their transfer times overlap; a token crosses both in
        # turn, so their fixed latencies add.
        legs = {"nvlink": nvlink / (hw.nvlink_gbps * 1e9), "rdma": rdma / (hw.nic_gbps * 1e9)}
        used = {"nvlink": nvlink > 0, "rdma": rdma > 0}
        latency = hw.nvlink_latency_us * used["nvlink"] + hw.rdma_latency_us * used["rdma"]
        bottleneck = max(legs, key=legs.get) if any(used.values()) else "none"
        seconds = (hw.launch_us + latency) * 1e-6 + max(legs.values())
        links = {"nvlink": nvlink, "rdma": rdma}
        return OpTime(seconds, links, bottleneck, deepep_rows * row_bytes, deepep_link)

    return op(c.dispatch_row_bytes), op(c.combine_row_bytes)


def _normal_flat(c: Config, hw: Hardware, gpus: int) -> tuple[OpTime, OpTime]:
    """Each token once per destination rank, straight there: NVLink to the other GPUs of the
    node, RDMA to every rank of another node. No relay, so the two links work side by side
    and each pays only its own latency. DeepEP's count stays that of its own scheme, so the
    GB/s of every scheme compare."""
    nodes = c.num_ranks // gpus
    ranks_per_token = _destinations(c, c.num_ranks)
    rows_nvlink = c.num_tokens * ranks_per_token * (gpus - 1) / c.num_ranks
    rows_rdma = c.num_tokens * ranks_per_token * (c.num_ranks - gpus) / c.num_ranks
    if nodes == 1:
        deepep_rows, deepep_link = c.num_tokens * ranks_per_token, "NVLink"
    else:
        deepep_rows, deepep_link = c.num_tokens * _destinations(c, nodes), "RDMA"

    def op(row_bytes: float) -> OpTime:
        links = {"nvlink": rows_nvlink * row_bytes, "rdma": rows_rdma * row_bytes}
        return OpTime(*_side_by_side(links, hw), deepep_rows * row_bytes, deepep_link)

    return op(c.dispatch_row_bytes), op(c.combine_row_bytes)


def _normal_phased(c: Config, hw: Hardware, gpus: int) -> tuple[OpTime, OpTime]:
    """The node-aware dispatch as phases: the send puts each row to the receivers of its own
    node and once to its relay in each other node, both links at once; once everything has
    arrived, the relays forward over NVLink (a launch and the NVLink latency again, no
    overlap with the network). The combine is flat puts, then a launch that sums."""
    aware, _ = _normal(c, hw, gpus)
    _, flat_combine = _normal_flat(c, hw, gpus)
    row = c.dispatch_row_bytes
    # The node-aware NVLink rows: those to the other ranks of the own node (the send's NVLink
    # leg), and those the relays forward.
    own_node = c.num_tokens * _destinations(c, c.num_ranks) * (gpus - 1) / c.num_ranks * row
    relayed = aware.link_bytes["nvlink"] - own_node
    send, _, _ = _side_by_side({"nvlink": own_node, "rdma": aware.link_bytes["rdma"]}, hw)
    legs = {"nvlink": (own_node + relayed) / (hw.nvlink_gbps * 1e9),
            "rdma": aware.link_bytes["rdma"] / (hw.nic_gbps * 1e9)}
    relay = (hw.launch_us + hw.nvlink_latency_us) * 1e-6 + relayed / (hw.nvlink_gbps * 1e9)
    dispatch = OpTime(send + (relay if relayed > 1e-9 * row else 0.0), aware.link_bytes,
                      max(legs, key=legs.get), aware.deepep_bytes, aware.deepep_link)
    combine = dataclasses.replace(flat_combine, seconds=flat_combine.seconds + hw.launch_us * 1e-6)
    return dispatch, combine


def _low_latency(c: Config, hw: Hardware, gpus: int) -> tuple[OpTime, OpTime]:
    """One message per (token, expert) straight to the expert's rank: NVLink inside the node
    (with ll_nvlink), RDMA otherwise; the own rank's messages stay in its memory."""
    messages = c.num_tokens * c.num_topk
    # Random routing gives every expert the same chance, so a message lands on a given rank
    # with probability 1/R.
    if c.ll_nvlink:
        share_nvlink, share_rdma = (gpus - 1) / c.num_ranks, (c.num_ranks - gpus) / c.num_ranks
    else:
        share_nvlink, share_rdma = 0.0, (c.num_ranks - 1) / c.num_ranks

    def op(message_bytes: float) -> OpTime:
        links = {
            "nvlink": messages * share_nvlink * message_bytes,
            "rdma": messages * share_rdma * message_bytes,
        }
        return OpTime(*_side_by_side(links, hw), messages * message_bytes, "all")

    return op(c.dispatch_row_bytes + LL_HEADER_BYTES), op(c.combine_row_bytes)


def _side_by_side(links: dict[str, float], hw: Hardware) -> tuple[float, dict[str, float], str]:
    """(seconds, links, bottleneck) when the two links carry their bytes at the same time,
    each after its own latency."""
    legs = {
        "nvlink": hw.nvlink_latency_us * 1e-6 + links["nvlink"] / (hw.nvlink_gbps * 1e9),
        "rdma": hw.rdma_latency_us * 1e-6 + links["rdma"] / (hw.nic_gbps * 1e9),
    }
    legs = {k: t for k, t in legs.items() if links[k] > 0}
    bottleneck = max(legs, key=legs.get) if legs else "none"
    return hw.launch_us * 1e-6 + max(legs.values(), default=0.0), links, bottleneck


def _predict_shared(c: Config, device: SharedDevice, mode: str) -> Prediction:
    """Every rank's bytes read and written once in the one memory."""
    if mode == "normal":
        rows, link = c.num_tokens * _destinations(c, c.num_ranks), "NVLink"
        sizes = (c.dispatch_row_bytes, c.combine_row_bytes)
    else:
        rows, link = c.num_tokens * c.num_topk, "all"
        sizes = (c.dispatch_row_bytes + LL_HEADER_BYTES, c.combine_row_bytes)

    def op(row_bytes: float) -> OpTime:
        moved = 2 * rows * row_bytes
        seconds = device.launch_us * 1e-6 + c.num_ranks * moved / (device.copy_gbps * 1e9)
        return OpTime(seconds, {"hbm": moved}, "hbm", rows * row_bytes, link)

    return Prediction(c, device.name, mode, *(op(s) for s in sizes))


def _destinations(c: Config, units: int) -> float:
    return expected_destinations(c.num_experts, c.num_topk, units, c.num_groups, c.num_topk_groups)


# ---------------------------------------------------------------------------------------------
# DeepEP's published tables (README, H800 + CX7 400 Gb/s InfiniBand)

# Normal kernels: 4096 tokens per rank, H 7168, top-8 of 256 experts, FP8 dispatch, BF16
# combine; GB/s of DeepEP's count (intranode: NVLink, internode: RDMA "logical").
# EP -> (dispatch GB/s, combine GB/s).
DEEPEP_NORMAL = {8: (153.0, 158.0), 16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}
# Low-latency kernels: 128 tokens per rank, H 7168, top-8, FP8 dispatch, BF16 combine.
# EP -> (dispatch us, GB/s, combine us, GB/s). Current README (since 2025-06-05, NVLink inside
# the node); its EP128 and EP256 rows were kept from the first release, measured with pure RDMA.
DEEPEP_LOW_LATENCY = {
    8: (77.0, 98.0, 114.0, 127.0),
    16: (118.0, 63.0, 195.0, 74.0),
    32: (155.0, 48.0, 273.0, 53.0),
    64: (173.0, 43.0, 314.0, 46.0),
    128: (192.0, 39.0, 369.0, 39.0),
    256: (194.0, 39.0, 360.0, 40.0),
}
# The first release's pure-RDMA rows (2025-02-24), not used in the fit.
DEEPEP_LOW_LATENCY_RDMA = {
    8: (163.0, 46.0, 318.0, 46.0),
    16: (173.0, 43.0, 329.0, 44.0),
    32: (182.0, 41.0, 350.0, 41.0),
    64: (186.0, 40.0, 353.0, 41.0),
}
_LL_NVLINK_MAX_EP = 64  # the largest EP the 2025-06 README re-measured with NVLink


@dataclasses.dataclass(frozen=True)
class CalibrationRow:
    """One published row next to the model's prediction.

    Attributes:
      table: "normal", "low_latency" (current README) or "low_latency_rdma" (first release).
      num_ranks: EP.
      op: "dispatch" or "combine".
      published_s, predicted_s: times. For normal rows the published time is DeepEP's
        byte count for the setting (expected, `predict`'s deepep_bytes) over the published GB/s.
      published_gbps, predicted_gbps: GB/s in DeepEP's accounting.
      fitted: whether the row was used to fit the H800 constants.
    """

    table: str
    num_ranks: int
    op: str
    published_s: float
    predicted_s: float
    published_gbps: float
    predicted_gbps: float
    fitted: bool

    @property
    def time_error(self) -> float:
        return self.predicted_s / self.published_s - 1.0

    @property
    def gbps_error(self) -> float:
        return self.predicted_gbps / self.published_gbps - 1.0


def table_config(table: str, num_ranks: int) -> Config:
    """The setting of DeepEP's benchmark behind a published row.

    Normal: DeepEP's internode test groups the experts by node and lets a token choose
    min(nodes, 4) of them (top-4 of 8 groups at EP64); the intranode test has no group limit.
    Low latency: no group limit (256 experts; DeepEP's test defaults to 288 where R divides
    it, which changes no byte of the model).
    """
    if table == "normal":
        nodes = max(num_ranks // H800.gpus_per_node, 1)
        groups = (nodes, min(nodes, 4)) if nodes > 1 else (None, None)
        return Config(4096, 7168, 8, 256, num_ranks, True, *groups)
    nvlink = table == "low_latency" and num_ranks <= _LL_NVLINK_MAX_EP
    return Config(128, 7168, 8, 256, num_ranks, True, ll_nvlink=nvlink)


def calibration_table(hardware: Hardware = H800) -> list[CalibrationRow]:
    """Every row of DeepEP's published H800 tables with the model's prediction."""
    published: list[tuple[str, int, float | None, float, float | None, float]] = []
    for ep, (dispatch_gbps, combine_gbps) in DEEPEP_NORMAL.items():
        published.append(("normal", ep, None, dispatch_gbps, None, combine_gbps))
    for table, data in (
        ("low_latency", DEEPEP_LOW_LATENCY),
        ("low_latency_rdma", DEEPEP_LOW_LATENCY_RDMA),
    ):
        published += [(table, ep, *row) for ep, row in data.items()]
    rows = []
    for table, ep, dispatch_us, dispatch_gbps, combine_us, combine_gbps in published:
        mode = "normal" if table == "normal" else "low_latency"
        p = predict(table_config(table, ep), hardware, mode)
        for name, op, us, gbps in (
            ("dispatch", p.dispatch, dispatch_us, dispatch_gbps),
            ("combine", p.combine, combine_us, combine_gbps),
        ):
            # Normal rows publish GB/s only: their time is DeepEP's byte count over it.
            seconds = op.deepep_bytes / (gbps * 1e9) if us is None else us * 1e-6
            fitted = table != "low_latency_rdma"
            rows.append(CalibrationRow(table, ep, name, seconds, op.seconds, gbps, op.gbps, fitted))
    return rows


def markdown_table(rows: Sequence[CalibrationRow]) -> str:
    """The comparison as a markdown table (what docs/perfmodel.md shows)."""
    lines = [
        "| table | EP | op | published | predicted | time error | published GB/s "
        "| predicted GB/s | GB/s error | fit |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.table} | {r.num_ranks} | {r.op} | {_fmt_time(r.published_s)} "
            f"| {_fmt_time(r.predicted_s)} | {r.time_error:+.1%} | {r.published_gbps:.0f} "
            f"| {r.predicted_gbps:.1f} | {r.gbps_error:+.1%} | {'yes' if r.fitted else 'no'} |"
        )
    worst = max(max(abs(r.time_error), abs(r.gbps_error)) for r in rows)
    lines.append("")
    lines.append(f"Largest error: {worst:.1%} over {len(rows)} rows.")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class InternodeRow:
    """One op of DeepEP's internode normal table beside each scheme's prediction.

    Attributes:
      num_ranks: EP (8 GPUs per node).
      op: "dispatch" or "combine".
      published_gbps: DeepEP's RDMA GB/s.
      node_aware, flat, phased: the predictions (`OpTime`) of the `INTERNODE` schemes.
    """

    num_ranks: int
    op: str
    published_gbps: float
    node_aware: OpTime
    flat: OpTime
    phased: OpTime

    @property
    def published_s(self) -> float:
        return self.node_aware.deepep_bytes / (self.published_gbps * 1e9)


def internode_table(hardware: Hardware = H800) -> list[InternodeRow]:
    """DeepEP's internode normal rows (EP16 to EP64) and what each scheme predicts there."""
    rows = []
    for ep, published in DEEPEP_NORMAL.items():
        if ep <= hardware.gpus_per_node:
            continue
        config = table_config("normal", ep)
        aware, flat, phased = (predict(config, hardware, "normal", s) for s in INTERNODE)
        for i, name in enumerate(("dispatch", "combine")):
            rows.append(InternodeRow(ep, name, published[i], getattr(aware, name),
                                     getattr(flat, name), getattr(phased, name)))
    return rows


def internode_markdown(rows: Sequence[InternodeRow]) -> str:
    """The schemes as a markdown table (docs/perfmodel.md shows it)."""
    lines = [
        "| EP | op | DeepEP | node-aware (streamed) | flat puts | phased | flat / node-aware "
        "| phased / node-aware | RDMA MB per rank, node-aware / flat |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.num_ranks} | {r.op} | {_fmt_time(r.published_s)} "
            f"({r.published_gbps:.0f} GB/s) | {_fmt_time(r.node_aware.seconds)} "
            f"({r.node_aware.gbps:.1f} GB/s) | {_fmt_time(r.flat.seconds)} "
            f"({r.flat.gbps:.1f} GB/s) | {_fmt_time(r.phased.seconds)} "
            f"({r.phased.gbps:.1f} GB/s) | {r.flat.seconds / r.node_aware.seconds:.2f} "
            f"| {r.phased.seconds / r.node_aware.seconds:.2f} "
            f"| {r.node_aware.link_bytes['rdma'] / 1e6:.1f} / "
            f"{r.flat.link_bytes['rdma'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m jax_ep.tools.perfmodel`: one prediction, or --table for the comparison."""
    parser = argparse.ArgumentParser(prog="python -m jax_ep.tools.perfmodel", description=__doc__)
    parser.add_argument("--table", action="store_true",
                        help="print the DeepEP comparison and the internode schemes' table")
    parser.add_argument("--ours", action="store_true",
                        help="print our kernels' predicted device times per GPU model, each "
                        "calibrated on its newest report (jax_ep.tools.kernel_model)")
    parser.add_argument("--reports", metavar="DIR",
                        help="the GPU reports --ours calibrates on (default: docs/gpu)")
    parser.add_argument("--hardware", choices=sorted(PRESETS), default="H800")
    parser.add_argument("--mode", choices=(*MODES, "both"), default="both")
    parser.add_argument("--ep", type=int, default=8, help="EP ranks")
    parser.add_argument("--tokens", type=int, help="tokens per rank (4096 normal, 128 LL)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--groups", type=int, help="expert groups (default: no group limit)")
    parser.add_argument("--topk-groups", type=int, help="groups per token (with --groups)")
    parser.add_argument("--bf16", action="store_true", help="dispatch BF16 instead of FP8")
    parser.add_argument("--internode", choices=INTERNODE, default="node_aware",
                        help="how normal mode crosses nodes (default: node_aware, DeepEP's)")
    args = parser.parse_args(argv)
    if args.ours:
        from jax_ep.tools import kernel_model  # the account: NumPy only, but not needed otherwise

        try:
            print(kernel_model.report(args.reports or kernel_model.REPORTS))
        except (FileNotFoundError, ValueError) as error:
            parser.error(str(error))
        return
    if args.table:
        print(markdown_table(calibration_table()))
        print("\nNormal mode between nodes, H800, each scheme:\n")
        print(internode_markdown(internode_table()))
        return
    hardware = PRESETS[args.hardware]
    for mode in MODES if args.mode == "both" else (args.mode,):
        tokens = args.tokens or (4096 if mode == "normal" else 128)
        try:
            config = Config(
                tokens,
                args.hidden,
                args.topk,
                args.experts,
                args.ep,
                fp8_dispatch=not args.bf16,
                num_groups=args.groups,
                num_topk_groups=args.topk_groups,
            )
            print(predict(config, hardware, mode, args.internode).describe())
        except ValueError as error:
            parser.error(str(error))


if __name__ == "__main__":
    main()
