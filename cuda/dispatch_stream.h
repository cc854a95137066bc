// Normal dispatch streamed through channels (cuda/channels.h): between devices (one rank per
// call), rank-major, one node, over a store view or a put view. It replaces the phased
// dispatch's send and receive areas: after the count (which also zeroes this rank's ring
// counters), one streaming launch runs, per channel, sender warps that write each token's
// slot into the ring of every receiver it has a row on, and receiver warps that copy the
// slots arriving from their sources straight into XLA's results; the finish then fills in
// what the contract defines beyond the received rows (dispatch_finish over OwnArrays).
//
// A streaming body is called per (rank, unit) with a Warp and the launch's Watch
// (cuda/channels.h).
#pragma once

#include <cstdint>

#include "cuda/channels.h"
#include "cuda/exchange.h"

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

// The metadata of a ring slot, after its row and scales.
struct RingMeta {
  int32_t* src;    // s*T + t
  int32_t* row;    // the row on the receiver
  int32_t* ids;    // [K], the source's clean ids
  float* weights;  // [K]
};
JAX_EP_HOST_DEVICE RingMeta ring_meta(const DispatchArgs& a, char* slot) {
  int32_t* src = reinterpret_cast<int32_t*>(slot + a.row_bytes) + a.scale_cols;
  return {src, src + 1, src + 2, reinterpret_cast<float*>(src + 2 + a.top_k)};
}

// Sender warp j of `senders` on channel c: the channel's tokens, in order, into the rings of
// the receivers d = j, j + senders, ... where they have a row (under the capacity).
template <typename Peers, typename Watch>
JAX_EP_HOST_DEVICE void dispatch_stream_send(const DispatchArgs& a, const Peers& peers, int c,
                                             int j, int senders, const Warp& w,
                                             const Watch& watch) {
  const Rings& g = a.rings;
  const int R = a.num_ranks, T = a.num_tokens, K = a.top_k, me = a.first_rank;
  const int64_t S = a.scale_cols;
  if (w.leader()) {
    for (int d = j; d < R; d += senders) g.sent(c, d) = g.published(c, d) = 0;
  }
  w.sync();
  const int end = g.first_token(c + 1, T);
  for (int t = g.first_token(c, T); t < end; ++t) {
    const int32_t* ids = a.route(me, t);
    const int64_t here = a.local(me) * T + t;
    for (int d = j; d < R; d += senders) {
      const int32_t row = rank_major_row(a, ids, me, t, d);
      if (row < 0 || row >= a.capacity) continue;
      if (!ring_reserve(g, me, peers, c, d, w, watch)) return;
      const int64_t n = g.sent(c, d);
      char* slot = ring_write_slot(g, me, peers, c, d, n);
      const RingMeta meta = ring_meta(a, slot);
      w.each([&](int lane) {
        copy_row(slot, a.x + here * a.row_bytes, a.row_bytes, lane, w.lanes);
        if (S > 0) copy_row(slot + a.row_bytes, a.scales + here * S, S * 4, lane, w.lanes);
        for (int k = lane; k < K; k += w.lanes) {
          meta.ids[k] = ids[k];
          meta.weights[k] = a.topk_weights[here * K + k];
        }
        if (lane == 0) {
          *meta.src = static_cast<int32_t>(static_cast<int64_t>(me) * T + t);
          *meta.row = row;
        }
      });
      ring_advance(g, me, peers, c, d, w);
    }
  }
  for (int d = j; d < R; d += senders) ring_publish(g, me, peers, c, d, g.sent(c, d), true, w);
}

// Receiver d's slot of ring (c, s): the row, its scales and its metadata into XLA's results
// at the row the sender found (the ids and weights of d's experts; -1 and 0 for others).
JAX_EP_HOST_DEVICE void dispatch_stream_unpack(const DispatchArgs& a, const char* slot, int d,
                                               const Warp& w) {
  const int K = a.top_k, El = a.experts_per_rank();
  const int64_t S = a.scale_cols;
  const RingMeta meta = ring_meta(a, const_cast<char*>(slot));
  const int64_t row = *meta.row;
  const DispatchArgs::Results& o = a.out;
  w.each([&](int lane) {
    copy_row(o.x + row * a.row_bytes, slot, a.row_bytes, lane, w.lanes);
    if (S > 0) copy_row(o.scales + row * S, slot + a.row_bytes, S * 4, lane, w.lanes);
    for (int k = lane; k < K; k += w.lanes) {
      const int32_t e = local_expert(meta.ids[k], d, El);
      o.idx[row * K + k] = e;
      o.weights[row * K + k] = e >= 0 ? meta.weights[k] : 0.0f;
    }
    if (lane == 0) o.src[row] = *meta.src;
  });
}

// Receiver warp j of `receivers` on channel c: the rings (c, s) of sources s = j,
// j + receivers, ..., polled in turn, each drained into XLA's results as its slots arrive
// (and its head returned to the source), until every source closed its ring and it is empty.
template <typename Peers, typename Watch>
JAX_EP_HOST_DEVICE void dispatch_stream_receive(const DispatchArgs& a, const Peers& peers,
                                                int c, int j, int receivers, const Warp& w,
                                                const Watch& watch) {
  const Rings& g = a.rings;
  const int R = a.num_ranks, me = a.first_rank;
  if (w.leader()) {
    for (int s = j; s < R; s += receivers) g.consumed(c, s) = 0;
  }
  w.sync();
  Patience<Watch> patience(watch);
  int waiting = -1;  // a source whose ring is still open
  for (bool moved = true; patience.again(moved);) {
    waiting = -1;
    moved = false;
    for (int s = j; s < R; s += receivers) {
      const uint64_t tail = ring_tail(g, c, s, w);
      const int64_t have = static_cast<int64_t>(tail & ~kRingClosed);
      const int64_t consumed = g.consumed(c, s);
      if (consumed < have) {
        for (int64_t n = consumed; n < have; ++n) {
          dispatch_stream_unpack(a, g.slot(g.recv, c, s, n), me, w);
        }
        w.sync();
        if (w.leader()) g.consumed(c, s) = have;
        ring_release(g, me, peers, c, s, w);
        moved = true;
      }
      if ((tail & kRingClosed) == 0) waiting = s;
    }
    if (waiting < 0) return;
  }
  const uint64_t tail = ring_tail(g, c, waiting, w);
  if (patience.expired() && w.leader()) {
    watch.give_up(RingWaitKind::kData, waiting, c, g.consumed(c, waiting), tail);
  }
}

// The streaming launch of a dispatch: per channel, `senders` sender warps then `receivers`
// receiver warps (units() of them per rank).
template <typename Peers>
struct DispatchStream {
  DispatchArgs a;
  Peers peers{};
  int senders = 1, receivers = 1;
  JAX_EP_HOST_DEVICE int64_t units() const {
    return static_cast<int64_t>(a.rings.channels) * (senders + receivers);
  }
  template <typename Watch>
  JAX_EP_HOST_DEVICE void operator()(int /*rank*/, int64_t unit, const Warp& w,
                                     const Watch& watch) const {
    const int per = senders + receivers;
    const int c = static_cast<int>(unit / per), j = static_cast<int>(unit % per);
    if (j < senders) {
      dispatch_stream_send(a, peers, c, j, senders, w, watch);
    } else {
      dispatch_stream_receive(a, peers, c, j - senders, receivers, w, watch);
    }
  }
};

}  // namespace jax_ep
