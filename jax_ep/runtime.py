"""Runtime of the CUDA backend between devices: the symmetric buffer every rank exchanges
through.

The portable backend needs no initialization, and neither does the CUDA backend with one rank
or with virtual ranks (`jax_ep.virtual`). Between devices, `jax_ep.initialize()` sets up one
symmetric buffer per rank, sized for the largest call (`BufferConfig`, `required_bytes`):

- GPUs (one per process): every process calls it once after `jax.distributed.initialize()`.
  Process 0 draws an NVSHMEM unique id and shares it through the `jax.distributed` key-value
  store, every process initializes NVSHMEM from inside our extension (PE =
  `jax.process_index()`) and allocates the buffer. The EP axis may span every process, or be
  one axis of a larger mesh (each GPU then exchanges within its EP group, fixed by its first
  exchange: cuda/ep_group.h). NVSHMEM terminates the process when it cannot initialize, so every
  precondition is checked here first and reported as a Python exception.
- Several GPUs of one process (JAX's usual way to drive a node): a buffer on each, reached by
  the others through CUDA peer access (cuda/local_exchange.cu); loads and stores only.
- CPU devices (one process, e.g. `--xla_force_host_platform_device_count=8`): host peers, a
  stand-in for NVSHMEM in host memory (cuda/host_peers.h), so that `backend="cuda"` runs
  between the CPU devices of `shard_map` the ops the GPUs run: same phases, buffer carving
  and flags. Buffers are reserved per EP group (keyed by its devices) and touched only where
  written.

How a rank reaches its peers' buffers, `$JAX_EP_PEER_ACCESS` (read by `initialize()`):
`store` (the default) with loads and stores, as over NVLink; `put` with puts only, as over
InfiniBand or RoCE between nodes (cuda/exchange.h, put views). Over puts every send copies
what it sends into a send area of the buffer first, and the normal combine's receivers push
the rows home (sized by `buffer_regions`). Between GPUs the puts are NVSHMEM's (compiled, not
yet run on a GPU: docs/cuda.md).

Nodes, `$JAX_EP_RANKS_PER_NODE` (or, between GPUs, the processes' hosts, shared through the
key-value store): with ranks split into nodes of consecutive ranks, the peers are reached with
puts and the normal dispatch is node-aware: a token crosses to another node once, to the rank
there with its index in the node, which stores it into the receivers of its node. On CPU
devices the variable simulates the split.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import math
import os
import socket
import sys
import threading
from collections.abc import Sequence

import jax
import numpy as np

from jax_ep import _exchange_order, tuned
from jax_ep._checks import MAX_TOP_K

SIGNAL_BYTES = 4096  # the peers' signals at the start of the buffer (cuda/peer_ops.h)
MAX_SETTING = 2**31 - 1  # a BufferConfig's counts: the ops count rows and tokens in int32
# A region that size stands for "too large for any machine": the extension's sizes saturate
# there instead of wrapping (cuda/peer_ops.h, kTooLarge).
TOO_LARGE = 2**60
PEER_ACCESS = ("store", "put")
REGIONS = ("signals", "normal", "low_latency")  # the buffer's, in order (buffer_regions)
KEY_TIMEOUT_MS = 10 * 60 * 1000

_state: dict[str, object] = {}
# The initialized buffer's GPU model and where its rings came from (runtime.defaults()).
_resolved: dict[str, object] = {}
_generation = itertools.count()


@dataclasses.dataclass(frozen=True)
class Channels:
    """Normal dispatch and combine streamed through ring buffers (cuda/channels.h,
    docs/cuda.md, "Channels"): between devices, rank-major, each rank's tokens split into
    `channels` ranges; every (channel, sender, receiver) has a ring of chunk_tokens x
    ring_chunks slots in the receiver's buffer (over puts a send ring too; node-aware, the
    dispatch's rings between nodes go to the relays, which forward each chunk into the rings
    of their node as it lands), so their symmetric bytes do not grow with the tokens, and
    senders and receivers run at once. Expert-major calls still run in phases.

    Attributes:
      channels: token ranges per rank, each with its own rings and, on a GPU, its own warps
        (`warps`): the dispatch's senders and receivers and, node-aware, two forwarders of a
        relay's chunks; the combine's senders and one receiver; packed into blocks of 8 warps,
        2 blocks per SM, resident at once. The default 40 fills the default `num_sms` (20)
        with the dispatch's 8 warps per channel; an op whose num_sms holds fewer streams
        through fewer channels (`stream_plan`).
      chunk_tokens: slots a sender fills before it publishes them (one put per chunk and
        destination over puts: 4 rows of 14 KB are a 57 KB message).
      ring_chunks: chunks per ring (2 or more let a sender fill one while the receiver drains
        another; the default 3 keeps one more in flight). Slots per (channel, peer) pair:
        chunk_tokens x ring_chunks; the symmetric bytes grow with channels x slots x peers, not
        with the tokens (the default's 40 x 12 slots per peer: EP64 over puts under 1 GiB).
      warps: warps per role per channel: the dispatch's senders, which split a token's
        destinations (each reads the row once per 8 of its rings, so w senders read it up to w
        times, locally), and as many receivers, which split the rings; the combine's senders,
        which split the homes. 0, the default: on a GPU 4 for the dispatch and 8 for the
        combine (DISPATCH_CHANNEL_WARPS, COMBINE_CHANNEL_SENDERS), on CPU devices the warps of
        $JAX_EP_CPU_GRID's blocks. Never more than a role has rings to split.
    """

    channels: int = 40
    chunk_tokens: int = 4
    ring_chunks: int = 3
    warps: int = 0

    def check(self) -> None:
        for name in ("channels", "chunk_tokens", "ring_chunks"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or \
                    not 1 <= value <= 1 << 20:
                raise ValueError(f"Channels.{name} must be an int in [1, 2^20] (1 is the "
                                 f"smallest that makes progress); got {value!r}.")
        w = self.warps
        if not isinstance(w, (int, np.integer)) or isinstance(w, bool) or \
                not 0 <= w <= MAX_CHANNEL_WARPS:
            raise ValueError(f"Channels.warps must be an int in [0, {MAX_CHANNEL_WARPS}] "
                             f"(0: the platform's default); got {w!r}.")

    def slots(self) -> int:
        """Slots per ring."""
        return self.chunk_tokens * self.ring_chunks


# BufferConfig's default rings. A config holding this very object left them unset, so the
# tuned table may replace them (`defaults`); Channels() passed by the caller is kept as given.
BUILT_IN_CHANNELS = Channels()
CHANNEL_FIELDS = tuple(f.name for f in dataclasses.fields(Channels))
NUM_SMS_OPS = ("dispatch", "combine")


# A streaming launch on a GPU (cuda/channels.h, cuda/phases.cuh; tests/test_account.py checks
# these against jax_ep._ext.kernel_parameters()): blocks of STREAM_BLOCK_WARPS warps,
# STREAM_BLOCKS_PER_SM of them per SM; per channel, by default, DISPATCH_CHANNEL_WARPS
# senders and as many receivers (and node-aware FORWARDERS) for the dispatch,
# COMBINE_CHANNEL_SENDERS senders and one receiver for the combine.
STREAM_BLOCK_WARPS, STREAM_BLOCKS_PER_SM = 8, 2
DISPATCH_CHANNEL_WARPS, COMBINE_CHANNEL_SENDERS, FORWARDERS = 4, 8, 2
MAX_CHANNEL_WARPS = 64


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """A streaming launch of one op on a GPU: `channels` of `warps` warps per role, `per_channel`
    warps in all per channel."""

    channels: int
    warps: int
    per_channel: int


def stream_plan(op: str, rings: Channels, num_ranks: int, *, ranks_per_node: int = 0,
                num_sms: int | None = None) -> StreamPlan:
    """How `op` ("dispatch" or "combine") streams through `rings` on a GPU: the warps per role
    (rings.warps, or the GPU's default, at most the rings a role splits: a dispatch source's
    destinations, the ranks of its node and, node-aware with ranks_per_node < num_ranks, the
    nodes; the combine's homes), and the channels, fewer where num_sms's blocks (each SM holds
    STREAM_BLOCKS_PER_SM) cannot hold them all at once. Every rank plans the same; the CPU
    devices' host peers stream through the same channels (with their grid's warps unless
    rings.warps names them)."""
    aware = 0 < ranks_per_node < num_ranks
    if op == "dispatch":
        nodes = -(-num_ranks // ranks_per_node) if aware else 0
        rings_split = (ranks_per_node if aware else num_ranks) + nodes
        warps = min(rings.warps or DISPATCH_CHANNEL_WARPS, max(rings_split, 1))
        per_channel = 2 * warps + (FORWARDERS if aware else 0)
    else:
        warps = min(rings.warps or COMBINE_CHANNEL_SENDERS, max(num_ranks, 1))
        per_channel = warps + 1
    channels = rings.channels
    if num_sms is not None:
        most = num_sms * STREAM_BLOCKS_PER_SM * STREAM_BLOCK_WARPS // per_channel
        channels = min(channels, max(most, 1))
    return StreamPlan(channels, warps, per_channel)


def channels_from_env(default: Channels | None = None) -> Channels | None:
    """`$JAX_EP_CHANNELS` when set, over `default` (the config's): "channels,chunk_tokens,
    ring_chunks[,warps]" (e.g. "40,4,3") streams dispatch and combine through rings of that
    shape, "off" runs them in phases."""
    text = os.environ.get("JAX_EP_CHANNELS", "").strip()
    if not text:
        return default
    if text.lower() == "off":
        return None
    parts = text.split(",")
    if len(parts) not in (3, 4) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"$JAX_EP_CHANNELS={text!r} is not \"channels,chunk_tokens,"
                         f"ring_chunks[,warps]\" (e.g. \"40,4,3\") or \"off\" (in phases); "
                         f"unset it for the buffer's Channels.")
    channels = Channels(*(int(p) for p in parts))
    channels.check()
    return channels


def channels() -> Channels | None:
    """The rings of the initialized buffer (`initialize()`), or None: dispatch and combine run
    in phases."""
    return _state.get("channels")


@dataclasses.dataclass(frozen=True)
class Tuned:
    """A checked entry of the tuned table (`jax_ep.tuned.TABLE`): the buffer's rings (None: in
    phases) and the num_sms of dispatch and combine."""

    channels: Channels | None
    num_sms: dict[str, int]


def tuned_settings(device_kind: str | None) -> Tuned | None:
    """The tuned table's entry for the GPU model `device_kind`, checked; None where the table
    has none, and for None (CPU devices: the built-in defaults).

    Raises:
      ValueError: a malformed entry, naming the GPU and the field.
    """
    if device_kind is None or device_kind not in tuned.TABLE:
        return None
    entry = tuned.TABLE[device_kind]
    where = f"jax_ep.tuned.TABLE[{device_kind!r}]"
    fix = ("copy the entry tools/gpu_tune.py printed for this GPU, or remove it for the "
           "built-in defaults")
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a dict with 'measured', 'channels' and 'num_sms'; "
                         f"got {entry!r}: {fix}.")
    fields = {"measured", "channels", "num_sms"}
    if set(entry) != fields:
        wrong = [f"{what} {sorted(names)}" for what, names in (
            ("lacks", fields - set(entry)), ("has unknown", set(entry) - fields)) if names]
        raise ValueError(f"{where} must have the fields {sorted(fields)}; it "
                         f"{' and '.join(wrong)}: {fix}.")
    if not isinstance(entry["measured"], str) or not entry["measured"].strip():
        raise ValueError(f"{where}['measured'] must say what measured the entry (a non-empty "
                         f"str); got {entry['measured']!r}: {fix}.")
    rings = entry["channels"]
    if rings is not None:
        if not isinstance(rings, dict) or set(rings) != set(CHANNEL_FIELDS):
            raise ValueError(f"{where}['channels'] must be None (in phases) or a dict of "
                             f"{', '.join(CHANNEL_FIELDS)}; got {rings!r}: {fix}.")
        rings = Channels(**rings)
        try:
            rings.check()
        except ValueError as error:
            raise ValueError(f"{where}['channels']: {error} {fix[0].upper()}{fix[1:]}.") \
                from None
    num_sms = entry["num_sms"]
    if not isinstance(num_sms, dict) or set(num_sms) != set(NUM_SMS_OPS) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in num_sms.values()):
        raise ValueError(f"{where}['num_sms'] must be a dict of a positive int for each of "
                         f"{', '.join(NUM_SMS_OPS)}; got {num_sms!r}: {fix}.")
    return Tuned(rings, {op: int(num_sms[op]) for op in NUM_SMS_OPS})


def device_kind() -> str | None:
    """The GPU model whose defaults apply: that of the initialized buffer's GPUs, else the
    default backend's first device's (`jax.Device.device_kind`); None on CPU devices. Static:
    the ops read it while they trace."""
    if _state:
        return _resolved.get("device_kind")
    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else None


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What the runtime uses where the caller sets nothing, for one GPU model, and where each
    came from ("$JAX_EP_CHANNELS", "BufferConfig.channels", "tuned table (KIND)" or
    "built-in (why)")."""

    device_kind: str | None
    channels: Channels | None
    channels_from: str
    num_sms: dict[str, int]
    num_sms_from: str

    def describe(self) -> str:
        rings = "in phases" if self.channels is None else \
            "rings " + ",".join(map(str, dataclasses.astuple(self.channels)))
        sms = ", ".join(f"{op} {n}" for op, n in self.num_sms.items())
        return (f"{self.device_kind or 'CPU devices'}: {rings} [{self.channels_from}]; "
                f"num_sms {sms} [{self.num_sms_from}]")


def defaults_for(device_kind: str | None) -> Defaults:
    """The defaults a `BufferConfig()` and the ops' num_sms get on the GPU model `device_kind`
    (None: CPU devices), before `initialize()`: `$JAX_EP_CHANNELS` over the tuned table's
    rings, the table's num_sms, the built-in defaults where it has no entry."""
    entry = tuned_settings(device_kind)
    if entry is not None:
        source = f"tuned table ({device_kind})"
        rings, rings_from, num_sms, sms_from = entry.channels, source, entry.num_sms, source
    else:
        why = "built-in (CPU devices)" if device_kind is None else \
            f"built-in ({device_kind} is not in jax_ep.tuned.TABLE)"
        rings, rings_from = Channels(), why
        num_sms, sms_from = dict.fromkeys(NUM_SMS_OPS, int(tuned.DEFAULT_NUM_SMS)), why
    if os.environ.get("JAX_EP_CHANNELS", "").strip():
        rings, rings_from = channels_from_env(rings), "$JAX_EP_CHANNELS"
    return Defaults(device_kind, rings, rings_from, num_sms, sms_from)


def defaults() -> Defaults:
    """The defaults in effect here (`defaults_for(device_kind())`); once initialized, the
    buffer's rings and where they came from."""
    found = defaults_for(device_kind())
    if not _state:
        return found
    return dataclasses.replace(found, channels=_state.get("channels"),
                               channels_from=str(_resolved.get("channels_from")))


def default_num_sms(op: str, num_sms):
    """The num_sms `op` (jax_ep.dispatch or jax_ep.combine) runs with: `num_sms` as given, or,
    left at its default (a `tuned.Default`), the tuned table's for the GPU, else the default."""
    if not isinstance(num_sms, tuned.Default):
        return num_sms
    entry = tuned_settings(device_kind())
    if entry is None:
        return int(num_sms)
    return entry.num_sms["combine" if op.endswith("combine") else "dispatch"]


def _rings_of(config: BufferConfig, device_kind: str | None) -> tuple[Channels | None, str]:
    """The rings a buffer for `config` gets on `device_kind`, and where they came from:
    `$JAX_EP_CHANNELS` over the config's, or (left unset) over the tuned table's."""
    if config.channels is BUILT_IN_CHANNELS:
        found = defaults_for(device_kind)
        return found.channels, found.channels_from
    env = bool(os.environ.get("JAX_EP_CHANNELS", "").strip())
    return (channels_from_env(config.channels),
            "$JAX_EP_CHANNELS" if env else "BufferConfig.channels")


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """The largest call one rank will make; sizes the symmetric buffer.

    Attributes:
      num_tokens: T per rank, normal mode (DeepEP's training/prefill shape by default).
      hidden: H.
      top_k: K.
      num_experts: E.
      num_ranks: R, the EP group size; None: every device (`jax.device_count()`: one GPU per
        process, or the CPU devices of this process).
      dtype_bytes: bytes per element of normal-mode rows (2 for bfloat16).
      capacity: normal-mode rows (entries when `expert_major`) per rank; None: the op's default.
      expert_major: size for the expert-major layout too (its default capacity is
        R*T*min(K, E/R) entries, much larger than the rank-major R*T rows).
      low_latency_tokens: T per rank, low-latency mode (0: no low-latency ops).
      channels: stream the normal dispatch and combine through rings of this shape
        (`Channels`; 0.11 GiB per rank at EP8 over puts, 0.88 GiB at EP64, whatever T); None:
        in phases (the normal region then grows with R x T x H: 7.2 GiB at EP64 over puts).
        `$JAX_EP_CHANNELS` overrides it when set. Left unset, the GPU's entry in the tuned
        table (`jax_ep.tuned`) where it has one, else `Channels()` (`defaults` says which).
    """

    num_tokens: int = 4096
    hidden: int = 7168
    top_k: int = 8
    num_experts: int = 256
    num_ranks: int | None = None
    dtype_bytes: int = 2
    capacity: int | None = None
    expert_major: bool = False
    low_latency_tokens: int = 128
    channels: Channels | None = BUILT_IN_CHANNELS

    def ranks(self) -> int:
        return jax.device_count() if self.num_ranks is None else self.num_ranks

    def check(self) -> None:
        def is_int(value) -> bool:
            return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

        for name in ("num_tokens", "hidden", "top_k", "num_experts", "dtype_bytes",
                     "num_ranks", "capacity"):
            value = getattr(self, name)
            if value is None and name in ("num_ranks", "capacity"):
                continue
            if not is_int(value) or not 1 <= value <= MAX_SETTING:
                raise ValueError(f"BufferConfig.{name} must be an int in [1, 2^31) (the ops "
                                 f"count in int32); got {value!r}.")
        if not is_int(self.low_latency_tokens) or not 0 <= self.low_latency_tokens <= MAX_SETTING:
            raise ValueError(f"BufferConfig.low_latency_tokens must be an int in [0, 2^31) (0: "
                             f"no low-latency ops); got {self.low_latency_tokens!r}.")
        if self.hidden % 128:
            raise ValueError(f"BufferConfig.hidden must be a multiple of 128; got {self.hidden}.")
        if self.num_experts % self.ranks():
            raise ValueError(f"BufferConfig.num_experts ({self.num_experts}) must be a multiple "
                             f"of the number of ranks ({self.ranks()}).")
        if self.channels is not None:
            if not isinstance(self.channels, Channels):
                raise ValueError(f"BufferConfig.channels must be a jax_ep.runtime.Channels or "
                                 f"None; got {self.channels!r}.")
            self.channels.check()
        if self.top_k > min(MAX_TOP_K, self.num_experts):
            raise ValueError(f"BufferConfig.top_k must be at most min({MAX_TOP_K}, num_experts="
                             f"{self.num_experts}), as in the ops; got {self.top_k}.")


def peer_access() -> str:
    """How ranks reach each other's buffers: `$JAX_EP_PEER_ACCESS`, "store" (default) or
    "put" (see the module's docstring)."""
    value = os.environ.get("JAX_EP_PEER_ACCESS", "").strip().lower() or "store"
    if value not in PEER_ACCESS:
        raise ValueError(f"$JAX_EP_PEER_ACCESS={value!r} is not one of {PEER_ACCESS}: "
                         f"'store' reaches peers with loads and stores (NVLink, the default), "
                         f"'put' with puts only (as between nodes).")
    return value


# The waits' timeouts (cuda/peer_ops.h reads the first two) and finalize's at exit.
TIMEOUT_VARS = ("JAX_EP_START_TIMEOUT_S", "JAX_EP_TIMEOUT_S", "JAX_EP_EXIT_TIMEOUT_S")


def env_seconds(name: str) -> float | None:
    """`$name` as a positive, finite number of seconds; None when unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"${name}={text!r} is not a positive number of seconds (e.g. 30); "
                         f"unset it for the default.")
    return value


def ranks_per_node() -> int:
    """`$JAX_EP_RANKS_PER_NODE`: the ranks of one node (consecutive ranks), which makes the
    normal dispatch node-aware over puts; 0 (unset): one node, or what `initialize()` finds
    between GPUs."""
    text = os.environ.get("JAX_EP_RANKS_PER_NODE", "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"$JAX_EP_RANKS_PER_NODE={text!r} is not a positive number of ranks "
                         f"(the ranks of one node, e.g. 8).")
    return int(text)


def nodes_of_hosts(hosts: Sequence[str]) -> int:
    """Ranks per node of a group whose rank r runs on host hosts[r]: 0 when every rank is on
    one host, else the ranks of each host, which must be consecutive and as many on every host
    (the last may hold fewer)."""
    firsts = [r for r, host in enumerate(hosts) if r == 0 or host != hosts[r - 1]]
    if len(firsts) == 1:
        return 0
    size = firsts[1]
    if (len(set(hosts)) != len(firsts) or any(f != i * size for i, f in enumerate(firsts))
            or len(hosts) - firsts[-1] > size):
        raise RuntimeError(
            f"the processes' hosts are not in node order ({', '.join(hosts)}): give each "
            f"node consecutive process ids, the same number per node (jax.distributed's "
            f"process_id), or set $JAX_EP_RANKS_PER_NODE.")
    return size


def buffer_regions(config: BufferConfig, *, access: str | None = None,
                   nodes: int | None = None) -> dict[str, int]:
    """Bytes of each region of the symmetric buffer: {'signals', 'normal', 'low_latency'}.

    Computed by the extension from the carving the ops use (cuda/peer_ops.h), so the sizes
    here are the sizes there. The normal-mode region holds the largest dispatch (with FP8
    scales) or combine (with weights) of the config; the low-latency region two halves, each
    holding its low-latency calls (two exchanges in flight, `buffer` 0 and 1), and no
    normal-mode call reaches into it. Over puts (`access`, default `peer_access()`) the
    regions also hold the send areas the puts read from, and the normal region the rows the
    combine's receivers return; node-aware (`nodes`: ranks per node, default
    `ranks_per_node()`), the relays' slots. With channels (`config.channels`, or
    `$JAX_EP_CHANNELS` when set) dispatch and combine, where they stream, hold their rings
    (and the dispatch its counts) only.
    """
    regions = _regions(config, access, nodes)
    return {name: regions[name] for name in REGIONS}


def normal_region_bytes(config: BufferConfig, *, access: str | None = None,
                        nodes: int | None = None) -> dict[str, int]:
    """What the normal region holds at most for each op: {'dispatch', 'combine'} (the region
    is the larger); arguments as `buffer_regions`."""
    regions = _regions(config, access, nodes)
    return {name: regions[name] for name in ("dispatch", "combine")}


def _regions(config: BufferConfig, access: str | None, nodes: int | None) -> dict[str, int]:
    config.check()
    access = access or peer_access()
    nodes = ranks_per_node() if nodes is None else nodes
    if access not in PEER_ACCESS:
        raise ValueError(f"buffer_regions: access must be one of {PEER_ACCESS}; got {access!r}.")
    return _carved(config, access, nodes, _rings_of(config, device_kind())[0])


def _carved(config: BufferConfig, access: str, nodes: int,
            rings: Channels | None) -> dict[str, int]:
    """The extension's carving of `config` with `rings` as they are ($JAX_EP_CHANNELS
    resolved by the caller)."""
    from jax_ep import _ffi

    _ffi.require_extension("jax_ep.runtime.buffer_regions")
    rings = rings or Channels(0, 0, 0)
    return dict(_ffi.EXT.buffer_regions(
        config.ranks(), config.num_tokens, config.top_k, config.num_experts, config.hidden,
        config.dtype_bytes, config.capacity or 0, config.expert_major,
        config.low_latency_tokens, access == "put", nodes, rings.channels, rings.chunk_tokens,
        rings.ring_chunks))


def required_bytes(config: BufferConfig) -> int:
    """The symmetric bytes one rank needs for `config`."""
    return sum(buffer_regions(config).values())


def is_initialized() -> bool:
    """True between a successful `initialize()` and `finalize()`."""
    return bool(_state)


_exchange_order.has_buffer = is_initialized


def state() -> dict | None:
    """{'platform', 'rank', 'num_ranks', 'buffer_bytes', 'low_latency_bytes',
    'peer_access', 'ranks_per_node', 'channels'} while initialized, else None. platform: "gpu"
    (one GPU per process, NVSHMEM), "gpus" (the GPUs of this process, CUDA peer access) or
    "cpu" (host peers); ranks_per_node 0: one node; channels: the dispatch's rings (`Channels`)
    or None."""
    return dict(_state) if _state else None


def initialize(config: BufferConfig | None = None, *, buffer_bytes: int | None = None,
               low_latency_bytes: int = 0) -> None:
    """Sets up the CUDA backend between devices: NVSHMEM on GPUs (one GPU per process;
    collective), CUDA peer access between the GPUs of a process that sees several, host peers
    on the CPU devices of one process.

    Args:
      config: the largest call this process will make (default `BufferConfig()`, DeepEP's
        shapes); each rank's buffer gets `jax_ep.runtime.required_bytes(config)` bytes, laid
        out as `buffer_regions(config)` says.
      buffer_bytes: an explicit size instead of `config`.
      low_latency_bytes: with `buffer_bytes`, how many of them (at the end) hold the
        low-latency regions; normal-mode calls get the rest.

    Normal dispatch and combine stream through rings (`Channels`): `$JAX_EP_CHANNELS` when
    set, else `config.channels`; left unset (and with `buffer_bytes`), the GPU's entry in the
    tuned table (`jax_ep.tuned`), else `Channels()`. None or "off" runs them in phases
    (`channels()` says which, `defaults()` where they came from).

    Raises:
      RuntimeError: several processes with several GPUs each, several GPUs of one process
        with puts or nodes, GPUs of one process without peer access among them, several
        processes without GPUs, an extension
        without CUDA (GPUs) or without a build, already initialized, nodes without puts
        ($JAX_EP_RANKS_PER_NODE or several hosts, with $JAX_EP_PEER_ACCESS=store), hosts
        not in node order, or NVSHMEM failed (the message says which step).
      ValueError: a bad config, a buffer larger than a rank's memory (the message names the
        largest value of each setting that alone makes it fit), on CPU devices more channels
        than the host peers run, both config and buffer_bytes, low_latency_bytes without
        buffer_bytes, or a bad $JAX_EP_PEER_ACCESS, $JAX_EP_RANKS_PER_NODE or timeout
        ($JAX_EP_START_TIMEOUT_S, $JAX_EP_TIMEOUT_S, $JAX_EP_EXIT_TIMEOUT_S: positive seconds)
        or $JAX_EP_CHANNELS.
      TypeError: a config that is not a BufferConfig.
    """
    op = "jax_ep.initialize"
    if config is not None and not isinstance(config, BufferConfig):
        raise TypeError(f"{op}: config must be a jax_ep.runtime.BufferConfig (the largest call "
                        f"of this process), or buffer_bytes= an explicit size; got {config!r}.")
    for name in TIMEOUT_VARS:
        env_seconds(name)
    if config is not None and buffer_bytes is not None:
        raise ValueError(f"{op}: pass config or buffer_bytes, not both.")
    if low_latency_bytes and buffer_bytes is None:
        raise ValueError(f"{op}: low_latency_bytes goes with buffer_bytes; a config sizes "
                         f"its low-latency region itself (buffer_regions(config)).")
    if _state:
        raise RuntimeError(f"{op}: already initialized ({_state}); call jax_ep.finalize() "
                           f"first to change the buffer.")
    if config is not None:
        config.check()
    from jax_ep import _ffi

    _ffi.require_extension(op)
    _exchange_order.wait_and_forget()
    access = peer_access()
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    kind = device_kind()
    rings, rings_from = _rings_of(config or BufferConfig(), kind)
    local = gpu_platform(len(gpus), jax.process_count(), access, ranks_per_node()) == "local"
    if gpus and not _ffi.cuda_kernels_compiled():
        raise RuntimeError(
            f"{op}: jax_ep was built without CUDA kernels. Rebuild with nvcc on PATH: "
            f"pip install -C cmake.define.JAX_EP_CUDA=ON ."
        )
    if not gpus and jax.process_count() > 1:
        raise RuntimeError(
            f"{op}: {jax.process_count()} processes without GPUs. On CPU the exchange between "
            f"devices runs inside one process (host peers); use one process with several CPU "
            f"devices (--xla_force_host_platform_device_count), or backend='xla'."
        )
    rank, num_ranks = jax.process_index(), jax.process_count()
    nodes = ranks_per_node()
    node_of_pe = [p // nodes for p in range(num_ranks)] if nodes else [0] * num_ranks
    if gpus and num_ranks > 1 and not nodes:
        # More than one node: node-aware, puts between the nodes (stores within each).
        hosts = _share(op, "host", socket.gethostname().encode(), rank, num_ranks)
        nodes = nodes_of_hosts(hosts)
        node_of_pe = [hosts.index(host) for host in hosts]
        if nodes and "JAX_EP_PEER_ACCESS" not in os.environ:
            access = "put"
    if nodes and access != "put":
        raise RuntimeError(
            f"{op}: the ranks form nodes of {nodes} ($JAX_EP_RANKS_PER_NODE, or the processes' "
            f"hosts), which reach each other with puts: set $JAX_EP_PEER_ACCESS=put (it is "
            f"{access!r}).")
    if not gpus and rings is not None:
        _check_host_threads(op, rings)
    memory, what = _memory_per_rank(gpus)
    if buffer_bytes is None:
        config = dataclasses.replace(config or BufferConfig(), channels=rings)
        regions = buffer_regions(config, access=access, nodes=nodes)
        buffer_bytes, low_latency_bytes = sum(regions.values()), regions["low_latency"]
        if buffer_bytes > memory:
            raise ValueError(_unfitting(op, config, access, nodes, regions, memory, what))
    elif isinstance(buffer_bytes, int) and buffer_bytes > memory:
        raise ValueError(f"{op}: buffer_bytes={buffer_bytes} is more than {what} "
                         f"({memory} bytes); give at most that.")
    if not isinstance(buffer_bytes, int) or not isinstance(low_latency_bytes, int) or \
            low_latency_bytes < 0 or buffer_bytes - low_latency_bytes <= SIGNAL_BYTES:
        raise ValueError(f"{op}: buffer_bytes must be an int above {SIGNAL_BYTES} + "
                         f"low_latency_bytes (an int >= 0); got {buffer_bytes!r} and "
                         f"{low_latency_bytes!r}.")
    if local:
        _ffi.EXT.local_initialize([g.local_hardware_id for g in gpus], [g.id for g in gpus],
                                  buffer_bytes, low_latency_bytes)
        _state.update(platform="gpus", rank=0, num_ranks=len(gpus))
    elif gpus:
        # One GPU per process: PE p is process p's GPU (the EP groups name devices by id).
        device_of_pe = [d.id for d in sorted(jax.devices(), key=lambda d: d.process_index)]
        if len(device_of_pe) != num_ranks:
            raise RuntimeError(f"{op}: {len(device_of_pe)} GPUs in {num_ranks} processes; "
                               f"NVSHMEM allows one GPU per process.")
        unique_id = _share_unique_id(op, rank, num_ranks, _ffi.EXT)
        _ffi.EXT.runtime_initialize(unique_id, rank, num_ranks, gpus[0].local_hardware_id,
                                    buffer_bytes, low_latency_bytes, access == "put", nodes,
                                    device_of_pe, node_of_pe)
        _state.update(platform="gpu", rank=rank, num_ranks=num_ranks)
    else:
        _ffi.EXT.host_peers_initialize(buffer_bytes, low_latency_bytes, access == "put", nodes)
        _state.update(platform="cpu", rank=rank, num_ranks=jax.local_device_count())
    _state.update(buffer_bytes=buffer_bytes, low_latency_bytes=low_latency_bytes,
                  peer_access=access, ranks_per_node=nodes, channels=rings)
    _resolved.update(device_kind=kind, channels_from=rings_from)


def _check_host_threads(op: str, rings: Channels) -> None:
    """On CPU devices the host peers run every warp of a streaming launch on a thread of its
    own (its warps wait for each other): refuses channels whose launch would need more than
    the extension allows (per channel the `warps` senders and receivers, one of each on the
    default one-warp grid, and, node-aware, the relay's forwarders; a GPU-shaped
    $JAX_EP_CPU_GRID has more per channel, and its launch refuses what passes this)."""
    from jax_ep import _ffi

    warps = 2 * max(rings.warps, 1) + _ffi.EXT.kernel_parameters()["forwarders"]
    most = _ffi.EXT.host_max_units // warps
    if rings.channels > most:
        raise ValueError(
            f"{op}: {rings.channels} channels stream through {warps} warps each, and the "
            f"host peers of CPU devices run each warp of a launch on a "
            f"thread of its own, at most {_ffi.EXT.host_max_units} per launch: give "
            f"Channels.channels (or $JAX_EP_CHANNELS) at most {most}.")


def _memory_per_rank(gpus: Sequence) -> tuple[int, str]:
    """What one rank's symmetric buffer must fit in, in bytes, and its name: the GPU's
    memory, or on CPU devices this host's share per rank (the host peers hold every rank's
    buffer in this process); TOO_LARGE where unknown."""
    from jax_ep import _ffi

    if gpus:
        total = _ffi.EXT.device_memory_bytes(gpus[0].local_hardware_id) or 0
        if not total:
            return TOO_LARGE, f"any buffer ({TOO_LARGE} bytes)"
        return total, f"the {total / 2**30:.1f} GiB of GPU {gpus[0].local_hardware_id}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks = jax.local_device_count()
    return total // ranks, (f"1/{ranks} of this host's {total / 2**30:.1f} GiB (the host "
                            f"peers hold the buffer of each of its {ranks} CPU devices)")


# The settings `_unfitting` tries alone: (name, where it lives, smallest value, step).
_SIZE_SETTINGS = (("num_tokens", "config", 1, 1), ("hidden", "config", 128, 128),
                  ("top_k", "config", 1, 1), ("capacity", "config", 1, 1),
                  ("low_latency_tokens", "config", 0, 1), ("channels", "rings", 1, 1),
                  ("chunk_tokens", "rings", 1, 1), ("ring_chunks", "rings", 1, 1))


def _unfitting(op: str, config: BufferConfig, access: str, nodes: int,
               regions: dict[str, int], memory: int, what: str) -> str:
    """The error of a config whose buffer is larger than `memory`: its regions, and the
    largest value of each setting that alone would make it fit (`config.channels`: the rings
    in effect, $JAX_EP_CHANNELS resolved)."""
    def with_value(name: str, where: str, value: int) -> BufferConfig:
        if where == "rings":
            return dataclasses.replace(config, channels=dataclasses.replace(
                config.channels, **{name: value}))
        return dataclasses.replace(config, **{name: value})

    def fits(name: str, where: str, value: int) -> bool:
        changed = with_value(name, where, value)  # its channels, whatever $JAX_EP_CHANNELS says
        carved = _carved(changed, access, nodes, changed.channels)
        return sum(carved[region] for region in REGIONS) <= memory

    fixes = []
    for name, where, low, step in _SIZE_SETTINGS:
        owner = config.channels if where == "rings" else config
        value = getattr(owner, name) if owner is not None else None
        if value is None or value <= low or not fits(name, where, low):
            continue
        good, bad = 0, (value - low) // step  # steps above low: good fits, bad does not
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if fits(name, where, low + mid * step) else (good, mid)
        label = f"Channels.{name}" if where == "rings" else f"BufferConfig.{name}"
        fixes.append(f"{label} <= {low + good * step} (it is {value})")

    def size(n: int) -> str:
        return "more than 2^60 bytes" if n >= TOO_LARGE else f"{n} bytes"

    parts = ", ".join(f"{name} {size(regions[name])}" for name in ("normal", "low_latency"))
    fix = ("any one of these makes it fit: " + "; ".join(fixes)) if fixes else \
        "no one setting alone makes it fit: lower several"
    return (f"{op}: {config} needs {size(sum(regions.values()))} per rank ({parts}), more "
            f"than {what} ({memory} bytes); {fix}.")


def gpu_platform(num_gpus: int, num_processes: int, access: str, nodes: int) -> str:
    """How the GPUs this process sees exchange: "none" (no GPU: host peers), "nvshmem" (one
    GPU per process, through NVSHMEM) or "local" (several GPUs of one process, through CUDA
    peer access); RuntimeError for what neither serves."""
    op = "jax_ep.initialize"
    if num_gpus <= 1:
        return "nvshmem" if num_gpus else "none"
    if num_processes > 1:
        raise RuntimeError(
            f"{op}: {num_processes} processes with {num_gpus} GPUs in this one: the GPUs of "
            f"one process reach each other through CUDA peer access, processes through "
            f"NVSHMEM with one GPU each, and the two do not combine. Start one process per GPU "
            f"(jax.distributed.initialize(..., local_device_ids=[i])), or one process for the "
            f"GPUs of a single node.")
    if access == "put" or nodes:
        raise RuntimeError(
            f"{op}: the {num_gpus} GPUs of this process reach each other with loads and "
            f"stores (CUDA peer access, one node); $JAX_EP_PEER_ACCESS=put and "
            f"$JAX_EP_RANKS_PER_NODE need one process per GPU.")
    return "local"


def _share_unique_id(op: str, rank: int, num_ranks: int, ext) -> bytes:
    """Process 0's NVSHMEM unique id, through the jax.distributed key-value store."""
    if num_ranks == 1:
        return ext.nvshmem_unique_id()
    key = f"jax_ep/nvshmem_unique_id/{next(_generation)}"
    client = _client(op, num_ranks)
    if rank == 0:
        unique_id = ext.nvshmem_unique_id()
        client.key_value_set_bytes(key, unique_id)
        return unique_id
    return client.blocking_key_value_get_bytes(key, KEY_TIMEOUT_MS)


def _share(op: str, name: str, value: bytes, rank: int, num_ranks: int) -> list[str]:
    """Every process's `value`, in process order, through the jax.distributed key-value store."""
    client = _client(op, num_ranks)
    prefix = f"jax_ep/{name}/{next(_generation)}"
    client.key_value_set_bytes(f"{prefix}/{rank}", value)
    return [client.blocking_key_value_get_bytes(f"{prefix}/{r}", KEY_TIMEOUT_MS).decode()
            for r in range(num_ranks)]


def _client(op: str, num_ranks: int):
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(f"{op}: {num_ranks} processes but no jax.distributed client; call "
                           f"jax.distributed.initialize() first.")
    return client


def finalize() -> None:
    """Releases what `initialize()` set up (collective); clears JAX's caches first (they hold
    executables that reference the buffer). A no-op when not initialized."""
    if not _state:
        return
    from jax_ep import _ffi

    _exchange_order.wait_and_forget()
    jax.clear_caches()

    platform = _state.get("platform")
    _state.clear()
    _resolved.clear()
    if platform == "gpu":
        _ffi.EXT.runtime_finalize()
    elif platform == "gpus":
        _ffi.EXT.local_finalize()
    else:
        _ffi.EXT.host_peers_finalize()


EXIT_TIMEOUT_S = 10.0


def _finalize_at_exit(timeout_s: float | None = None) -> bool:
    """`finalize()` at interpreter exit, given up after `timeout_s` ($JAX_EP_EXIT_TIMEOUT_S,
    default 10 s): between GPUs it is collective, and a peer that died (or exits without
    finalizing) would hang the survivors' exit forever. Returns whether it finished."""
    if not _state:
        return True
    if timeout_s is None:
        try:
            timeout_s = env_seconds("JAX_EP_EXIT_TIMEOUT_S") or EXIT_TIMEOUT_S
        except ValueError as error:  # set after initialize(), which checks it
            print(f"jax_ep: {error} Using {EXIT_TIMEOUT_S:g} s.", file=sys.stderr)
            timeout_s = EXIT_TIMEOUT_S
    errors: list[BaseException] = []

    def run():
        try:
            finalize()
        except BaseException as error:  # reported below, never raised at exit
            errors.append(error)

    worker = threading.Thread(target=run, name="jax_ep.finalize", daemon=True)
    try:
        worker.start()
    except RuntimeError:  # Python 3.12 starts no thread at exit
        return _finalize_watched(timeout_s)
    worker.join(timeout_s)
    if worker.is_alive():
        print(f"jax_ep: finalize() did not finish within {timeout_s:g} s at exit (a peer "
              f"process gone?); exiting without it", file=sys.stderr)
        return False
    if errors:
        print(f"jax_ep: finalize() at exit failed: {errors[0]}", file=sys.stderr)
    return not errors


def _finalize_watched(timeout_s: float) -> bool:
    """`finalize()` on this thread, watched by faulthandler's watchdog (a thread of C, which
    Python 3.12 still starts at exit where it refuses Python's): past `timeout_s` it prints
    where the process waits and ends it with status 1."""
    import faulthandler

    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        finalize()
    except BaseException as error:  # reported, never raised at exit
        print(f"jax_ep: finalize() at exit failed: {error}", file=sys.stderr)
        return False
    finally:
        faulthandler.cancel_dump_traceback_later()
    return True


def _at_exit() -> None:
    """At interpreter exit: `finalize()`, and a failed exchange ends the process with status
    1. An exchange's error lives in its program's results and token, so a program that never
    reads them (it prints a shape, or returns) would otherwise exit 0 with the error printed
    only by JAX's own exit handlers. `jax_ep.initialize()` and `finalize()` forget a failure
    (a program that handled one and started again exits normally)."""
    failure = _exchange_order.failure()
    _finalize_at_exit()
    if failure is not None:
        print(f"jax_ep: an exchange failed, so the process exits with status 1: {failure}",
              file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the only way to set the status at exit; JAX would report it again


atexit.register(_at_exit)
