// Normal dispatch streamed through channels (cuda/channels.h): between devices (one rank per
// call), rank-major, over a store view or a put view, in one node or node-aware. It replaces
// the phased dispatch's send, receive and relay areas: after the count (which also zeroes
// this rank's ring counters), one streaming launch runs, per channel, sender warps that write
// each token's slot into the ring of every receiver of its node it has a row on (node-aware,
// and into the relay ring of each other node it has a row in), node-aware forwarder warps
// that pass each slot from the relay rings on to its targets in the relay's node as it
// lands, and receiver warps that copy the slots arriving in their node rings straight into
// XLA's results; the finish then fills in what the contract defines beyond the received rows
// (dispatch_finish over OwnArrays).
//
// A streaming body is called per (rank, unit) with a Warp and the launch's Watch
// (cuda/channels.h).
#pragma once

#include <cstdint>

#include "cuda/channels.h"
#include "cuda/dispatch.h"

namespace jax_ep {

// The view of a phase that reads only this rank's own arrays (V = 1): XLA's results, which
// a store view's nvshmem_ptr would not find.
struct OwnArrays {
  static constexpr bool kPuts = false;
  template <typename T>
  JAX_EP_HOST_DEVICE T* at(T* base, int64_t /*stride*/, int /*rank*/) const {
    return base;
  }
};

// The dispatch's arguments for its finish once the receivers wrote XLA's results: the
// per-receiver arrays are those results (OwnArrays reads them), nothing moves.
inline DispatchArgs landed(const DispatchArgs& a) {
  DispatchArgs f = a;
  f.recv_x = a.out.x;
  f.recv_scales = a.out.scales;
  f.recv_idx = a.out.idx;
  f.recv_weights = a.out.weights;
  f.recv_src = a.out.src;
  f.src_row = a.out.src_row;
  f.out = {};
  f.packed = false;
  return f;
}

// The metadata of a ring slot, after its row and scales; a relay ring's slot also holds the
// token's targets in the relay's node (targets() (receiver, row) pairs, up to one with
// receiver -1).
struct RingMeta {
  int32_t* src;      // s*T + t
  int32_t* row;      // the row on the receiver
  int32_t* ids;      // [K], the source's clean ids
  float* weights;    // [K]
  int32_t* targets;  // [targets(), 2], relay rings only
};
JAX_EP_HOST_DEVICE RingMeta ring_meta(const DispatchArgs& a, char* slot) {
  int32_t* src = reinterpret_cast<int32_t*>(slot + a.slot_row_bytes()) + a.scale_cols;
  float* weights = reinterpret_cast<float*>(src + 2 + a.top_k);
  return {src, src + 1, src + 2, weights, reinterpret_cast<int32_t*>(weights + a.top_k)};
}

// One token's slots, reserved in their rings and written together (fill_slots): up to
// kFanOut, each with the token's row on its receiver (-1 in a relay ring).
struct SlotBatch {
  char* slot[kFanOut];
  int32_t row[kFanOut];
  int link[kFanOut];  // the caller's number of each slot's ring
  int n = 0;
  JAX_EP_HOST_DEVICE bool full() const { return n == kFanOut; }
  JAX_EP_HOST_DEVICE void add(char* s, int32_t r, int l) {
    slot[n] = s;
    row[n] = r;
    link[n] = l;
    ++n;
  }
};

// Writes the batch's slots: the token's row and scales into each, reading them once (a fan;
// kCast, the bfloat16 row at x cast to a.wire with its scale words, cast_rows_to), then each
// slot's metadata.
template <bool kCast = false>
JAX_EP_HOST_DEVICE void fill_slots(const DispatchArgs& a, const SlotBatch& b, const char* x,
                                   const float* scales, int32_t src, const int32_t* ids,
                                   const float* weights, const Warp& w) {
  const int K = a.top_k;
  const int64_t S = a.scale_cols;
  w.each([&](int lane) {
    Fan<char> rows(0), scale_rows(1);
    for (int i = 0; i < b.n; ++i) {
      rows.add(b.slot[i]);
      if (S > 0) scale_rows.add(b.slot[i] + a.slot_row_bytes());
    }
    if constexpr (kCast) {
      cast_rows_to(a.wire, reinterpret_cast<const Bf16*>(x), a.hidden, rows, scale_rows, lane,
                   w.lanes);
    } else {
      fan_out_row<kStreamWordsInFlight>(rows, x, a.row_bytes, lane, w.lanes);
      if (S > 0) fan_out_row(scale_rows, scales, S * 4, lane, w.lanes);
    }
    for (int i = 0; i < b.n; ++i) {
      const RingMeta meta = ring_meta(a, b.slot[i]);
      for (int k = lane; k < K; k += w.lanes) {
        meta.ids[k] = ids[k];
        meta.weights[k] = weights[k];
      }
      if (lane == 0) {
        *meta.src = src;
        *meta.row = b.row[i];
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The rings of a streamed dispatch, per channel
//
// Node rings (a.rings), in each receiver: one from each rank of its node (direct; one node:
// from every rank), then, node-aware, one from each forwarder warp of each rank of the node
// (relayed). Relay rings (a.relays, node-aware, over puts), in each relay: one from each
// source it relays, numbered by the source's node and, where a smaller node makes a relay
// serve several sources of a node, by their order (relay_fan). Node-aware, the picture:
//
//   source s --direct (stores)---------------------------------------> receivers of s's node
//   source s --relay ring (puts)--> relay_of(s, m) --relayed (stores)--> receivers of node m
//
// The receivers never block (they poll their rings in turn), so every node ring drains; a
// forwarder blocks only on a node ring, so every relay ring drains; a sender blocks on either.

// Forwarder warps per channel on a relay: each drains its share of the relay rings into its
// own ring in each receiver of the node.
constexpr int kForwarders = 2;

JAX_EP_HOST_DEVICE int forwarders(const DispatchArgs& a) {
  return a.nodes() > 1 ? kForwarders : 0;
}
// Sender warps per channel (and as many receivers) for `wanted` per role: at most the
// destinations a source's tokens have (the ranks of a node, and node-aware the nodes).
JAX_EP_HOST_DEVICE int dispatch_channel_warps(const DispatchArgs& a, int wanted) {
  return role_warps(wanted, a.node_ranks() + (a.nodes() > 1 ? a.nodes() : 0));
}
JAX_EP_HOST_DEVICE int node_links(const DispatchArgs& a) {
  return a.node_ranks() * (1 + forwarders(a));
}
// Sources of one node a relay may serve: more than one when its node is smaller (the last).
JAX_EP_HOST_DEVICE int relay_fan(const DispatchArgs& a) {
  const int smallest = a.node_size(a.nodes() - 1);
  return (a.node_ranks() + smallest - 1) / smallest;
}
JAX_EP_HOST_DEVICE int relay_links(const DispatchArgs& a) {
  return a.nodes() > 1 ? a.nodes() * relay_fan(a) : 0;
}
// Rank x's end among the node rings: direct (f < 0), or of its forwarder f.
JAX_EP_HOST_DEVICE int node_end(const DispatchArgs& a, int x, int f) {
  return f < 0 ? a.in_node(x) : a.node_ranks() + a.in_node(x) * kForwarders + f;
}
// The node ring between this rank and `peer` (of its node), direct or of the forwarder f of
// whichever of the two sends.
JAX_EP_HOST_DEVICE RingLink node_link(const DispatchArgs& a, int me, int peer, int f) {
  return {node_end(a, peer, f), node_end(a, me, f), peer};
}
// Node ring i of receiver `me`: its link, with rank -1 where no rank of the node writes it.
JAX_EP_HOST_DEVICE RingLink node_ring(const DispatchArgs& a, int me, int i) {
  const int P = a.node_ranks(), first = a.node_of(me) * P, size = a.node_size(a.node_of(me));
  const int writer = i < P ? i : (i - P) / kForwarders;
  if (writer >= size) return {i, 0, -1};
  return node_link(a, me, first + writer, i < P ? -1 : (i - P) % kForwarders);
}
// Source s's relay ring at its relay in node m: its index there.
JAX_EP_HOST_DEVICE int relay_end(const DispatchArgs& a, int s, int m) {
  return a.node_of(s) * relay_fan(a) + a.in_node(s) / a.node_size(m);
}
// Relay ring i of relay `me`: its link to its source, with rank -1 where it has none.
JAX_EP_HOST_DEVICE RingLink relay_ring(const DispatchArgs& a, int me, int i) {
  const int m = a.node_of(me), n = i / relay_fan(a);
  const int in_node = a.in_node(me) + i % relay_fan(a) * a.node_size(m);
  if (n == m || in_node >= a.node_size(n)) return {i, 0, -1};
  return {i, m, n * a.node_ranks() + in_node};
}

// ---------------------------------------------------------------------------------------------
// The roles of a streaming dispatch launch (this rank `me`, channel c)

// Node-aware, token t's targets in node m (receiver, row), into `pairs` by the leader; the
// number of them in every lane (with `pairs` null, whether there is one: it stops at the
// first).
JAX_EP_HOST_DEVICE int node_targets(const DispatchArgs& a, const int32_t* ids, int me, int t,
                                    int m, int32_t* pairs, const Warp& w) {
  const int P = a.node_ranks(), first = m * P, size = a.node_size(m);
  int n = 0;
  for (int i = 0; i < size && n < a.targets(); ++i) {
    const int32_t row = rank_major_row(a, ids, me, t, first + i);
    if (row < 0 || row >= a.capacity) continue;
    if (pairs == nullptr) return 1;
    if (w.leader()) {
      pairs[2 * n] = first + i;
      pairs[2 * n + 1] = row;
    }
    ++n;
  }
  if (pairs != nullptr && w.leader()) {
    for (int i = n; i < a.targets(); ++i) pairs[2 * i] = pairs[2 * i + 1] = -1;
  }
  return n;
}

// Sender warp j of `senders`: the channel's tokens, in order, into the rings of its
// destinations i = j, j + senders, ...: the ranks of its node (direct, where the token has a
// row under the capacity), then node-aware the other nodes (the relay ring to the token's
// relay there, where it has a target). kCast: the slots get the row cast (DispatchArgs::wire).
template <bool kCast, typename NodePeers, typename RelayPeers, typename Watch>
JAX_EP_HOST_DEVICE void dispatch_stream_send(const DispatchArgs& a, const NodePeers& node,
                                             const RelayPeers& relay, int c, int j, int senders,
                                             const Warp& w, const Watch& watch) {
  const Rings &g = a.rings, &q = a.relays;
  const int T = a.num_tokens, K = a.top_k, me = a.first_rank, home = a.node_of(me);
  const int first = home * a.node_ranks(), size = a.node_size(home);
  const int dests = size + (a.nodes() > 1 ? a.nodes() : 0);
  auto link = [&](int i) {
    return i < size ? node_link(a, me, first + i, -1)
                    : RingLink{i - size, relay_end(a, me, i - size), a.relay_of(me, i - size)};
  };
  if (w.leader()) {
    for (int i = j; i < dests; i += senders) ring_open(i < size ? g : q, c, link(i).here);
  }
  w.sync();
  const int end = g.first_token(c + 1, T);
  for (int t = g.first_token(c, T); t < end; ++t) {
    const int32_t* ids = a.route(me, t);
    const int64_t here = a.local(me) * T + t;
    const int32_t src = static_cast<int32_t>(static_cast<int64_t>(me) * T + t);
    const char* x = kCast ? reinterpret_cast<const char*>(a.bf16_row(me, t))
                          : a.x + here * a.row_bytes;
    const float* scales = kCast ? nullptr : a.scales + here * a.scale_cols;
    const float* weights = a.topk_weights + here * K;
    // The token's slots in this warp's rings, reserved one by one (a wait on one ring holds
    // the others' reserved slots, which no one waits for), then written from one read of the
    // row per kFanOut of them.
    SlotBatch batch;
    auto flush = [&] {
      fill_slots<kCast>(a, batch, x, scales, src, ids, weights, w);
      for (int b = 0; b < batch.n; ++b) {
        const RingLink l = link(batch.link[b]);
        if (batch.link[b] < size) {
          ring_advance(g, node, c, l, w);
        } else {
          node_targets(a, ids, me, t, l.here, ring_meta(a, batch.slot[b]).targets, w);
          ring_advance(q, relay, c, l, w);
        }
      }
      batch.n = 0;
    };
    for (int i = j; i < dests; i += senders) {
      const RingLink l = link(i);
      if (i < size) {
        const int32_t row = rank_major_row(a, ids, me, t, l.rank);
        if (row < 0 || row >= a.capacity) continue;
        if (!ring_reserve(g, node, c, l, w, watch)) return;
        batch.add(ring_write_slot(g, node, c, l, g.sent(c, l.here)), row, i);
      } else {
        if (l.here == home || node_targets(a, ids, me, t, l.here, nullptr, w) == 0) continue;
        if (!ring_reserve(q, relay, c, l, w, watch)) return;
        batch.add(ring_write_slot(q, relay, c, l, q.sent(c, l.here)), -1, i);
      }
      if (batch.full()) flush();
    }
    if (batch.n > 0) flush();
  }
  for (int i = j; i < dests; i += senders) {
    const RingLink l = link(i);
    if (i < size) {
      ring_publish(g, node, c, l, g.sent(c, l.here), true, w);
    } else if (l.here != home) {
      ring_publish(q, relay, c, l, q.sent(c, l.here), true, w);
    }
  }
}

// Receiver d's slot of a node ring: the row, its scales and its metadata into XLA's results
// at the row the sender found (the ids and weights of d's experts; -1 and 0 for others).
// kCast (the casting launch), with DispatchArgs::dequantize: the row dequantized into XLA's
// bfloat16 x (no scales there).
template <bool kCast>
JAX_EP_HOST_DEVICE void dispatch_stream_unpack(const DispatchArgs& a, const char* slot, int d,
                                               const Warp& w) {
  const int K = a.top_k, El = a.experts_per_rank();
  const int64_t S = a.scale_cols;
  const RingMeta meta = ring_meta(a, const_cast<char*>(slot));
  const int64_t row = *meta.row;
  const DispatchArgs::Results& o = a.out;
  w.each([&](int lane) {
    if (kCast && a.dequantize) {
      dequantize_row(a.wire, slot, slot + a.slot_row_bytes(), a.hidden,
                     reinterpret_cast<Bf16*>(o.x) + row * a.hidden, lane, w.lanes);
    } else {
      copy_row<kStreamWordsInFlight>(o.x + row * a.row_bytes, slot, a.row_bytes, lane, w.lanes);
      if (S > 0) copy_row(o.scales + row * S, slot + a.slot_row_bytes(), S * 4, lane, w.lanes);
    }
    for (int k = lane; k < K; k += w.lanes) {
      const int32_t e = local_expert(meta.ids[k], d, El);
      o.idx[row * K + k] = e;
      o.weights[row * K + k] = e >= 0 ? meta.weights[k] : 0.0f;
    }
    if (lane == 0) o.src[row] = *meta.src;
  });
}

// Drains the rings i = j, j + step, ... < links of g (`ring(i)` their links; rank -1: unused)
// until every one is closed and empty: polled in turn, each one's new slots passed to
// `take(i, slot)`, then, by chunk and at the end of a batch, its head returned to its sender.
// When nothing arrives in a round, `idle()`. False when a wait gave up.
template <typename Peers, typename Watch, typename Ring, typename Take, typename Idle>
JAX_EP_HOST_DEVICE bool drain_rings(const Rings& g, const Peers& peers, int c, int j, int step,
                                    int links, const Ring& ring, const Take& take,
                                    const Idle& idle, const Warp& w, const Watch& watch) {
  if (w.leader()) {
    for (int i = j; i < links; i += step) ring_receive_open(g, c, i);
  }
  w.sync();
  Patience<Watch> patience(watch, w);
  int waiting = -1;  // a ring still open
  for (bool moved = true; patience.again(moved);) {
    waiting = -1;
    moved = false;
    for (int i = j; i < links; i += step) {
      const RingLink l = ring(i);
      if (l.rank < 0) continue;
      const uint64_t tail = ring_tail(g, c, i, w);
      const int64_t have = static_cast<int64_t>(tail & ~kRingClosed);
      for (int64_t n = g.consumed(c, i); n < have;) {
        if (!take(i, g.slot(g.recv, c, i, n))) return false;
        ++n;
        w.sync();
        if (w.leader()) g.consumed(c, i) = n;
        w.sync();
        if (n % g.chunk_tokens == 0 || n == have) ring_release(g, peers, c, l, w);
        moved = true;
      }
      if ((tail & kRingClosed) == 0) waiting = i;
    }
    if (waiting < 0) return true;
    if (!moved) idle();
  }
  const uint64_t tail = ring_tail(g, c, waiting, w);
  if (patience.expired() && w.leader()) {
    watch.give_up(RingWaitKind::kData, ring(waiting).rank, c, g.consumed(c, waiting), tail);
  }
  return false;
}

// Receiver warp j of `receivers`: node rings i = j, j + receivers, ..., drained into XLA's
// results as their slots arrive.
template <bool kCast, typename NodePeers, typename Watch>
JAX_EP_HOST_DEVICE void dispatch_stream_receive(const DispatchArgs& a, const NodePeers& node,
                                                int c, int j, int receivers, const Warp& w,
                                                const Watch& watch) {
  const int me = a.first_rank;
  drain_rings(
      a.rings, node, c, j, receivers, node_links(a),
      [&](int i) { return node_ring(a, me, i); },
      [&](int, const char* slot) {
        dispatch_stream_unpack<kCast>(a, slot, me, w);
        return true;
      },
      [] {}, w, watch);
}

// Node-aware, forwarder warp f of a relay: its relay rings i = f, f + kForwarders, ..., each
// slot stored into the node ring of forwarder f in each of its targets (waiting for space
// there) as it arrives; while nothing arrives, what it wrote is published; at the end its
// node rings are closed.
template <typename NodePeers, typename RelayPeers, typename Watch>
JAX_EP_HOST_DEVICE void dispatch_stream_forward(const DispatchArgs& a, const NodePeers& node,
                                                const RelayPeers& relay, int c, int f,
                                                const Warp& w, const Watch& watch) {
  const Rings& g = a.rings;
  const int me = a.first_rank, P = a.node_ranks();
  const int first = a.node_of(me) * P, size = a.node_size(a.node_of(me));
  if (w.leader()) {
    for (int d = first; d < first + size; ++d) ring_open(g, c, node_link(a, me, d, f).here);
  }
  w.sync();
  auto publish = [&](bool closed) {
    for (int d = first; d < first + size; ++d) {
      const RingLink l = node_link(a, me, d, f);
      if (closed || g.published(c, l.here) < g.sent(c, l.here)) {
        ring_publish(g, node, c, l, g.sent(c, l.here), closed, w);
      }
    }
  };
  const bool drained = drain_rings(
      a.relays, relay, c, f, kForwarders, relay_links(a),
      [&](int i) { return relay_ring(a, me, i); },
      [&](int, const char* slot) {
        // Its targets' slots, reserved, then written from one read per kFanOut of them.
        const RingMeta meta = ring_meta(a, const_cast<char*>(slot));
        const float* scales = reinterpret_cast<const float*>(slot + a.slot_row_bytes());
        SlotBatch batch;
        for (int p = 0; p < a.targets() && meta.targets[2 * p] >= 0; ++p) {
          const RingLink l = node_link(a, me, meta.targets[2 * p], f);
          if (!ring_reserve(g, node, c, l, w, watch)) return false;
          batch.add(ring_write_slot(g, node, c, l, g.sent(c, l.here)), meta.targets[2 * p + 1],
                    meta.targets[2 * p]);
          const bool last = p + 1 == a.targets() || meta.targets[2 * p + 2] < 0;
          if (!batch.full() && !last) continue;
          fill_slots(a, batch, slot, scales, *meta.src, meta.ids, meta.weights, w);
          for (int b = 0; b < batch.n; ++b) {
            ring_advance(g, node, c, node_link(a, me, batch.link[b], f), w);
          }
          batch.n = 0;
        }
        return true;
      },
      [&] { publish(false); }, w, watch);
  if (drained) publish(true);
}

// The streaming launch of a dispatch: per channel, `senders` sender warps, node-aware
// forwarders(a) forwarder warps, then `receivers` receiver warps (units() of them per rank).
// NodePeers reach the node's ranks (one node: the op's view), RelayPeers the relays (puts).
// kCast: the senders cast the rows to a.wire and, with DispatchArgs::dequantize, the
// receivers dequantize them (a launch of its own: the plain launch's code stays as it is; the
// forwarders pass on slots already cast).
template <typename NodePeers, typename RelayPeers, bool kCast = false>
struct DispatchStream {
  DispatchArgs a;
  NodePeers node{};
  RelayPeers relay{};
  int senders = 1, receivers = 1;
  JAX_EP_HOST_DEVICE int per_channel() const { return senders + forwarders(a) + receivers; }
  JAX_EP_HOST_DEVICE int64_t units() const {
    return static_cast<int64_t>(a.rings.channels) * per_channel();
  }
  template <typename Watch>
  JAX_EP_HOST_DEVICE void operator()(int /*rank*/, int64_t unit, const Warp& w,
                                     const Watch& watch) const {
    const int per = per_channel(), F = forwarders(a);
    const int c = static_cast<int>(unit / per), j = static_cast<int>(unit % per);
    if (j < senders) {
      dispatch_stream_send<kCast>(a, node, relay, c, j, senders, w, watch);
    } else if (j < senders + F) {
      dispatch_stream_forward(a, node, relay, c, j - senders, w, watch);
    } else {
      dispatch_stream_receive<kCast>(a, node, c, j - senders - F, receivers, w, watch);
    }
  }
};

}  // namespace jax_ep
