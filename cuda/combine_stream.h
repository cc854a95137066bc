// Normal combine streamed through channels (cuda/channels.h): between devices, rank-major, one
// node, over a store view or a put view. Each rank returns the rows it holds to their homes
// through rings, per channel (a range of the homes' tokens) and home, in token order: a slot
// is the row of y, its weight and its token. The home's receiver warp of a channel sums its
// tokens one after another, each once every rank's ring shows its next slot (or is closed and
// empty): the ranks whose next slot is this token are the terms, in rank order, the sum of the
// phased combine (sum_rows), so the bits are the same.
//
// A receiver waits on one ring at a time (the next rank it needs), so a sender must never
// wait on one ring while it holds slots for another: sender warps poll their homes in turn,
// sending what fits, and publish what they hold before they move on.
#pragma once

#include <cstdint>

#include "cuda/channels.h"
#include "cuda/combine.h"

namespace jax_ep {

// Bytes of a combine ring slot's row part: the row (H values of T, or kCast in the wire
// format), padded to 16 (so that its weight and token are aligned, and the row moves in 16-byte
// words whatever H is).
template <bool kCast, typename T>
JAX_EP_HOST_DEVICE int64_t combine_slot_row_bytes(const CombineArgs<T>& a) {
  return word_padded(kCast ? a.row_bytes() : a.hidden * static_cast<int64_t>(sizeof(T)));
}
// Bytes of a combine ring slot: the row part, its weight and its token, to 16.
template <typename T>
JAX_EP_HOST_DEVICE int64_t combine_slot_bytes(const CombineArgs<T>& a) {
  const bool cast = a.wire != kWireBf16;
  return (cast ? combine_slot_row_bytes<true>(a) : combine_slot_row_bytes<false>(a)) + 16;
}
// A combine slot's weight and token, after its row part.
template <bool kCast, typename T>
JAX_EP_HOST_DEVICE float* slot_weight(const CombineArgs<T>& a, char* slot) {
  return reinterpret_cast<float*>(slot + combine_slot_row_bytes<kCast>(a));
}
template <bool kCast, typename T>
JAX_EP_HOST_DEVICE int32_t* slot_token(const CombineArgs<T>& a, char* slot) {
  return reinterpret_cast<int32_t*>(slot_weight<kCast>(a, slot) + 1);
}

// Sender warp j of `senders` on channel c: the rows this rank holds for the channel's tokens of
// homes s = j, j + senders, ..., polled in turn: each home's in token order while its ring
// has room; a home whose scan reached the channel's end gets its ring closed.
template <bool kCast, typename T, typename Peers, typename Watch>
JAX_EP_HOST_DEVICE void combine_stream_send(const CombineArgs<T>& a, const Peers& peers, int c,
                                            int j, int senders, const Warp& w,
                                            const Watch& watch) {
  const Rings& g = a.rings;
  const int R = a.num_ranks, Tn = a.num_tokens, me = a.first_rank;
  const int64_t H = a.hidden, rows = static_cast<int64_t>(R) * Tn;
  const int32_t* src_row = a.src_row + a.local(me) * rows;
  const T* y = a.y + a.local(me) * a.capacity * H;
  const float* weights = a.weights ? a.weights + a.local(me) * a.capacity : nullptr;
  const int first = g.first_token(c, Tn), end = g.first_token(c + 1, Tn);
  if (w.leader()) {
    for (int s = j; s < R; s += senders) {
      ring_open(g, c, s);
      g.at(c, s, Rings::kCursor) = first;
    }
  }
  w.sync();
  Patience<Watch> patience(watch, w);
  int stuck = -1;  // a home whose ring is full
  for (bool moved = true; patience.again(moved);) {
    stuck = -1;
    moved = false;
    for (int s = j; s < R; s += senders) {
      const RingLink l = flat_link(me, s);
      int64_t t = g.at(c, s, Rings::kCursor);
      if (t > end) continue;  // closed
      for (; t < end; ++t) {
        const int32_t row = src_row[static_cast<int64_t>(s) * Tn + t];
        if (row < 0) continue;
        if (!ring_has_space(g, c, s, w)) break;
        const int64_t n = g.sent(c, s);
        char* slot = ring_write_slot(g, peers, c, l, n);
        w.each([&](int lane) {
          if constexpr (kCast) {  // the weighted row in the wire format; no weight
            if (lane == 0) meter_cast(a, 1);
            cast_weighted_row(a, y + row * H, weights ? weights + row : nullptr, slot, lane,
                              w.lanes);
          } else {
            copy_row<kStreamWordsInFlight>(slot, y + row * H,
                                           H * static_cast<int64_t>(sizeof(T)), lane, w.lanes);
          }
          if (lane == 0) {
            *slot_weight<kCast>(a, slot) = weights && !kCast ? weights[row] : 0.0f;
            *slot_token<kCast>(a, slot) = static_cast<int32_t>(t);
          }
        });
        ring_advance(g, peers, c, l, w);
        moved = true;
      }
      if (t == end) {
        ring_publish(g, peers, c, l, g.sent(c, s), true, w);
        t = end + 1;
        moved = true;
      } else {
        stuck = s;
        if (g.published(c, s) < g.sent(c, s)) {
          ring_publish(g, peers, c, l, g.sent(c, s), false, w);
        }
      }
      w.sync();
      if (w.leader()) g.at(c, s, Rings::kCursor) = t;
      w.sync();
    }
    if (stuck < 0) return;
  }
  const int64_t head = ring_head(g, c, stuck, w);
  if (patience.expired() && w.leader()) {
    watch.give_up(RingWaitKind::kSpace, stuck, c, head, g.sent(c, stuck));
  }
}

// Waits until receive ring (c, r) shows a slot not yet consumed, or is closed and empty;
// false when the wait gave up.
template <typename Watch>
JAX_EP_HOST_DEVICE bool combine_ring_ready(const Rings& g, int c, int r, const Warp& w,
                                           const Watch& watch) {
  auto ready = [&](uint64_t tail) {
    return (tail & kRingClosed) != 0 ||
           g.consumed(c, r) < static_cast<int64_t>(tail & ~kRingClosed);
  };
  if (ready(static_cast<uint64_t>(g.at(c, r, Rings::kSeen)))) return true;
  Patience<Watch> patience(watch, w);
  uint64_t tail = 0;
  do {
    tail = ring_tail(g, c, r, w);
    w.sync();
    if (w.leader()) g.at(c, r, Rings::kSeen) = static_cast<int64_t>(tail);
    w.sync();
    if (ready(tail)) return true;
  } while (patience.again(false));
  if (patience.expired() && w.leader()) {
    watch.give_up(RingWaitKind::kData, r, c, g.consumed(c, r), tail);
  }
  return false;
}

// The slots a receiver sums for one token: the rings whose next slot holds it, in rank order,
// found once per token by the leader and read by every lane for each pack of the row
// (sum_rows collects its terms per pack, and testing every ring there costs 3 loads per ring
// and pack: at EP64 the receiver's work). A token has a row on at most top_k ranks, and
// dispatch takes top_k <= 32, so kTokenSlots of them hold every token of a handle it made; one
// with more (another handle) is summed by testing the rings per pack. On the GPU a table of
// the warp in shared memory (lane 0 writes it, the lanes read it after a warp barrier); on
// the CPU the receiver's own.
#ifndef JAX_EP_TOKEN_SLOTS  // the C++ test makes it small, so that both ways run there
#define JAX_EP_TOKEN_SLOTS 32
#endif
constexpr int kTokenSlots = JAX_EP_TOKEN_SLOTS;
struct TokenSlots {  // trivial, as shared memory requires; the leader sets every field it reads
  char* slot[kTokenSlots];
  float weight[kTokenSlots];
  int rank[kTokenSlots];
  int n;     // slots listed
  bool all;  // whether they are every slot of the token
};
JAX_EP_HOST_DEVICE TokenSlots& token_slots_table(TokenSlots& own) {
#if defined(__CUDA_ARCH__)
  __shared__ TokenSlots tables[kBlockWarps];
  return tables[threadIdx.x / 32];
#else
  return own;
#endif
}

// The receiver warp of channel c: the channel's tokens of this rank, one after another, each
// summed over the ranks whose next slot is that token, in rank order, into XLA's result.
template <bool kCast, typename T, typename Peers, typename Watch>
JAX_EP_HOST_DEVICE void combine_stream_receive(const CombineArgs<T>& a, const Peers& peers,
                                               int c, const Warp& w, const Watch& watch) {
  const Rings& g = a.rings;
  const int R = a.num_ranks, Tn = a.num_tokens, me = a.first_rank;
  const int64_t H = a.hidden;
  if (w.leader()) {
    for (int r = 0; r < R; ++r) ring_receive_open(g, c, r);
  }
  w.sync();
  // Whether ring (c, r)'s next slot holds token t (ready: a slot, or closed and empty).
  auto holds = [&](int r, int t) {
    const int64_t n = g.consumed(c, r);
    return n < (g.at(c, r, Rings::kSeen) & ~static_cast<int64_t>(kRingClosed)) &&
           *slot_token<kCast>(a, g.slot(g.recv, c, r, n)) == t;
  };
  TokenSlots own;
  TokenSlots& held = token_slots_table(own);
  const int end = g.first_token(c + 1, Tn);
  for (int t = g.first_token(c, Tn); t < end; ++t) {
    for (int r = 0; r < R; ++r) {
      if (!combine_ring_ready(g, c, r, w, watch)) return;
    }
    if (w.leader()) {
      held.n = 0;
      held.all = true;
      for (int r = 0; r < R && held.all; ++r) {
        if (!holds(r, t)) continue;
        if (held.n == kTokenSlots) {
          held.all = false;
        } else {
          char* slot = g.slot(g.recv, c, r, g.consumed(c, r));
          held.slot[held.n] = slot;
          held.weight[held.n] = *slot_weight<kCast>(a, slot);
          held.rank[held.n++] = r;
        }
      }
    }
    w.sync();  // the lanes read the table after its writes
    const bool listed = held.all;
    T* out = a.out + (a.local(me) * Tn + t) * H;
    auto collect = [&](Terms<T>& terms, int i) {
      for (; listed && i < held.n && !terms.full(); ++i) {
        terms.add(reinterpret_cast<const T*>(held.slot[i]), held.weight[i]);
      }
      for (; !listed && i < R && !terms.full(); ++i) {
        if (!holds(i, t)) continue;
        char* slot = g.slot(g.recv, c, i, g.consumed(c, i));
        terms.add(reinterpret_cast<const T*>(slot), *slot_weight<kCast>(a, slot));
      }
      return i;
    };
    w.each([&](int lane) {
      combine_sum<kCast>(a, out, a.weights != nullptr, listed ? held.n : R, collect, lane,
                         w.lanes);
    });
    // Each summed ring's slot consumed: the table's, or the rings that hold the token.
    auto consume = [&](int r) {
      const int64_t n = g.consumed(c, r) + 1;
      w.sync();
      if (w.leader()) g.consumed(c, r) = n;
      w.sync();
      if (n % g.chunk_tokens == 0) ring_release(g, peers, c, flat_link(me, r), w);
    };
    for (int i = 0; listed && i < held.n; ++i) consume(held.rank[i]);
    for (int r = 0; !listed && r < R; ++r) {
      if (holds(r, t)) consume(r);
    }
    w.sync();  // every lane read the table before the leader fills it again
  }
  for (int r = 0; r < R; ++r) ring_release(g, peers, c, flat_link(me, r), w);
}

// The streaming launch of a combine: per channel, `senders` sender warps then one receiver;
// kCast: the rows travel in the wire format a.wire (cuda/combine.h).
template <typename T, typename Peers, bool kCast = false>
struct CombineStream {
  CombineArgs<T> a;
  Peers peers{};
  int senders = 1;
  JAX_EP_HOST_DEVICE int64_t units() const {
    return static_cast<int64_t>(a.rings.channels) * (senders + 1);
  }
  template <typename Watch>
  JAX_EP_HOST_DEVICE void operator()(int /*rank*/, int64_t unit, const Warp& w,
                                     const Watch& watch) const {
    const int per = senders + 1;
    const int c = static_cast<int>(unit / per), j = static_cast<int>(unit % per);
    if (j < senders) {
      combine_stream_send<kCast>(a, peers, c, j, senders, w, watch);
    } else {
      combine_stream_receive<kCast>(a, peers, c, w, watch);
    }
  }
};

// Zeroes this rank's ring counters before the launch that carries it meets the peers.
struct RingsZero {
  Rings g;
  JAX_EP_HOST_DEVICE int64_t items() const { return ring_counters(g); }
  JAX_EP_HOST_DEVICE void operator()(int /*rank*/, int64_t i, int lane, int /*lanes*/) const {
    if (lane == 0) zero_ring_counter(g, i);
  }
};

}  // namespace jax_ep
