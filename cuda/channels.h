// Channels: normal dispatch and combine streamed through ring buffers of a fixed size, so
// that the symmetric buffer does not grow with the tokens, and senders and receivers run at
// once (cuda/dispatch_stream.h, cuda/combine_stream.h). The picture below is the dispatch's;
// the combine's runs from the experts' ranks back to the homes, whose receiver sums a token
// once every rank's ring shows its next slot.
//
// The tokens of a rank are split into `channels` contiguous ranges. For each channel c and
// pair of ranks (s, d), s's rows for d travel through one ring in d's buffer: `slots` slots
// (chunk_tokens x ring_chunks) and a tail counter that s advances; s's copy of the head
// counter, that d advances, says how many slots d has consumed. Who waits for whom:
//
//     sender s, channel c                          receiver d, channel c
//     for each token of c going to d:              for each source s (polled in turn):
//       wait until sent - head < slots  <-- head --  copy slots [consumed, tail) out to
//       write the slot (row, scales,                 XLA's results; consumed = tail
//         source, row there, ids, weights)         until s closed its ring and it is empty
//       every chunk_tokens slots: publish --tail-->
//     publish the last, with the closed bit
//
// A sender waits only on the ring it is writing; a receiver never waits on one ring while
// another could be drained (it polls its sources in turn), so every full ring is drained and
// every published slot is read: the exchange always progresses while every unit runs (the
// units of a streaming launch are co-resident: blocks that fit the GPU at once; one thread
// each on the CPU). Over a store view a slot is written into the receiver's ring directly and
// the tail stored after it; over a put view it is written into this rank's copy of the ring
// (the send ring, same place) and each published range, within one chunk, is one put
// followed by the tail's signal: one message per (chunk, destination).
//
// A unit body is called once per warp with a Warp (on the GPU by every lane, on the CPU once
// for all lanes): what the lanes must agree on (counters read from memory) is read by the
// first lane and shared, and per-lane work (copies) runs in Warp::each. Waits are bounded by
// the op timeout since the last progress (Patience) and report the op, the peer, the channel
// and the counters (Watch::give_up).
#pragma once

#include <cstdint>

#include "cuda/routing.h"  // JAX_EP_HOST_DEVICE

namespace jax_ep {

// ---------------------------------------------------------------------------------------------
// Warps of a streaming launch

struct Warp {
  static constexpr int kAllLanes = -1;
  int lane;   // this thread's lane on the GPU; kAllLanes on the CPU, where one call runs all
  int lanes;  // lanes of the warp (32 on the GPU)

  // f(lane) for each lane this call runs (on the CPU from the last, as cuda/host_launch.h).
  template <typename F>
  JAX_EP_HOST_DEVICE void each(const F& f) const {
    if (lane != kAllLanes) {
      f(lane);
      return;
    }
    for (int l = lanes - 1; l >= 0; --l) f(l);
  }
  JAX_EP_HOST_DEVICE bool leader() const { return lane == kAllLanes || lane == 0; }
  // The leader's value, in every lane.
  template <typename T>
  JAX_EP_HOST_DEVICE T shared(T value) const {
#if defined(__CUDA_ARCH__)
    return __shfl_sync(0xffffffffu, value, 0);
#else
    return value;
#endif
  }
  // The lanes' reads and writes so far come before what any lane does next (the leader's
  // updates of shared counters, read by all lanes after this).
  JAX_EP_HOST_DEVICE void sync() const {
#if defined(__CUDA_ARCH__)
    __syncwarp();
#endif
  }
  // The lanes' writes so far, visible to every rank before what the leader writes next.
  JAX_EP_HOST_DEVICE void fence() const {
#if defined(__CUDA_ARCH__)
    __threadfence_system();
    __syncwarp();
#endif
  }
};

// A counter that another rank writes into this rank's buffer, read with acquire: what was
// written before its value is visible after.
JAX_EP_HOST_DEVICE uint64_t load_acquire(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}
// Stores a counter with release: what this thread wrote before is visible with it.
JAX_EP_HOST_DEVICE void store_release(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

// Moves the counter at `slot` (an address in this rank's buffer) in `rank`'s buffer from
// `from` to `to` (its only writer is this rank): through a store view a store of `to` with
// release; through a put view a signal that adds the difference (Peers::signal_add), none
// when there is none. Added deltas commute, so the signals need no order among themselves
// (no fence: with several queue pairs per PE a fence waits for all of them); `after_puts`
// orders the signal after this rank's earlier puts to `rank` too (a fence).
template <typename Peers>
JAX_EP_HOST_DEVICE void move_counter(const Peers& peers, uint64_t* slot, int rank,
                                     uint64_t from, uint64_t to, bool after_puts) {
  if constexpr (Peers::kPuts) {
    if (to != from) peers.signal_add(slot, rank, to - from, after_puts);
  } else {
    store_release(peers.at(slot, 0, rank), to);
  }
}

// Warps per role per channel of a streaming launch (Rings::warps; 0 takes the platform's
// default): the dispatch's senders, which split a token's destinations (each reads the row
// once per kFanOut of its rings, so w senders read it up to w times: local reads, a fraction
// of what crosses the link) and as many receivers, which split the rings; the combine's
// senders, which split the homes (each row goes to one home: no read is repeated), beside
// one receiver that sums the channel's tokens in order. On a GPU by default 4 and 8, enough
// bytes in flight for NVLink with 8 loads in flight per lane (kStreamWordsInFlight; the
// account's bound, docs/cuda.md); on the CPU the grid's warps, so that the split runs in CI.
// Never more than a role has rings to split.
constexpr int kGpuDispatchWarps = 4;
constexpr int kGpuCombineSenders = 8;
constexpr int kMaxChannelWarps = 64;  // what Rings::warps may ask for
// Blocks of a streaming launch one SM holds: its kernel is built for 2 (at most 128 registers a
// thread), so that an op's num_sms holds twice the warps of one block per SM
// (jax_ep.runtime.stream_plan sizes the channels by it).
constexpr int kStreamBlocksPerSm = 2;
// The warps of a role that splits `rings` rings, for `wanted`: at least 1, at most one a ring.
JAX_EP_HOST_DEVICE int role_warps(int wanted, int rings) {
  const int most = rings > 1 ? rings : 1;
  return wanted < 1 ? 1 : wanted < most ? wanted : most;
}

// The tail's bit that says the sender wrote its last slot.
constexpr uint64_t kRingClosed = uint64_t{1} << 63;

// Why a ring wait gave up, for Watch::give_up.
enum class RingWaitKind { kSpace, kData };

// ---------------------------------------------------------------------------------------------
// The rings of an op, in this rank's symmetric buffer (carve_rings, cuda/peer_ops.h)

struct Rings {
  int channels = 0;  // 0: the op runs in phases (no rings)
  int warps = 0;     // warps per role per channel (see kGpuDispatchWarps); 0: the default
  int chunk_tokens = 0, ring_chunks = 0;
  int links = 0;  // rings per channel: one per peer (one node), see RingLink
  int64_t slot_bytes = 0;
  uint64_t* tail = nullptr;  // [channels, links]: the tails of the rings here, set by senders
  uint64_t* head = nullptr;  // [channels, links]: the heads of this rank's send rings, set by
                             // their receivers
  char* recv = nullptr;      // [channels, links, ring_slots(), slot_bytes]: the rings here
  char* send = nullptr;      // the same shape, over puts: the send rings, the slots this rank
                             // puts into its ring in each receiver
  int64_t* state = nullptr;  // [channels, links, kStateWords]: this rank's own counters, never
                             // reached by peers (RingState)

  JAX_EP_HOST_DEVICE int64_t ring_slots() const {
    return static_cast<int64_t>(chunk_tokens) * ring_chunks;
  }
  JAX_EP_HOST_DEVICE int64_t ring(int c, int link) const {
    return static_cast<int64_t>(c) * links + link;
  }
  // Slot n (counted from the start of the op) of ring (c, link) in an area of rings.
  JAX_EP_HOST_DEVICE char* slot(char* area, int c, int link, int64_t n) const {
    return area + (ring(c, link) * ring_slots() + n % ring_slots()) * slot_bytes;
  }
  // Per send ring (c, l): slots sent and published, where the sender's scan is (a token, the
  // combine's), and the head last read; per receive ring (c, l): slots consumed, the tail
  // last read, and the head last returned to the sender.
  enum RingState { kSent, kPublished, kCursor, kHead, kConsumed, kSeen, kReleased, kStateWords };
  JAX_EP_HOST_DEVICE int64_t& at(int c, int link, RingState word) const {
    return state[kStateWords * ring(c, link) + word];
  }
  JAX_EP_HOST_DEVICE int64_t& sent(int c, int l) const { return at(c, l, kSent); }
  JAX_EP_HOST_DEVICE int64_t& published(int c, int l) const { return at(c, l, kPublished); }
  JAX_EP_HOST_DEVICE int64_t& consumed(int c, int l) const { return at(c, l, kConsumed); }
  // Channel c's tokens of T: [first, end).
  JAX_EP_HOST_DEVICE int first_token(int c, int T) const {
    return static_cast<int>(static_cast<int64_t>(c) * T / channels);
  }
};

// The ring between this rank and a peer, seen from this rank: `here`, its index among this
// rank's links (its send state, head and send ring as the sender; its tail, slots and
// consumed count as the receiver); `there`, its index among the peer's; `rank`, the peer.
// Within one node a ring's index is its other end's rank (flat_link); node-aware, rings
// between the ranks of a node and to the relays have their own numbers (dispatch_stream.h).
struct RingLink {
  int here, there, rank;
};
JAX_EP_HOST_DEVICE RingLink flat_link(int me, int peer) { return {peer, me, peer}; }

// ---------------------------------------------------------------------------------------------
// Waiting: a streaming launch's Watch, which the platform provides:
//   bool failed() const;               a wait of this op gave up (stop)
//   uint64_t now() const;              nanoseconds, for the timeouts
//   uint64_t limit() const;            the op timeout, nanoseconds
//   void pause() const;                a short back-off between polls
//   void give_up(RingWaitKind, int peer, int channel, uint64_t have, uint64_t want) const;
//                                      records why a ring wait gave up (the leader calls it)

// The bound of a polling loop: the op timeout since the last progress. Every lane of the warp
// calls again() with the same `moved`; the leader alone reads the clock and the Watch and
// decides, and every lane follows its verdict (a lane that read the status word a moment
// later could otherwise leave the loop alone, and the warp's next full-mask shuffle would
// miss it).
template <typename Watch>
class Patience {
 public:
  JAX_EP_HOST_DEVICE Patience(const Watch& watch, const Warp& w)
      : watch_(watch), w_(w), start_(w.leader() ? watch.now() : 0) {}
  // After a round of polls, which `moved` something or not: whether to poll again. False when
  // a wait of this op gave up elsewhere, or nothing moved for the op timeout (expired()).
  JAX_EP_HOST_DEVICE bool again(bool moved) {
    enum Verdict { kAgain, kFailed, kExpired };
    int verdict = kAgain;
    if (w_.leader()) {
      if (moved) {
        start_ = watch_.now();
      } else if (watch_.failed()) {
        verdict = kFailed;
      } else if (watch_.now() - start_ > watch_.limit()) {
        verdict = kExpired;
      } else {
        watch_.pause();
      }
    }
    verdict = w_.shared(verdict);
    expired_ = verdict == kExpired;
    return verdict == kAgain;
  }
  JAX_EP_HOST_DEVICE bool expired() const { return expired_; }

 private:
  const Watch& watch_;
  const Warp& w_;
  uint64_t start_;
  bool expired_ = false;
};

// ---------------------------------------------------------------------------------------------
// The ring protocol (this rank's end of ring (c, l))

// Makes slots [published, upto) of send ring (c, l) visible to its receiver, with the closed
// bit when `closed`: over puts one put of the range (within one chunk, so contiguous) with the
// tail's signal; over stores (the slots are in the receiver's ring already) the tail, after a
// fence.
template <typename Peers>
JAX_EP_HOST_DEVICE void ring_publish(const Rings& g, const Peers& peers, int c, RingLink l,
                                     int64_t upto, bool closed, const Warp& w) {
  const int64_t from = g.published(c, l.here);
  uint64_t* tail = g.tail + g.ring(c, l.there);
  const uint64_t value = static_cast<uint64_t>(upto) | (closed ? kRingClosed : 0);
  bool sent = false;
  if constexpr (Peers::kPuts) {
    // The lanes wrote the slots into this rank's send ring for the NIC to read: a full fence
    // before the put. Its signal adds the slots (and the closed bit) to the tail.
    w.fence();
    if (upto > from) {
      char* dst = g.slot(g.recv, c, l.there, from);
      const char* src = g.slot(g.send, c, l.here, from);
      const int64_t bytes = (upto - from) * g.slot_bytes;
      const uint64_t delta = value - static_cast<uint64_t>(from);
      w.each([&](int lane) {
        peers.put_signal_add(dst, l.rank, src, bytes, tail, delta, lane, w.lanes);
      });
      sent = true;
    }
  } else {
    // The warp's slot stores come before the leader's release of the tail (its release store
    // makes what the warp barrier ordered before it visible with it).
    w.sync();
  }
  if (w.leader()) {
    // Without slots to put, the closed bit follows the ring's earlier puts (a tail that
    // showed it before their slots would end the receiver's drain early).
    if (!sent) move_counter(peers, tail, l.rank, static_cast<uint64_t>(from), value, true);
    g.published(c, l.here) = upto;
  }
  w.sync();
}

// Where this rank writes slot n of send ring (c, l): straight into the receiver's ring through
// a store view; over puts into this rank's send ring, which ring_publish puts.
template <typename Peers>
JAX_EP_HOST_DEVICE char* ring_write_slot(const Rings& g, const Peers& peers, int c, RingLink l,
                                         int64_t n) {
  if constexpr (Peers::kPuts) {
    return g.slot(g.send, c, l.here, n);
  } else {
    return peers.at(g.slot(g.recv, c, l.there, n), 0, l.rank);
  }
}

// Send ring (c, l)'s head: the slots its receiver consumed, in every lane.
JAX_EP_HOST_DEVICE int64_t ring_head(const Rings& g, int c, int l, const Warp& w) {
  const uint64_t* counter = g.head + g.ring(c, l);
  const uint64_t head = w.shared(w.leader() ? load_acquire(counter) : uint64_t{0});
  w.sync();  // the leader's acquire orders every lane's accesses after it
  return static_cast<int64_t>(head);
}

// Opens send ring (c, l) for an op (its sender's leader): nothing sent, published or consumed.
JAX_EP_HOST_DEVICE void ring_open(const Rings& g, int c, int l) {
  g.sent(c, l) = g.published(c, l) = g.at(c, l, Rings::kHead) = 0;
}

// Opens receive ring (c, l) for an op (its receiver's leader): nothing consumed, seen or
// returned.
JAX_EP_HOST_DEVICE void ring_receive_open(const Rings& g, int c, int l) {
  g.consumed(c, l) = g.at(c, l, Rings::kSeen) = g.at(c, l, Rings::kReleased) = 0;
}

// Reads send ring (c, l)'s head again and keeps it (kHead); returns it, in every lane.
JAX_EP_HOST_DEVICE int64_t ring_refresh_head(const Rings& g, int c, int l, const Warp& w) {
  const int64_t head = ring_head(g, c, l, w);
  if (w.leader()) g.at(c, l, Rings::kHead) = head;
  w.sync();
  return head;
}

// Whether send ring (c, l) has a free slot for its next one: by the head last read, which is
// read again (an acquire over the link) only when the ring looks full by it. The slots below
// the head last read were free when it was read, so the cached head never lets a slot be
// overwritten before its receiver read it.
JAX_EP_HOST_DEVICE bool ring_has_space(const Rings& g, int c, int l, const Warp& w) {
  const int64_t sent = g.sent(c, l);
  if (sent - g.at(c, l, Rings::kHead) < g.ring_slots()) return true;
  return sent - ring_refresh_head(g, c, l, w) < g.ring_slots();
}

// Waits until send ring (c, l) has a free slot, publishing what it holds first so that the
// receiver can drain it. False when the wait gave up.
template <typename Peers, typename Watch>
JAX_EP_HOST_DEVICE bool ring_reserve(const Rings& g, const Peers& peers, int c, RingLink l,
                                     const Warp& w, const Watch& watch) {
  if (ring_has_space(g, c, l.here, w)) return true;
  const int64_t sent = g.sent(c, l.here);
  if (g.published(c, l.here) < sent) ring_publish(g, peers, c, l, sent, false, w);
  Patience<Watch> patience(watch, w);
  int64_t consumed = 0;
  do {
    consumed = ring_refresh_head(g, c, l.here, w);
    if (sent - consumed < g.ring_slots()) return true;
  } while (patience.again(false));
  if (patience.expired() && w.leader()) {
    watch.give_up(RingWaitKind::kSpace, l.rank, c, consumed, sent);
  }
  return false;
}

// Counts one more slot written into send ring (c, l), publishing at the end of each chunk.
template <typename Peers>
JAX_EP_HOST_DEVICE void ring_advance(const Rings& g, const Peers& peers, int c, RingLink l,
                                     const Warp& w) {
  const int64_t n = g.sent(c, l.here) + 1;
  w.sync();  // every lane read it before the leader changes it
  if (w.leader()) g.sent(c, l.here) = n;
  w.sync();
  if (n % g.chunk_tokens == 0) ring_publish(g, peers, c, l, n, false, w);
}

// Receive ring (c, l)'s tail, in every lane.
JAX_EP_HOST_DEVICE uint64_t ring_tail(const Rings& g, int c, int l, const Warp& w) {
  const uint64_t* counter = g.tail + g.ring(c, l);
  const uint64_t tail = w.shared(w.leader() ? load_acquire(counter) : uint64_t{0});
  w.sync();  // the leader's acquire orders every lane's reads of the slots after it
  return tail;
}

// Returns the slots of receive ring (c, l) consumed so far to its sender (its head), after
// the lanes' reads of them: the warp barrier orders the lanes' loads (their values already
// stored elsewhere) before the leader's release of the head, or its signal over puts (the
// slots consumed since the last, none if none; it follows no put of this rank's).
template <typename Peers>
JAX_EP_HOST_DEVICE void ring_release(const Rings& g, const Peers& peers, int c, RingLink l,
                                     const Warp& w) {
  w.sync();
  if (w.leader()) {
    int64_t& released = g.at(c, l.here, Rings::kReleased);
    const int64_t consumed = g.consumed(c, l.here);
    move_counter(peers, g.head + g.ring(c, l.there), l.rank, static_cast<uint64_t>(released),
                 static_cast<uint64_t>(consumed), false);
    released = consumed;
  }
  w.sync();
}

// This rank's ring counters of g (tails, then heads: 2 x channels x links), zeroed one by one
// before the launch that zeroes them meets the peers, who write them only after.
JAX_EP_HOST_DEVICE int64_t ring_counters(const Rings& g) {
  return 2 * static_cast<int64_t>(g.channels) * g.links;
}
JAX_EP_HOST_DEVICE void zero_ring_counter(const Rings& g, int64_t i) {
  const int64_t half = ring_counters(g) / 2;
  (i < half ? g.tail[i] : g.head[i - half]) = 0;
}

}  // namespace jax_ep
