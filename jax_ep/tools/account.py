"""What each exchange op of the "cuda" backend does on the GPU, counted from its kernel plan.

For a routing and the op's shapes, an `Account` gives:

- launches: kernels on each rank's stream. Between GPUs the launches meet their peers inside
  (cuda/peer_ops.h, Meet), so every launch of an op runs, even one with no items;
- barriers: waits of every rank for every other inside those launches, per rank (between
  GPUs; with virtual ranks a launch boundary orders the phases and no rank waits for
  another);
- read, written: bytes of row data (token rows, FP8 scales, partial sums) read and written,
  all ranks together. Bookkeeping (ids, weights, counters, offsets) is left out: a few bytes
  per row next to kilobytes;
- warps: the warps of work in the op's smallest launch (one per item of a phase; each rank's
  launch between devices, every rank's with virtual ranks): what a GPU has to spread over its
  SMs, which a launch with fewer than a few warps per SM cannot fill;
- minimum: the bytes of row data any design must move: every source row that carries data
  read once and every delivered row written once; combine reads each row that carries data
  once (expert-major, each entry's) and writes every output row. Between devices each
  delivered row also passes once through the symmetric buffer (one more write and read),
  because a peer cannot write or read the buffers XLA owns; in combine that is one row per
  token and receiver (expert-major, the sum of the receiver's entries of the token).

Between devices the peers are reached with stores or, with `puts` ($JAX_EP_PEER_ACCESS=put,
as between nodes), with puts only: each send first copies what it sends into the symmetric
buffer (a put's source must lie there), one more launch, and the normal combine's receivers
put their rows into the homes' buffers instead of the homes reading them.

Between devices the rank-major normal ops may also stream through rings (`channels`, a
runtime.Channels; cuda/channels.h): their launches, bytes and, over puts, messages (one put
per chunk and stream with its signal, a head back per chunk) are counted as well.

The plan is the sequence of cuda/peer_ops.h (between devices) and cuda/virtual_ops.h (virtual
ranks) with the byte counts of the phase bodies in cuda/exchange.h (and the streaming bodies
of cuda/dispatch_stream.h and cuda/combine_stream.h). The same code runs on the
CPU, where it counts what it does (cuda/meter.h, `jax_ep._ext.meter`); tests/test_account.py
checks that the two agree on random routings, so the account describes the code as it is.

Run `python -m jax_ep.tools.account` for the account at DeepSeek's shapes (docs/cuda.md).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

import numpy as np

from jax_ep import quant, runtime
from jax_ep.dispatch import DEFAULT_NUM_SMS, default_capacity
from jax_ep.fp8 import BLOCK

SCALE_BYTES = 4  # one float32 scale per BLOCK channels


@dataclasses.dataclass(frozen=True)
class Account:
    """What one op (or one half of a split op) does; see the module docstring."""

    op: str
    launches: int
    barriers: int
    read: int
    written: int
    minimum: int
    warps: int | None = None  # of the smallest launch; None: no launch
    # Of the smallest launch that moves row data (what bounds the op's copy rate); None: none.
    row_warps: int | None = None
    # Over puts: the puts and value puts of every rank (each a work request on a NIC); None
    # where the peers are reached with stores (or all ranks are in one call).
    messages: int | None = None
    # The bytes the row-moving launch's loads keep in flight where its warps keep other than
    # WORDS_IN_FLIGHT per lane (a streaming launch); None: row_warps x a phase warp's.
    flight_bytes: int | None = None

    @property
    def bytes(self) -> int:
        """Bytes of row data read plus written."""
        return self.read + self.written

    @property
    def ratio(self) -> float:
        """bytes / minimum (1.0: nothing moved that did not have to be)."""
        if self.minimum == 0:
            return 1.0 if self.bytes == 0 else float("inf")
        return self.bytes / self.minimum

    def __add__(self, other: Account) -> Account:
        """The two ops run one after the other (e.g. a send and its receive)."""
        def least(a, b):
            return min(a, b) if a is not None and b is not None else (a if b is None else b)

        row_warps = least(self.row_warps, other.row_warps)
        return Account(
            f"{self.op}+{other.op}",
            self.launches + other.launches,
            self.barriers + other.barriers,
            self.read + other.read,
            self.written + other.written,
            self.minimum + other.minimum,
            least(self.warps, other.warps),
            row_warps,
            None if self.messages is None or other.messages is None
            else self.messages + other.messages,
            (self if row_warps == self.row_warps else other).flight_bytes,
        )


# ---------------------------------------------------------------------------------------------
# The routing, in NumPy


def _clean(topk_idx: np.ndarray, num_experts: int) -> np.ndarray:
    idx = np.asarray(topk_idx)
    return np.where((idx >= 0) & (idx < num_experts), idx, -1)


def kept_rows(topk_idx: np.ndarray, num_experts: int, capacity: int) -> np.ndarray:
    """bool [R(source), T, R(dest)]: token t of s is a kept rank-major row on d (rows of d
    ordered by source rank, then token; the first `capacity` kept)."""
    ids = _clean(topk_idx, num_experts)
    R = ids.shape[0]
    dest = np.where(ids >= 0, ids // (num_experts // R), -1)
    goes = (dest[..., None] == np.arange(R)).any(axis=2)  # [R, T, R]
    position = np.cumsum(goes.reshape(-1, R), axis=0).reshape(goes.shape) - 1
    return goes & (position < capacity)


def kept_entries(topk_idx: np.ndarray, num_experts: int, capacity: int) -> np.ndarray:
    """bool [R, T, K]: choice k of token t of s is a kept expert-major entry (entries of a rank
    ordered by local expert, then source rank, token and choice; the first `capacity` kept)."""
    ids = _clean(topk_idx, num_experts)
    R, T, K = ids.shape
    order = np.arange(R * T * K).reshape(R, T, K)
    key = np.where(ids >= 0, ids.astype(np.int64) * R * T * K + order, -1).ravel()
    rank_of = np.where(ids >= 0, ids // (num_experts // R), -1).ravel()
    kept = np.zeros(ids.size, bool)
    for d in range(R):
        mine = np.flatnonzero(rank_of == d)
        kept[mine[np.argsort(key[mine])[:capacity]]] = True
    return kept.reshape(R, T, K)


def messages(topk_idx: np.ndarray, num_experts: int) -> np.ndarray:
    """bool [R, T, K]: choice k is a low-latency message (valid, the first of its expert)."""
    ids = _clean(topk_idx, num_experts)
    K = ids.shape[2]
    first = np.ones(ids.shape, bool)
    for k in range(1, K):
        first[..., k] = ~(ids[..., :k] == ids[..., k : k + 1]).any(axis=-1)
    return (ids >= 0) & first


# Destinations a source row is written to per read of it (cuda/primitives.h, kFanOut).
FAN_OUT = 8
FORWARDERS = runtime.FORWARDERS  # node-aware forwarder warps per channel


def _stream_plan(op: str, channels, num_ranks: int, ranks_per_node: int,
                 warps: int | None, num_sms: int | None) -> runtime.StreamPlan:
    """The streaming launch of `op`: runtime.stream_plan's channels (a GPU's, which the CPU's
    host peers stream through too), with `warps` per role where they run other than a GPU's
    (the CPU grid's; at most what a role splits)."""
    plan = runtime.stream_plan(op, channels, num_ranks, ranks_per_node=ranks_per_node,
                               num_sms=num_sms)
    if warps is None:
        return plan
    ran = runtime.stream_plan(op, dataclasses.replace(channels, warps=warps), num_ranks,
                              ranks_per_node=ranks_per_node)
    return dataclasses.replace(ran, channels=plan.channels)


def _fan_out_reads(destinations: np.ndarray) -> int:
    """Reads of source rows with these numbers of destinations each."""
    return int((-(-np.asarray(destinations) // FAN_OUT)).sum())


def _round16(n: int) -> int:
    """n bytes rounded up to a multiple of 16 (the slots of cuda/exchange.h and channels.h)."""
    return -(-n // 16) * 16


def _check_puts(puts: bool, between: bool) -> None:
    if puts and not between:
        raise ValueError("puts=True describes ranks on separate devices: pass between=True "
                         "as well (virtual ranks reach each other in one memory).")


def _launch(*items: int) -> int:
    """Launches of phases with these item counts (an empty phase launches nothing)."""
    return sum(1 for n in items if n > 0)


def _smallest(ranks: int, *items: int, always: int = 0) -> int | None:
    """Warps of work in the smallest of the launches of phases with these item counts per
    rank, run for `ranks` ranks at once: the first `always` launch even without items (a tail
    or a meeting), the others only with some."""
    work = [ranks * n for i, n in enumerate(items) if i < always or n > 0]
    return min(work) if work else None


LL_WARPS = 1024  # cuda/exchange.h kLlWarps


def ll_finish_items(num_ranks: int, num_tokens: int, top_k: int, num_experts: int) -> int:
    """Items of the low-latency receive per receiver (cuda/low_latency.h, ll_finish_items):
    W warps per (local expert, source) pair, W about twice the messages a pair gets on average
    (T*K / E), at least 1, at most T; then one per 32 tokens of the group (src_row)."""
    pair_warps = min(num_tokens, max(1, -(-2 * num_tokens * top_k // num_experts)))
    return num_experts * pair_warps + -(-num_ranks * num_tokens // 32)


def ll_segments(num_tokens: int, hidden: int) -> int:
    """Column segments of a low-latency row, one warp each (cuda/low_latency.h,
    ll_segment_cols): whole 128-channel blocks, enough that num_tokens rows give LL_WARPS
    warps (a rank's tokens; the nvfp4 send's, those of its launch: an nvfp4 segment's warp also
    reads the whole row, for its global scale)."""
    if hidden % BLOCK or num_tokens <= 0:
        return 1
    blocks = hidden // BLOCK
    wanted = min(-(-LL_WARPS // num_tokens), blocks)
    cols = -(-blocks // wanted) * BLOCK
    return -(-hidden // cols)


SEND_COUNT_ENTRIES, MAX_TOP_K = 4096, 32  # cuda/exchange.h kSendCountEntries, kMaxTopK


def ll_counts_in_send(own_slots: bool, num_tokens: int, top_k: int) -> bool:
    """Whether the low-latency send numbers its own messages, with no count launch before it
    (cuda/exchange.h, ll_counts_in_send): its source's slots need no other source's counts
    (`own_slots`: between devices, or one rank) and its routing is short."""
    return own_slots and top_k <= MAX_TOP_K and num_tokens * top_k <= SEND_COUNT_ENTRIES


def count_chunks(num_tokens: int, top_k: int) -> int:
    """Items of a count phase: chunks of 2^s tokens, s = 9 - ceil(log2 K) (at least 0),
    about 512 entries each (cuda/exchange.h, count_chunks)."""
    shift = max(9 - max(top_k - 1, 0).bit_length(), 0)
    return -(-num_tokens // (1 << shift))


# ---------------------------------------------------------------------------------------------
# The ops


def dispatch(topk_idx: np.ndarray, *, num_experts: int, row_bytes: int, scale_bytes: int = 0,
             capacity: int | None = None, expert_major: bool = False, between: bool = False,
             zero_padding: bool = False, puts: bool = False, ranks_per_node: int = 0,
             channels=None, channel_warps: int | None = None,
            num_sms: int | None = DEFAULT_NUM_SMS, source_bytes: int | None = None,
            result_bytes: int | None = None) -> Account:
    """Normal dispatch of every rank's rows.

    Args:
      topk_idx: int [R, T, K], every rank's routing (ids outside [0, E) are masked).
      num_experts: E.
      row_bytes: bytes of one token row (H x the element size; H with FP8).
      scale_bytes: bytes of its FP8 scales (H / 128 x 4), 0 without FP8.
      capacity: rows (entries with `expert_major`) per receiver; None: the default.
      expert_major: the expert-major layout.
      between: one rank per device (else virtual ranks, all in one call).
      zero_padding: rows past the count are zeroed (the backward of combine).
      puts: between devices, peers reached with puts only.
      ranks_per_node: with puts, node-aware in nodes of this many ranks (0: one node).
      channels: a runtime.Channels: between devices, rank-major, streamed through rings
        (`_streamed_dispatch`); None: in phases.
      channel_warps: streamed, the warps per role per channel as they run (on the CPU the
        grid's); None: a GPU's (runtime.stream_plan).
      num_sms: streamed, the op's SM budget, which bounds its channels (runtime.stream_plan).
      source_bytes: the send casts each source row of these bytes (bfloat16, 2H) to the wire
        format of row_bytes and scale_bytes as it writes it (`jax_ep.dispatch(x,
        wire_format=)` on the cuda backend): its reads of source rows read these bytes, with
        no quantization pass before; None: the rows are read as they travel.
      result_bytes: between devices, the finish (streamed: the receivers) dequantizes each
        delivered row into XLA's result, a row of these bytes (bfloat16, 2H), and zeroes
        padding rows of that size (`jax_ep.dispatch(x, wire_format=)` on the cuda backend);
        None: XLA's rows are the rows as they travel.
    """
    _check_puts(puts, between)
    if result_bytes is not None and not between:
        raise ValueError("result_bytes describes the finish between devices: pass between=True.")
    R, T, K = np.shape(topk_idx)
    E = num_experts
    if capacity is None:
        capacity = default_capacity(R, T, K, E, expert_major)
    if ranks_per_node and not puts:
        raise ValueError("ranks_per_node describes nodes reached with puts: pass puts=True.")
    row = row_bytes + scale_bytes
    # A source row as the send (over puts, the stage) reads it: `extra` more bytes when cast.
    extra = 0 if source_bytes is None else source_bytes - row
    # [R, T, K] kept entries or [R, T, R] kept rows: each a destination of a source row.
    kept = (kept_entries if expert_major else kept_rows)(topk_idx, E, capacity)
    destinations = kept.sum(axis=2)
    delivered, sources = int(destinations.sum()), int((destinations > 0).sum())
    padding = R * capacity - delivered if zero_padding else 0
    # The send reads each source row once per FAN_OUT destinations and writes every one.
    read, written = _fan_out_reads(destinations) * (row + extra), (delivered + padding) * row
    minimum = sources * (row + extra) + delivered * row + padding * row
    # The count (always: its tail computes the totals and the bases), the send, the finish.
    chunks, finish = count_chunks(T, K), max(capacity, R * T, E // R)
    if not between:
        phases = 1 + _launch(T, finish)
        return Account("dispatch", phases, 0, read, written, minimum,
                       _smallest(R, chunks, T, finish, always=1),
                       _smallest(R, T, finish if padding else 0))
    # The finish phase copies the delivered rows (and the metadata) out of the symmetric buffer.
    # Waits: the count's for the peers' last op and for their counts, the finish's for the rows.
    landing = delivered * row
    # Dequantized, each row XLA gets (delivered or zeroed) is written as result_bytes.
    grow = 0 if result_bytes is None else (delivered + padding) * (result_bytes - row)

    def landed(a: Account) -> Account:
        return dataclasses.replace(a, written=a.written + grow, minimum=a.minimum + grow)

    moving = _smallest(1, T, finish)  # the send (and stage, relay), the finish
    # Between devices every launch meets the peers, so it runs, items or not. Over puts the
    # count puts each rank's row of R + E totals to every other rank, counted with the rows.
    totals = R * (R - 1) * (R + E) * 4 if puts else 0
    if channels is not None and not expert_major:
        nodes = ranks_per_node if puts else 0
        plan = _stream_plan("dispatch", channels, R, nodes, channel_warps, num_sms)
        return landed(_streamed_dispatch(kept, topk_idx, E, row_bytes, scale_bytes, plan,
                                         channels, puts, nodes, padding, minimum + 2 * landing,
                                         totals, chunks, finish, extra))
    if puts and 0 < ranks_per_node < R:
        # The count, the send, the relay (every token of every rank) and the finish meet the
        # peers; the stage does not (it runs with items only).
        aware = landed(_node_aware_dispatch(
            kept, topk_idx, E, expert_major, ranks_per_node, row,
            _message(row_bytes, scale_bytes, K, expert_major), padding, minimum, landing,
            _smallest(1, chunks, T, R * T, finish, T, always=4)))
        return dataclasses.replace(
            aware, read=aware.read + totals + R * T * extra, written=aware.written + totals,
            row_warps=moving,
            messages=_dispatch_messages(topk_idx, E, expert_major, kept, scale_bytes > 0,
                                        ranks_per_node))
    if puts:
        # The stage copies every token's row into the send area; the send puts one copy per
        # destination from there (rank-major, the row's packed slot).
        staged, message = R * T * row, _message(row_bytes, scale_bytes, K, expert_major)
        read = staged + R * T * extra + delivered * message + totals
        written = staged + delivered * message + padding * row + totals
        return landed(Account("dispatch", 4, 3, read + landing, written + landing,
                              minimum + 2 * landing, _smallest(1, chunks, T, finish, T, always=3),
                              moving, _dispatch_messages(topk_idx, E, expert_major, kept,
                                                         scale_bytes > 0)))
    return landed(Account("dispatch", 3, 3, read + landing, written + landing,
                          minimum + 2 * landing, _smallest(1, chunks, T, finish, always=3),
                          moving))


def dispatch_rows(topk_idx: np.ndarray, *, num_experts: int, row_bytes: int,
                  capacity: int | None = None, expert_major: bool = False,
                  between: bool = False, puts: bool = False, ranks_per_node: int = 0,
                  channels=None, channel_warps: int | None = None,
                  num_sms: int | None = DEFAULT_NUM_SMS) -> Account:
    """Rows along a dispatch's routing (`jax_ep.dispatch(x2, handle=h)`, combine's backward;
    cuda/dispatch_rows.h): every result slot (row, or entry expert-major) of each receiver
    pulls its source row or is zeroed, with no count. With virtual ranks one launch reads the
    rows where they are; between devices each rank stages its T rows in its symmetric buffer
    first (two launches, each meeting the peers). Over puts no peer can be read: the dispatch
    runs again (zero padding). The minimum: each source row read once (and, between devices,
    written once into the symmetric buffer and read once from there, per delivered row) and
    every slot written."""
    if puts:
        again = dispatch(topk_idx, num_experts=num_experts, row_bytes=row_bytes,
                         capacity=capacity, expert_major=expert_major, between=between,
                         zero_padding=True, puts=True, ranks_per_node=ranks_per_node,
                         channels=channels, channel_warps=channel_warps, num_sms=num_sms)
        return dataclasses.replace(again, op="dispatch_rows")
    R, T, K = np.shape(topk_idx)
    if capacity is None:
        capacity = default_capacity(R, T, K, num_experts, expert_major)
    kept = (kept_entries if expert_major else kept_rows)(topk_idx, num_experts, capacity)
    destinations = kept.sum(axis=2)
    delivered, sources = int(destinations.sum()), int((destinations > 0).sum())
    slots = R * capacity * row_bytes
    read, minimum = delivered * row_bytes, sources * row_bytes + slots
    if not between:
        warps = _smallest(R, capacity)
        return Account("dispatch_rows", _launch(capacity), 0, read, slots, minimum, warps, warps)
    staged = R * T * row_bytes
    warps = _smallest(1, T, capacity, always=2)
    return Account("dispatch_rows", 2, 2, read + staged, slots + staged,
                   minimum + sources * row_bytes + read, warps, warps)


def _dispatch_messages(topk_idx, num_experts, expert_major, kept, scales,
                       ranks_per_node=0) -> int:
    """Puts and value puts of a dispatch over puts, every rank's: the count puts its row of
    R + E totals to every other rank; rank-major, the send puts each delivered row as one
    message (its packed slot: the row, FP8 scales, source, ids and weights); expert-major, the
    stage puts each token's metadata into the receivers where it has a row, value by value
    (the row's source and unused entry slots, and each choice's entry and its place in the
    row), and the send puts each delivered row and its FP8 scales; src_row, the receiver
    finds. Node-aware, the send reaches the receivers of its own node so, and each other node
    once: its targets and, where it delivers there, its row."""
    ids = _clean(topk_idx, num_experts)
    R, T, K = ids.shape
    rank = np.where(ids >= 0, ids // (num_experts // R), -1)
    on = (rank[..., None] == np.arange(R)).sum(axis=2)  # [R, T, R]: choices on each rank
    counts = R * (R - 1)
    if expert_major:
        goes = on > 0
        metadata = int(goes.sum()) + int(np.where(goes, K - on, 0).sum())
        metadata += int((ids >= 0).sum()) + 4 * int(kept.sum())
        per_row = 2 if scales else 1
    else:  # packed: a row's scales and metadata travel in its message
        metadata, per_row = 0, 1
    if not 0 < ranks_per_node < R:
        return counts + metadata + per_row * int(kept.sum())
    own, other = _node_deliveries(kept, topk_idx, num_experts, expert_major, ranks_per_node)
    nodes = other.shape[-1]
    sends = per_row * int(own.sum()) + R * T * (nodes - 1) + per_row * int((other > 0).sum())
    return counts + metadata + sends


def _node_deliveries(kept, topk_idx, num_experts, expert_major, ranks_per_node):
    """Each token's deliveries (kept rows or entries) in nodes of `ranks_per_node` ranks:
    own [R, T] to its source's node, other [R, T, nodes] to each other node (0 at its own)."""
    R = np.shape(topk_idx)[0]
    if expert_major:  # deliveries of each token to each rank
        ids = _clean(topk_idx, num_experts)
        rank = np.where(kept, ids // (num_experts // R), -1)
        per_rank = (rank[..., None] == np.arange(R)).sum(axis=2)
    else:
        per_rank = kept.astype(np.int64)
    node = np.arange(R) // ranks_per_node
    nodes = int(node[-1]) + 1
    per_node = np.stack([per_rank[..., node == m].sum(axis=-1) for m in range(nodes)], -1)
    own = per_node[np.arange(R), :, node]
    other = per_node.copy()
    other[np.arange(R), :, node] = 0
    return own, other


def _message(row_bytes, scale_bytes, top_k, expert_major):
    """Bytes a dispatch over puts sends per delivered row: rank-major, the packed slot (the
    row padded to 16 bytes, its scales, the source, K ids and K weights, to a multiple of 16
    bytes; cuda/dispatch.h, packed_slot); expert-major, the row and scales (its metadata goes
    value by value)."""
    if expert_major:
        return row_bytes + scale_bytes
    return _round16(_round16(row_bytes) + scale_bytes + 4 * (1 + 2 * top_k))


def _node_aware_dispatch(kept, topk_idx, num_experts, expert_major, ranks_per_node, row,
                         message, padding, minimum, landing, warps) -> Account:
    """Dispatch over puts in nodes: the stage copies every token, the send puts it (its
    `message`) to each receiver of its own node and once to its relay in each other node it
    reaches, and the relay stores it into its targets there (reading it once per FAN_OUT). The
    targets, K (receiver, row) pairs per token and other node, travel as a put of their own and
    are counted with the rows."""
    R, T, K = np.shape(topk_idx)
    own, other = _node_deliveries(kept, topk_idx, num_experts, expert_major, ranks_per_node)
    nodes = other.shape[-1]
    relayed = int((other > 0).sum())
    staged, direct, stored = R * T * row, int(own.sum()) * message, int(other.sum()) * message
    targets = R * T * (nodes - 1) * K * 2 * 4
    sent = relayed * message + _fan_out_reads(other[other > 0]) * message
    read = staged + direct + sent + targets
    written = staged + direct + relayed * message + stored + padding * row + targets
    # Launches: count, stage, send, relay, finish; waits: the count's two, the relay's, the
    # finish's.
    return Account("dispatch", 5, 4, read + landing, written + landing, minimum + 2 * landing,
                   warps)


def _ring_streams(goes: np.ndarray, channels: int) -> np.ndarray:
    """Slots of each stream: goes [R, T, X] (token t of rank s has a slot for X = x), summed
    per (channel, s, x) over each rank's tokens split into `channels` ranges (cuda/channels.h,
    Rings::first_token)."""
    T = goes.shape[1]
    first = [c * T // channels for c in range(channels + 1)]
    return np.stack([goes[:, first[c]:first[c + 1]].sum(axis=1) for c in range(channels)])


def _stream_messages(slots: np.ndarray, chunk: int) -> int:
    """Messages of streams over puts with these numbers of slots: one put per chunk with its
    tail's signal and one that closes the stream (the rest, or the signal alone); back, the
    head once per chunk consumed and once for the rest (a head signal adds the slots consumed
    since the last: none is sent for none). A sender that waits for space has published every
    slot (a ring holds whole chunks and heads move by chunks), so waits add none."""
    slots = np.asarray(slots, np.int64)
    return int((slots // chunk + 1).sum() + (-(-slots // chunk)).sum())


def _streamed_dispatch(kept, topk_idx, num_experts, row_bytes, scale_bytes, plan, channels,
                       puts, ranks_per_node, padding, minimum, totals, chunks, finish,
                       extra=0) -> Account:
    """Rank-major dispatch between devices streamed through rings (cuda/dispatch_stream.h):
    the count, the streaming launch and the finish. A sender warp writes a token into each of
    its rings the token goes to (a slot: the row, its scales and metadata), reading the row
    once per FAN_OUT of them; the receiver copies each slot it receives into XLA's result.
    Over puts each slot also travels once from the send ring to the receiver's ring (the put
    reads and writes it whole). Node-aware, the ranks of a node are reached with stores, each
    other node through the relay ring to the token's relay there (a slot with its targets),
    whose forwarder copies it into the node ring of each target, reading it once per
    FAN_OUT. Every warp of the launch moves rows, STREAM_WORDS_IN_FLIGHT loads per lane.
    `extra`: bytes more in each of the senders' reads of a source row (a cast, `dispatch`)."""
    R, T, K = np.shape(topk_idx)
    row = row_bytes + scale_bytes
    S = scale_bytes // 4
    slot = _round16(_round16(row_bytes) + 4 * (S + 2 + 2 * K))  # the row padded to 16
    delivered = int(kept.sum())
    aware = 0 < ranks_per_node < R
    senders, C = plan.warps, plan.channels
    units = C * plan.per_channel
    # The slots of each token in the rings of its sender's destinations i (the ranks of its
    # node, then, node-aware, the other nodes); sender warp i % senders writes ring i.
    if aware:
        _, other = _node_deliveries(kept, topk_idx, num_experts, False, ranks_per_node)
        crosses = other > 0  # [R, T, nodes]: a slot in the relay ring to node m
        node = np.arange(R) // ranks_per_node
        direct = np.zeros((R, T, ranks_per_node), bool)
        for s in range(R):
            first = node[s] * ranks_per_node
            mine = kept[s, :, first:first + ranks_per_node]
            direct[s, :, :mine.shape[1]] = mine
        size = np.minimum(R - node * ranks_per_node, ranks_per_node)  # each source's node's
        warp_of = [np.concatenate([np.arange(ranks_per_node),
                                   size[s] + np.arange(crosses.shape[2])]) % senders
                   for s in range(R)]
        slots = np.concatenate([direct, crosses], axis=2)
    else:
        slots, warp_of = kept, [np.arange(R) % senders] * R
    reads = 0
    for s in range(R):
        per_warp = np.stack([slots[s][:, warp_of[s] == w].sum(axis=1) for w in range(senders)])
        reads += _fan_out_reads(per_warp)
    # The senders' copies, and the receivers' of each delivered row.
    read = reads * (row + extra) + delivered * row
    written = int(slots.sum()) * row + delivered * row
    messages = None
    if aware:
        relay_slot = _round16(_round16(row_bytes) + 4 * (S + 2 + 4 * K))  # and the targets
        relayed = int(crosses.sum())
        # Each relay slot's put; the forwarder's copies into its targets' node rings.
        read += relayed * relay_slot + _fan_out_reads(other[crosses]) * row
        written += relayed * relay_slot + int(other.sum()) * row
        streams = _ring_streams(crosses, C)  # [C, R, nodes]
        streams[:, np.arange(R), node] = -1  # no ring to its own node
        messages = R * (R - 1) + _stream_messages(streams[streams >= 0],
                                                  channels.chunk_tokens)
    elif puts:
        read, written = read + delivered * slot, written + delivered * slot
        messages = R * (R - 1) + _stream_messages(_ring_streams(kept, C),
                                                  channels.chunk_tokens)
    read += totals
    written += padding * row + totals
    # Waits: the count's for the peers' last op and for their counts.
    # The least parallel launch moving rows: the streaming one, or a zeroing finish.
    moving = _smallest(1, units, finish if padding else 0)
    return Account("dispatch", 3, 2, read, written, minimum,
                   _smallest(1, chunks, units, finish, always=3), moving, messages,
                   units * STREAM_WARP_FLIGHT if moving == units else None)


def _streamed_combine(held, row_bytes, plan, channels, puts, out, minimum,
                      carried) -> Account:
    """Rank-major combine between devices streamed through rings (cuda/combine_stream.h): a
    launch that zeroes the ring counters, then the streaming launch. A sender copies each row it
    holds into its home's ring (over puts its send ring, which a put then moves whole), with
    STREAM_WORDS_IN_FLIGHT loads per lane; the home's receiver reads each once in its sum
    (SUM_BATCH rows' loads in flight per lane) and writes every output row."""
    R = held.shape[0]
    rows = int(held.sum())
    slot = _round16(row_bytes) + 16  # the row padded to 16, its weight and token
    moved = rows * row_bytes + (rows * slot if puts else 0)
    read, written = moved + carried, moved + out
    C = plan.channels
    units = C * plan.per_channel
    messages = None
    if puts:
        messages = _stream_messages(_ring_streams(held, C), channels.chunk_tokens)
    flight = C * (plan.warps * STREAM_WARP_FLIGHT + SUM_BATCH * WORD_BYTES * LANES)
    return Account("combine", 2, 2, read, written, minimum,
                   _smallest(1, 2 * C * R, units, always=2), units, messages, flight)


def combine(topk_idx: np.ndarray, *, num_experts: int, row_bytes: int,
            capacity: int | None = None, expert_major: bool = False,
            between: bool = False, puts: bool = False, weighted: bool = False,
            channels=None, channel_warps: int | None = None,
            num_sms: int | None = DEFAULT_NUM_SMS, wire_format: str | None = None) -> Account:
    """Normal combine of the rows a dispatch with this routing delivered.

    Args:
      topk_idx, num_experts, capacity, expert_major, between, puts, channels, channel_warps,
      num_sms: as for `dispatch` (streamed: `_streamed_combine`).
      row_bytes: bytes of one row of y (H x the element size).
      weighted: combine with `topk_weights` (over puts, rank-major rows send theirs).
      wire_format: between devices, the rows travel home in this jax_ep.quant format
        (`combine(y, wire_format=)` of bfloat16 y on the cuda backend): each stage casts the
        float32 row it forms from its rows of y (reading them twice for nvfp4, once for the
        row's amax) and stages the format's bytes, which the sums read (the weights go
        with the cast).
    """
    _check_puts(puts, between)
    if wire_format is not None and not between:
        raise ValueError("wire_format describes a combine between devices: pass between=True.")
    R, T, K = np.shape(topk_idx)
    E = num_experts
    if capacity is None:
        capacity = default_capacity(R, T, K, E, expert_major)
    out = R * T * row_bytes  # every output row is written
    # The rows a home receives: one per token and receiver holding some of its choices.
    held = int(kept_rows(topk_idx, E, R * T if expert_major else capacity).sum())
    rows = held * row_bytes
    # The rows that carry data: those rows, or expert-major each kept entry's row.
    carried = (int(kept_entries(topk_idx, E, capacity).sum()) * row_bytes if expert_major
               else rows)
    if not between:
        # The sums read every carried row where it is (expert-major, summing each receiver's
        # entries on their own first).
        return Account("combine", _launch(T), 0, carried, out, carried + out, _smallest(R, T),
                       _smallest(R, T))
    # Each receiver stages the rows its homes read in the symmetric buffer: its rows of y
    # (rank-major) or one partial sum of its entries per row (expert-major). The stage goes
    # over every rank's tokens, the sums over this rank's.
    # A staged row: y's, or the wire format's.
    sent = row_bytes if wire_format is None else sum(quant.wire_bytes(wire_format,
                                                                      row_bytes // 2))
    cast_reads = 2 if wire_format == "nvfp4" else 1
    staged = held * sent
    read, written = carried * cast_reads + staged, staged + out
    minimum = carried + out + 2 * staged
    if channels is not None and not expert_major:
        plan = _stream_plan("combine", channels, R, 0, channel_warps, num_sms)
        return _streamed_combine(kept_rows(topk_idx, E, capacity), sent, plan, channels,
                                 puts, out, minimum, carried * cast_reads)
    warps = _smallest(1, R * T, T, always=2)
    if puts:
        # Each receiver puts every staged row into its home's buffer, where the sums read
        # them: a launch between the stage and the sums. Messages: for every (receiver,
        # token) the row it holds or -1, and each row with (rank-major, weighted, not cast)
        # its weight.
        weights = weighted and not expert_major and wire_format is None
        messages = R * R * T + held * (2 if weights else 1)
        return Account("combine", 3, 2, read + staged, written + staged, minimum, warps, warps,
                       messages)
    # The stage and the sums, each waiting for the peers.
    return Account("combine", 2, 2, read, written, minimum, warps, warps)


def low_latency_dispatch(topk_idx: np.ndarray, *, num_experts: int, hidden: int,
                         wire: str = "bf16", between: bool = False,
                         puts: bool = False) -> tuple[Account, Account]:
    """Low-latency dispatch of bfloat16 tokens: (the send, the receive).

    Args:
      topk_idx: int [R, T, K], every rank's routing.
      num_experts: E.
      hidden: H.
      wire: "bf16", or the jax_ep.quant format the send casts to (quant.wire_bytes per
        message; an nvfp4 cast of a segment also reads the whole row, for its amax).
      between: one rank per device (else virtual ranks).
      puts: between devices, peers reached with puts only.
    """
    _check_puts(puts, between)
    R, T, K = np.shape(topk_idx)
    E, H = num_experts, hidden
    sent = messages(topk_idx, E)
    m, sources = int(sent.sum()), int(sent.any(axis=2).sum())
    message = 2 * H if wire == "bf16" else sum(quant.wire_bytes(wire, H))
    # The nvfp4 send cuts the rows of its launch (every rank's with virtual ranks), each
    # segment also reading its row for the amax (LowLatencyArgs::send_cut_rows).
    segments = ll_segments(T * (R if wire == "nvfp4" and not between else 1), H)
    cast_reads = 1 + segments if wire == "nvfp4" else 1
    # The send reads each token once per FAN_OUT messages and writes each into its slot. Its
    # items: every segment of every token (ll_segments), then, where it numbers its messages
    # itself (no count launch before it), E + 1 that count them.
    read = _fan_out_reads(sent.sum(axis=2)) * 2 * H * cast_reads
    written = m * message
    minimum = sources * 2 * H + m * message
    rows = T * segments
    own_count = ll_counts_in_send(between or R == 1, T, K)
    # The count launch, where there is one: it always runs (its tail publishes the counts).
    counted = [] if own_count else [count_chunks(T, K)]
    sends = rows + (E + 1 if own_count else 0)
    if not between:
        # Every rank here: the send delivers (the receive has nothing to do).
        return (Account("ll_dispatch_send", len(counted) + _launch(sends), 0, read, written,
                        minimum, _smallest(R, *counted, sends, always=len(counted)),
                        _smallest(R, rows)),
                Account("ll_dispatch_recv", 0, 0, 0, 0, 0))
    # Between devices, the launch that first publishes to the peers (the count, or the send)
    # waits for them to be done with the last op's data, and the send tells them it is done.
    # Over puts a stage first writes every token once into the send area (cast to FP8 there),
    # and the send puts each message from there.
    staged = [rows] if puts and rows else []
    if puts:
        read = R * T * 2 * H * cast_reads + m * message
        written = R * T * message + m * message
        # The tail of the count (or of the send, where it counts) puts each rank's row of E
        # totals to every other rank.
        read, written = read + R * (R - 1) * E * 4, written + R * (R - 1) * E * 4
    items = [*counted, *staged, sends]
    # Over puts: each source puts its row of E totals to every other rank, each token's R*K
    # src_row cells, and each message segment by segment (its data, then its other bytes).
    puts_sent = None
    if puts:
        puts_sent = R * (R - 1) + R * T * R * K + m * segments * (1 if wire == "bf16" else 2)
    send = Account("ll_dispatch_send", len(items), 1, read, written, minimum,
                   _smallest(1, *items, always=len(items)), _smallest(1, rows), puts_sent)
    landing = m * message  # the receive copies the counted rows out of the symmetric buffer
    finish = ll_finish_items(R, T, K, E)
    recv = Account("ll_dispatch_recv", 1, 1, landing, landing, 2 * landing,
                   _smallest(1, finish, always=1), _smallest(1, finish), 0 if puts else None)
    return send, recv



def low_latency_combine(topk_idx: np.ndarray, *, num_experts: int, hidden: int,
                        between: bool = False, puts: bool = False) -> tuple[Account, Account]:
    """Low-latency combine of the bfloat16 slots of a dispatch with this routing: (the send,
    the receive). Arguments as for `low_latency_dispatch`."""
    _check_puts(puts, between)
    R, T, K = np.shape(topk_idx)
    row = 2 * hidden
    sums = T * ll_segments(T, hidden)  # the receive's items per rank
    choices = int((_clean(topk_idx, num_experts) >= 0).sum())
    m = int(messages(topk_idx, num_experts).sum())
    out = R * T * row
    if not between:
        # No send: the receive reads each choice's row where the expert wrote it.
        return (Account("ll_combine_send", 0, 0, 0, 0, 0),
                Account("ll_combine_recv", _launch(T), 0, choices * row, out, m * row + out,
                        _smallest(R, sums), _smallest(R, sums)))
    # The send returns one row per choice to the home's symmetric buffer, where the receive
    # reads and sums them: the bytes that must move pass through it. Its items: every rank's
    # tokens; the receive's: this rank's.
    send = Account("ll_combine_send", 1, 1, choices * row, choices * row, 2 * m * row,
                   _smallest(1, R * T, always=1), _smallest(1, R * T))
    if puts:  # the stage copies each returned row into the send area, a put per choice
        send = Account("ll_combine_send", 2, 1, 2 * choices * row, 2 * choices * row,
                       2 * m * row, _smallest(1, R * T, R * T, always=1), _smallest(1, R * T),
                       choices)
    recv = Account("ll_combine_recv", 1, 1, choices * row, out, m * row + out,
                   _smallest(1, sums, always=1), _smallest(1, sums), 0 if puts else None)
    return send, recv


# ---------------------------------------------------------------------------------------------
# Targets and the table


# The targets of the kernels' design (docs/cuda.md, "The account"): bytes moved per byte that
# must move, launches per rank's stream, and warps of work in every launch: an H100's SMs
# each hold a few warps at once, so a launch fills the GPU with at least 4 per SM.
BYTES_TARGET = 1.05
LAUNCH_TARGETS = {"dispatch": 3, "dispatch_rows": 1, "combine": 2, "ll_dispatch_send": 2,
                  "ll_dispatch_recv": 2, "ll_combine_send": 2, "ll_combine_recv": 2}
H100_SMS = 132
WARPS_TARGET = 4 * H100_SMS

# Bytes in flight (docs/cuda.md, "The account"): a launch copies rows at most at the bytes its
# loads keep in flight over a load's latency (Little's law). Each lane of a warp that moves
# rows keeps WORDS_IN_FLIGHT loads of WORD_BYTES in flight (cuda/primitives.h), and a launch
# holds at most num_sms x COPY_BLOCKS_PER_SM blocks of PHASE_WARPS warps at once (cuda/phases.cuh;
# the copy kernels' occupancy on Hopper, cuda/phase_functors.h). tests/test_account.py checks
# these against the kernels' (jax_ep._ext.kernel_parameters()).
WORDS_IN_FLIGHT, WORD_BYTES, LANES = 4, 16, 32
PHASE_WARPS, COPY_BLOCKS_PER_SM = 8, 4
# A streaming launch's copies keep STREAM_WORDS_IN_FLIGHT loads per lane (its warps are
# planned to fit the op's num_sms, runtime.stream_plan); the combine's ordered sums, SUM_BATCH
# rows' (cuda/sums.h, kSumBatch).
STREAM_WORDS_IN_FLIGHT, SUM_BATCH = 8, 4
STREAM_WARP_FLIGHT = STREAM_WORDS_IN_FLIGHT * WORD_BYTES * LANES
# A load's latency and the rate a copy must reach: from HBM on the GPU itself (virtual ranks),
# from a peer over NVLink (between GPUs), on an H100; a launch's bound should exceed the rate
# by FLIGHT_TARGET, so that bytes in flight never limit it.
HBM_LATENCY_S, NVLINK_LATENCY_S = 1e-6, 2e-6
H100_COPY_BPS, NVLINK_BPS = 3.35e12, 450e9
FLIGHT_TARGET = 1.2


@dataclasses.dataclass(frozen=True)
class Flight:
    """The bytes in flight of an op's least parallel launch that moves rows, and the copy
    rate they bound."""

    warps: int         # warps of that launch moving rows at once
    bytes: int         # their loads in flight
    latency_s: float   # a load's latency on the op's link
    link_bps: float    # the rate the op must reach there

    @property
    def bound_bps(self) -> float:
        """Little's law: bytes in flight / latency."""
        return self.bytes / self.latency_s

    @property
    def meets(self) -> bool:
        return self.bound_bps >= FLIGHT_TARGET * self.link_bps


def flight(a: Account, between: bool, num_sms: int | None = None) -> Flight | None:
    """The bytes in flight of account `a`'s least parallel row-moving launch (its row_warps,
    at most what num_sms SMs hold at once) and the link its rows cross: between GPUs NVLink
    (the sends write peers; the conservative one for the local copies too), else HBM.
    num_sms: the op's SM budget; None, its default (jax_ep.DEFAULT_NUM_SMS for the normal ops
    between GPUs, every SM for the low-latency ops and virtual ranks). A streaming launch
    (flight_bytes) was planned for the budget its account was made with."""
    if a.row_warps is None:
        return None
    latency, link = (NVLINK_LATENCY_S, NVLINK_BPS) if between else (HBM_LATENCY_S, H100_COPY_BPS)
    if a.flight_bytes is not None:
        return Flight(a.row_warps, a.flight_bytes, latency, link)
    if num_sms is None:
        num_sms = DEFAULT_NUM_SMS if between and not a.op.startswith("ll_") else H100_SMS
    warps = min(a.row_warps, num_sms * COPY_BLOCKS_PER_SM * PHASE_WARPS)
    return Flight(warps, warps * LANES * WORDS_IN_FLIGHT * WORD_BYTES, latency, link)


# Why the rows that miss a target at DeepSeek's shapes do (see "The account" in docs/cuda.md).
EXPECTED = {
    "dispatch": "warps: the count goes by chunks of about 512 entries (64 tokens at top-8), "
    "one warp each, so its launch has T/64 warps per rank",
    "combine": "warps: the sums give each of a rank's tokens one warp, T per rank: fewer "
    "than 528 tokens per rank cannot fill an H100",
    "ll": "warps: with virtual ranks the low-latency count gives each chunk of 64 tokens one "
    "warp, 2 per rank at T = 128: a rank's slots follow every lower rank's messages, which "
    "only a count before the send knows (between devices, and with one rank, the send numbers "
    "its own messages and fills the GPU: 1,024 warps per rank for the rows)",
    "dispatch_rows": "launches: between devices a peer cannot read the buffers XLA owns, so "
    "each rank stages its rows in its symmetric buffer first and meets its peers, then the "
    "receivers pull (2 launches, no count; the dispatch itself takes 3 with its count); with "
    "virtual ranks one launch. Bytes: with virtual ranks a receiver reads each of its rows "
    "where it is, a source row once per destination (the dispatch's send reads it once per 8)",
    "nvfp4": "bytes: an nvfp4 row's global scale needs the whole row's amax, so each of its "
    "segments' warps reads the whole row for it before casting its segment: between devices "
    "at T 128, 8 segments, 9 reads of the row (local) for 1,024 warps per rank, where one "
    "warp per row had 128; with virtual ranks the launch's R x T rows fill the GPU uncut (2 "
    "reads; their bytes in flight bound 0.63 x HBM, where 2 segments would read each row once "
    "more for about the same time)",
    "puts": "launches and bytes: over puts each send first copies what it sends into the "
    "symmetric buffer, where a put's source must lie (one launch and one copy more), and the "
    "normal combine's receivers return their rows into the homes' buffers",
    "streamed": "warps and bytes: a streaming launch fits the op's SM budget (the default "
    "20 SMs hold 320 warps: the dispatch's 40 channels of 4 senders and 4 receivers, the "
    "combine's 35 of 8 senders and a receiver), each warp streaming many rows with 8 loads in "
    "flight per lane; the dispatch's senders split a token's destinations, so a source row is "
    "read up to 4 times (local reads); over puts each slot is written into the send ring and "
    "put from there whole: a put reads only symmetric memory, and one put per chunk and "
    "destination needs the chunk's rows side by side there, so any design with one message "
    "per chunk moves these two row copies more per delivered row (against that floor, 1.00 x "
    "in one node); node-aware a relayed slot also lands in its relay's ring and is read from "
    "there by the forwarder (the price of crossing the network once per node, not per rank)",
}


def uniform_routing(rng: np.random.Generator, num_ranks: int, num_tokens: int, top_k: int,
                    num_experts: int) -> np.ndarray:
    """int32 [R, T, K]: each token's top_k distinct experts, uniformly at random."""
    scores = rng.random((num_ranks, num_tokens, num_experts))
    return np.argsort(scores, axis=-1)[..., :top_k].astype(np.int32)


def deepseek_accounts(num_ranks: int = 8, between: bool = False, seed: int = 0,
                      tokens: int = 4096, ll_tokens: int = 128, hidden: int = 7168,
                      top_k: int = 8, num_experts: int = 256, puts: bool = False,
                      ranks_per_node: int = 0, channels=None) -> list[Account]:
    """Every op's account at DeepSeek's shapes with a uniform random routing; between
    devices with `channels` (a runtime.Channels), the rank-major ops streamed too."""
    rng = np.random.default_rng(seed)
    idx = uniform_routing(rng, num_ranks, tokens, top_k, num_experts)
    ll_idx = uniform_routing(rng, num_ranks, ll_tokens, top_k, num_experts)
    fp8_row = dict(row_bytes=hidden, scale_bytes=hidden // BLOCK * SCALE_BYTES)
    where = dict(between=between, puts=puts)
    nodes = dict(ranks_per_node=ranks_per_node if puts else 0)
    accounts = [
        dispatch(idx, num_experts=num_experts, row_bytes=2 * hidden, **where, **nodes),
        dataclasses.replace(dispatch(idx, num_experts=num_experts, **where, **nodes, **fp8_row),
                            op="dispatch (fp8)"),
        combine(idx, num_experts=num_experts, row_bytes=2 * hidden, **where),
        dataclasses.replace(dispatch(idx, num_experts=num_experts, row_bytes=2 * hidden,
                                     expert_major=True, **where, **nodes),
                            op="dispatch (expert-major)"),
        dataclasses.replace(combine(idx, num_experts=num_experts, row_bytes=2 * hidden,
                                    expert_major=True, **where),
                            op="combine (expert-major)"),
        dispatch_rows(idx, num_experts=num_experts, row_bytes=2 * hidden, **where, **nodes),
    ]
    if between and channels is not None:
        rings = dict(channels=channels)
        accounts += [
            dataclasses.replace(dispatch(idx, num_experts=num_experts, row_bytes=2 * hidden,
                                         **where, **nodes, **rings), op="dispatch (streamed)"),
            dataclasses.replace(dispatch(idx, num_experts=num_experts, **where, **nodes,
                                         **fp8_row, **rings), op="dispatch (fp8, streamed)"),
            dataclasses.replace(combine(idx, num_experts=num_experts, row_bytes=2 * hidden,
                                        **where, **rings), op="combine (streamed)"),
        ]
    for wire in ("bf16", *quant.FORMATS):
        label = {"bf16": "", "e4m3": " (fp8)"}.get(wire, f" ({wire})")
        for a in low_latency_dispatch(ll_idx, num_experts=num_experts, hidden=hidden,
                                      wire=wire, **where):
            accounts.append(dataclasses.replace(a, op=a.op + label))
    accounts += low_latency_combine(ll_idx, num_experts=num_experts, hidden=hidden, **where)
    return accounts


def wire_formats(num_ranks: int = 8, between: bool = True, seed: int = 0, tokens: int = 4096,
                 hidden: int = 7168, top_k: int = 8, num_experts: int = 256
                 ) -> list[tuple[str, int, Account]]:
    """Rank-major dispatch at DeepSeek's shapes in bfloat16 and in every wire format of
    jax_ep.quant, whose send reads the bfloat16 rows and casts them and whose finish writes
    them dequantized (`dispatch(x, wire_format=)`): (format, bytes per token row as it
    travels, its account)."""
    idx = uniform_routing(np.random.default_rng(seed), num_ranks, tokens, top_k, num_experts)
    rows = [("bfloat16", 2 * hidden, 0)] + [(f, *quant.wire_bytes(f, hidden))
                                             for f in quant.FORMATS]
    fused = {f: dict(source_bytes=cast_source_bytes(f, hidden), result_bytes=2 * hidden)
             for f in quant.FORMATS}
    return [(name, data + rest,
             dispatch(idx, num_experts=num_experts, row_bytes=data, scale_bytes=rest,
                      between=between, **fused.get(name, {})))
            for name, data, rest in rows]


def cast_source_bytes(wire_format: str, hidden: int) -> int:
    """Bytes the normal dispatch's send reads each time it casts a bfloat16 row of `hidden`
    channels to `wire_format` (`dispatch`'s source_bytes): the row, and for nvfp4 the row
    once more before (its global scale needs the whole row's amax, cast_rows)."""
    return 2 * hidden * (2 if wire_format == "nvfp4" else 1)


def training_step(wire_format: str | None = None, num_ranks: int = 8, between: bool = True,
                  seed: int = 0, tokens: int = 4096, hidden: int = 7168, top_k: int = 8,
                  num_experts: int = 256, everywhere: bool = False) -> list[Account]:
    """One MoE layer's exchanges in a training step at DeepSeek's shapes, expert-major,
    bfloat16 except the forward dispatch's rows, which travel as `wire_format` (None:
    bfloat16): the four ops' accounts, the forward dispatch and combine, the combine's
    backward (rows along the handle) and the dispatch's (an unweighted combine). The cuda
    backend's dispatch of bfloat16 x quantizes in the send (it reads each source row in
    bfloat16) and dequantizes in the finish (it writes each received entry in bfloat16): no
    pass in XLA before or after. `everywhere`: the other three travel as `wire_format` too
    (`combine(wire_format=, grad_wire_format=)`, `dispatch(grad_wire_format=)`): the combines
    cast in their stages and dequantize in their sums, the combine's backward is the
    dispatch again with the casting send and the dequantizing unpack (zero padding)."""
    idx = uniform_routing(np.random.default_rng(seed), num_ranks, tokens, top_k, num_experts)
    kw = dict(num_experts=num_experts, expert_major=True, between=between)
    row = 2 * hidden
    data, rest = (row, 0) if wire_format is None else quant.wire_bytes(wire_format, hidden)
    fused = {} if wire_format is None else dict(
        source_bytes=cast_source_bytes(wire_format, hidden), result_bytes=row)
    cast = everywhere and wire_format is not None
    combines = dict(wire_format=wire_format) if cast else {}
    back = (dispatch(idx, row_bytes=data, scale_bytes=rest, zero_padding=True, **fused, **kw)
            if cast else dispatch_rows(idx, row_bytes=row, **kw))
    ops = [dispatch(idx, row_bytes=data, scale_bytes=rest, **fused, **kw),
           combine(idx, row_bytes=row, weighted=True, **combines, **kw), back,
           combine(idx, row_bytes=row, **combines, **kw)]
    return [dataclasses.replace(a, op=name) for a, name in zip(
        ops, ("dispatch", "combine", "combine backward", "dispatch backward"), strict=True)]


def meets(account: Account) -> tuple[bool, bool, bool]:
    """(bytes within BYTES_TARGET of the minimum, launches within the op's target, every
    launch with at least WARPS_TARGET warps of work)."""
    base = account.op.split(" ")[0]
    return (account.ratio <= BYTES_TARGET, account.launches <= LAUNCH_TARGETS[base],
            account.warps is None or account.warps >= WARPS_TARGET)


def table(accounts: Sequence[Account], ranks: int = 1, between: bool = False) -> str:
    """The accounts as a Markdown table; (over) and (under) mark a missed target; over puts,
    the messages per rank (of `ranks`); `between`: the ops run between GPUs (their bytes in
    flight bound NVLink copies, else HBM copies)."""
    lines = ["| op | launches | barriers | GB moved | GB minimum | moved / minimum | "
             "warps of the smallest launch | KB in flight | bound GB/s (x link) | "
             "puts per rank |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a in accounts:
        bytes_ok, launches_ok, warps_ok = meets(a)
        over = {True: "", False: " (over)"}
        warps = "-" if a.warps is None else f"{a.warps}{'' if warps_ok else ' (under)'}"
        f = flight(a, between)
        kb = "-" if f is None else f"{f.bytes / 1024:,.0f}"
        bound = "-" if f is None else (f"{f.bound_bps / 1e9:,.0f} "
                                       f"({f.bound_bps / f.link_bps:.2f})"
                                       + ("" if f.meets else " (under)"))
        puts = "-" if a.messages is None else f"{a.messages // ranks:,}"
        lines.append(
            f"| {a.op} | {a.launches}{over[launches_ok]} | {a.barriers} | "
            f"{a.bytes / 1e9:.3f} | {a.minimum / 1e9:.3f} | {a.ratio:.2f}{over[bytes_ok]} | "
            f"{warps} | {kb} | {bound} | {puts} |"
        )
    return "\n".join(lines)


def symmetric_bytes(num_ranks: int, tokens: int, ll_tokens: int, puts: bool,
                    ranks_per_node: int = 0, channels=None) -> dict[str, int] | None:
    """The symmetric buffer one rank needs at DeepSeek's shapes, rank-major: the regions of
    jax_ep.runtime.buffer_regions and the normal region's share of each op (dispatch,
    combine), in phases or streamed through `channels` (a runtime.Channels); None without the
    compiled extension."""
    from jax_ep import _ffi, runtime

    if _ffi.EXT is None:
        return None
    config = runtime.BufferConfig(num_tokens=tokens, num_ranks=num_ranks,
                                  low_latency_tokens=ll_tokens, channels=channels)
    where = dict(access="put" if puts else "store", nodes=ranks_per_node)
    return {**runtime.buffer_regions(config, **where),
            **runtime.normal_region_bytes(config, **where)}


def expected(accounts: Sequence[Account], puts: bool = False) -> list[str]:
    """Why the accounts that miss a target do, one line per reason (EXPECTED); `puts`: the
    accounts are over puts."""
    reasons = {}
    for a in accounts:
        bytes_ok, launches_ok, warps_ok = meets(a)
        keys = [] if warps_ok else ["ll" if a.op.startswith("ll_") else a.op.split()[0]]
        if not (bytes_ok and launches_ok):
            keys.append("puts" if puts else a.op)
        if "streamed" in a.op:
            keys = ["streamed"] if keys else []
        if "(nvfp4)" in a.op and not (warps_ok and bytes_ok):
            keys = ["nvfp4", *(k for k in keys if k == "puts" and not launches_ok)]
        for key in keys:
            reasons.setdefault(key, f"- {key}: {EXPECTED.get(key, 'not explained')}")
    return list(reasons.values())


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m jax_ep.tools.account",
        description="The cuda backend's account (launches, barriers, bytes of row data, the "
        "warps of work in each op's smallest launch, over puts the messages, and the symmetric "
        "buffer per rank) at DeepSeek's shapes, uniform routing: "
        "normal mode T 4096, low latency T 128; H 7168, top-8 of 256 experts. Needs no GPU.",
    )
    p.add_argument("--ranks", type=int, default=8, help="EP ranks (default 8)")
    p.add_argument("--tokens", type=int, default=4096,
                   help="T per rank of the normal-mode ops (default 4096)")
    p.add_argument("--ll-tokens", type=int, default=128,
                   help="T per rank of the low-latency ops (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="the table over puts node-aware, in nodes of this many ranks")
    args = p.parse_args(argv)
    if args.ranks_per_node < 0:
        p.error(f"--ranks-per-node {args.ranks_per_node}: a number of ranks, or 0 for one node.")
    if args.ranks < 1 or 256 % args.ranks:
        p.error(f"--ranks {args.ranks}: the ranks must divide the 256 experts; "
                "pick one of 1, 2, 4, ..., 256.")
    for flag in ("tokens", "ll_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: a positive number of "
                    "tokens per rank.")
    print(f"Shapes: R {args.ranks}; normal mode T {args.tokens}, low latency T "
          f"{args.ll_tokens}; H 7168, top-8 of 256 experts; bfloat16 rows (fp8: e4m3 with one "
          f"float32 scale per 128 channels); uniform routing (seed {args.seed}). An H100 has "
          f"{H100_SMS} SMs: a launch fills them with {WARPS_TARGET} warps of work (4 per SM).\n")
    from jax_ep import runtime  # the default Channels, for the streamed rows

    print("Between GPUs the rank-major normal ops stream through rings by default (the "
          "(streamed) rows, runtime.Channels()); the other rows run in phases "
          "($JAX_EP_CHANNELS=off, and expert-major).\n")
    rings = runtime.Channels()
    missed = []
    for between, puts, title in ((False, False, "virtual ranks (one GPU)"),
                                 (True, False, "one rank per GPU (between GPUs)"),
                                 (True, True, "one rank per GPU, peers reached by puts "
                                  "(JAX_EP_PEER_ACCESS=put, between nodes)" + (
                                      f", node-aware in nodes of {args.ranks_per_node}"
                                      if 0 < args.ranks_per_node < args.ranks else ""))):
        print(f"R = {args.ranks}, {title}; targets: launches dispatch <= 3, combine <= 2, "
              f"dispatch_rows <= 1, low latency <= 2 per half; moved <= {BYTES_TARGET} x "
              f"minimum; at least {WARPS_TARGET} warps in every launch; (over) and (under) "
              "mark a miss\n")
        accounts = deepseek_accounts(args.ranks, between, args.seed, tokens=args.tokens,
                                     ll_tokens=args.ll_tokens, puts=puts,
                                     ranks_per_node=args.ranks_per_node, channels=rings)
        print(table(accounts, args.ranks, between))
        nodes = args.ranks_per_node if puts else 0
        regions = symmetric_bytes(args.ranks, args.tokens, args.ll_tokens, puts,
                                  nodes) if between else None
        if regions:
            streamed = symmetric_bytes(args.ranks, args.tokens, args.ll_tokens, puts, nodes,
                                       channels=rings)
            gib = 2**30
            print(f"\nSymmetric buffer per rank (jax_ep.runtime.buffer_regions, rank-major), "
                  f"streamed through {rings.channels} channels of rings of "
                  f"{rings.chunk_tokens} x {rings.ring_chunks} slots (runtime.Channels(), the "
                  f"default; whatever T): normal {streamed['normal'] / gib:.2f} GiB (dispatch "
                  f"{streamed['dispatch'] / gib:.2f}, combine "
                  f"{streamed['combine'] / gib:.2f}), low latency "
                  f"{streamed['low_latency'] / gib:.2f} GiB. In phases: normal "
                  f"{regions['normal'] / gib:.2f} GiB (dispatch "
                  f"{regions['dispatch'] / gib:.2f}, combine {regions['combine'] / gib:.2f}).")
        print()
        missed += [line for line in expected(accounts, puts) if line not in missed]
    if missed:
        print("Expected misses:")
        print("\n".join(missed))
    formats = wire_formats(args.ranks, True, args.seed, tokens=args.tokens)
    print(f"\nDispatch (rank-major, between GPUs) by wire format (jax_ep.quant; the send "
          f"casts the bfloat16 rows, the finish dequantizes them), R = {args.ranks}, "
          f"T {args.tokens}:\n")
    print("| format | bytes per token row | GB moved | x bfloat16 |\n|---|---:|---:|---:|")
    for name, row, a in formats:
        print(f"| {name} | {row} | {a.bytes / 1e9:.3f} | {a.bytes / formats[0][2].bytes:.2f} |")
    print(training_table(args.ranks, args.seed, args.tokens))


def training_table(num_ranks: int, seed: int = 0, tokens: int = 4096) -> str:
    """`training_step` for bfloat16 and each wire format (the forward dispatch's rows alone,
    then every op's), as a Markdown table."""
    lines = [f"\nOne MoE layer's training step, expert-major, between GPUs, R = {num_ranks}, "
             f"T {tokens}: GB of row data the kernels move, all ranks "
             f"(`account.training_step`). In \"dispatch\" the forward dispatch's rows travel "
             f"in the format and the rest in bfloat16; in \"every op\" the combine and both "
             f"backward passes too\n",
             "| wire format | in | dispatch | combine | combine backward | dispatch backward | "
             "step | x bfloat16 |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    base = None
    for f, everywhere in ((None, False), *((f, e) for f in quant.FORMATS for e in (False, True))):
        ops = training_step(f, num_ranks, True, seed, tokens, everywhere=everywhere)
        step = sum(a.bytes for a in ops)
        base = base or step
        cells = " | ".join(f"{a.bytes / 1e9:.2f}" for a in ops)
        where = "-" if f is None else "every op" if everywhere else "dispatch"
        lines.append(f"| {f or 'bfloat16'} | {where} | {cells} | {step / 1e9:.2f} | "
                     f"{step / base:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
