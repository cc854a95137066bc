// The phases of cuda/exchange.h as function objects, for any launcher: the CUDA kernels
// (cuda/phases.cuh) and the CPU's emulated grids (cuda/host_launch.h). A functor holds the
// op's arguments and, for phases that reach other ranks, the Peers view (passed by value:
// kernel arguments on the GPU). A phase is called per (rank, item) and warp lane; a tail,
// which runs once after every item of its launch, per item alone (NoTail).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/exchange.h"

namespace jax_ep {

// A launch without a tail. A tail runs in the block that finishes its launch last, after
// every item: early(i) for i < early_items() (one thread each), then publish(i, lane, lanes)
// for i < publish_items() (one warp each: what the early items computed, sent to the peers),
// before the launch meets the peers (what they need from it), then (i) for i < items() after
// (what needs theirs).
struct NoTail {
  JAX_EP_HOST_DEVICE int64_t early_items() const { return 0; }
  JAX_EP_HOST_DEVICE int64_t publish_items() const { return 0; }
  JAX_EP_HOST_DEVICE int64_t items() const { return 0; }
  JAX_EP_HOST_DEVICE void early(int64_t) const {}
  JAX_EP_HOST_DEVICE void publish(int64_t, int, int) const {}
  JAX_EP_HOST_DEVICE void operator()(int64_t) const {}
};

// Whether a launch has work after its items: a tail, or a meeting of its peers at the end
// (the block, or on the CPU the unit, that finishes last runs it).
template <typename Tail, typename Meeting>
JAX_EP_HOST_DEVICE bool runs_after(const Tail& tail, const Meeting& meet) {
  return tail.early_items() > 0 || tail.publish_items() > 0 || tail.items() > 0 ||
         meet.has_last();
}

// A launch that meets no other rank (virtual ranks). Between devices a Meet (cuda/peer_ops.h)
// has first(), run by every block before its items, done(), by every thread after its items
// (over NVSHMEM's puts: each completes its own before its block counts itself finished), and
// last(), by the block that finishes last after every block's items; waits_first() and
// has_last() say whether first() and last() do anything; failed(), whether a wait gave up
// (the op fails, the peers' data may not be there): the items and the tail then do not run.
struct NoMeet {
  JAX_EP_HOST_DEVICE bool waits_first() const { return false; }
  JAX_EP_HOST_DEVICE bool has_last() const { return false; }
  JAX_EP_HOST_DEVICE void first() const {}
  JAX_EP_HOST_DEVICE void done() const {}
  JAX_EP_HOST_DEVICE void last() const {}
  JAX_EP_HOST_DEVICE bool failed() const { return false; }
};

// The copy phases (they move rows and little else) declare kCopy true: their kernels are built for
// kCopyBlocksPerSm blocks per SM, which bounds them to 64 registers (65536 per SM / (4 * 256
// threads)), so that an SM holds 32 warps of copies, each lane with kWordsInFlight loads in
// flight. That fits the Hopper code, which is tuned; the other architectures' code (not yet
// run on their GPUs) spills within 64 registers, so it is built for 2 blocks (128 registers).
// The other phases take what registers they need (the ordered sums hold 4 rows' packs).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 900
constexpr int kCopyBlocksPerSm = 2;
#else
constexpr int kCopyBlocksPerSm = 4;
#endif
template <typename Phase, typename = void>
struct MinBlocksPerSm : std::integral_constant<int, 1> {};
template <typename Phase>
struct MinBlocksPerSm<Phase, std::void_t<decltype(Phase::kCopy)>>
    : std::integral_constant<int, Phase::kCopy ? kCopyBlocksPerSm : 1> {};

// Calls f(std::integral_constant<int, wire>) for a wire format (cuda/wire.h).
template <typename F>
void with_wire(int wire, const F& f) {
  switch (wire) {
    case kWireE4m3: return f(std::integral_constant<int, kWireE4m3>{});
    case kWireE4m3Ue8m0: return f(std::integral_constant<int, kWireE4m3Ue8m0>{});
    case kWireMxfp8: return f(std::integral_constant<int, kWireMxfp8>{});
    case kWireNvfp4: return f(std::integral_constant<int, kWireNvfp4>{});
    default: return f(std::integral_constant<int, kWireBf16>{});
  }
}

// Calls f(std::bool_constant<b>).
template <typename F>
void with_bool(bool b, const F& f) {
  return b ? f(std::true_type{}) : f(std::false_type{});
}

// Returns f(std::bool_constant<kCast>): whether a combine of T rows casts them to the wire
// format `wire` (bfloat16 rows only: the others never do, and their casting kernels are not
// built).
template <typename T, typename F>
auto with_cast(int wire, const F& f) {
  if constexpr (std::is_same_v<T, Bf16>) {
    if (wire != kWireBf16) return f(std::true_type{});
  }
  return f(std::false_type{});
}

struct DispatchCount {
  DispatchArgs a;
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t g, int lane, int lanes) const {
    dispatch_count(a, s, static_cast<int>(g), lane, lanes);
  }
};
// The tail of DispatchCount for its sources [first, first + ranks): their totals, published
// (a row per source and rank) before the launch meets the peers, and, once every rank's are
// here, their bases.
template <typename Peers>
struct DispatchTail {
  DispatchArgs a;
  int first, ranks;
  Peers peers{};
  // Streamed (between devices), also this rank's ring counters (node rings, then relay
  // rings), zeroed before the launch meets the peers (who write them only after).
  JAX_EP_HOST_DEVICE int64_t ring_counters() const {
    return a.rings.channels > 0 ? jax_ep::ring_counters(a.rings) + jax_ep::ring_counters(a.relays)
                                : 0;
  }
  JAX_EP_HOST_DEVICE int64_t early_items() const {
    return static_cast<int64_t>(ranks) * (a.num_counters() + 1) + ring_counters();
  }
  JAX_EP_HOST_DEVICE int64_t publish_items() const {
    return static_cast<int64_t>(ranks) * a.num_ranks;
  }
  JAX_EP_HOST_DEVICE int64_t items() const { return a.num_counters(); }
  JAX_EP_HOST_DEVICE void early(int64_t i) const {
    const int64_t published = static_cast<int64_t>(ranks) * (a.num_counters() + 1);
    if (i >= published) {
      const int64_t j = i - published, node = jax_ep::ring_counters(a.rings);
      j < node ? zero_ring_counter(a.rings, j) : zero_ring_counter(a.relays, j - node);
      return;
    }
    const int n = a.num_counters() + 1, s = first + static_cast<int>(i / n);
    count_total(a.chunk_counts + a.local(s) * a.num_chunks * n, a.num_chunks, n,
                static_cast<int>(i % n), a.counts + static_cast<int64_t>(s) * a.num_counters(),
                a.num_invalid + a.local(s));
  }
  JAX_EP_HOST_DEVICE void publish(int64_t i, int lane, int lanes) const {
    const int s = first + static_cast<int>(i / a.num_ranks), n = a.num_counters();
    publish_totals(peers, a.counts + static_cast<int64_t>(s) * n, n,
                   static_cast<int>(i % a.num_ranks), s, lane, lanes);
  }
  JAX_EP_HOST_DEVICE void operator()(int64_t c) const {
    dispatch_bases(a, first, ranks, static_cast<int>(c));
  }
};
// kWire: the send casts the rows (DispatchArgs::wire), one kernel per format as the
// low-latency send's (LowLatencySend), so that the plain send keeps its code and registers.
// A cast computes more than it copies, beside the dispatch's lookup of each row's place:
// within a copy phase's 64 registers the FP8 casts spill (virtual ranks, Hopper), so the
// casting sends take the registers they need.
template <typename Peers, int kWire = kWireBf16>
struct DispatchSend {
  static constexpr bool kCopy = kWire == kWireBf16;
  DispatchArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t t, int lane, int lanes) const {
    dispatch_send<kWire>(a, peers, s, static_cast<int>(t), lane, lanes);
  }
};
// Put views: each token's row and scales (kWire: cast) into the send area, and its metadata
// to the receivers, before the send. Not a copy phase: NVSHMEM's code for the metadata's puts
// needs more than a copy phase's 64 registers.
template <typename Peers, int kWire = kWireBf16>
struct DispatchStage {
  DispatchArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t t, int lane, int lanes) const {
    dispatch_stage<kWire>(a, peers, s, static_cast<int>(t), lane, lanes);
  }
};
// Node-aware: each relay stores the tokens it received into the receivers of its node (a store
// view of them).
template <typename Peers>
struct DispatchRelay {
  static constexpr bool kCopy = true;
  DispatchArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int me, int64_t slot, int lane, int lanes) const {
    dispatch_relay(a, peers, me, slot, lane, lanes);
  }
};
// kDequantize: the rows dequantized into bfloat16 results (DispatchArgs::dequantize), a
// kernel of its own (computing, not a copy) so that the plain finish keeps its code.
template <typename Peers, bool kDequantize = false>
struct DispatchFinish {
  static constexpr bool kCopy = !kDequantize;
  DispatchArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t i, int lane, int lanes) const {
    dispatch_finish<kDequantize>(a, peers, d, static_cast<int>(i), lane, lanes);
  }
};
// kCast: the stages cast the rows to the wire format (a.wire) as they stage them, the sums
// dequantize them (cuda/combine.h).
template <typename T, bool kCast = false>
struct CombineStage {
  static constexpr bool kCopy = !kCast;
  CombineArgs<T> a;
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t src, int lane, int lanes) const {
    combine_stage<kCast>(a, d, src, lane, lanes);
  }
};
template <typename T, bool kCast = false>
struct CombinePartial {
  CombineArgs<T> a;
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t src, int lane, int lanes) const {
    combine_partial<kCast>(a, d, src, lane, lanes);
  }
};
// Put views: the receivers return the rows to the tokens' homes.
template <typename T, typename Peers>
struct CombineReturn {
  static constexpr bool kCopy = true;
  CombineArgs<T> a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t src, int lane, int lanes) const {
    combine_return(a, peers, d, src, lane, lanes);
  }
};
template <typename T, typename Peers, bool kCast = false>
struct CombineToken {
  CombineArgs<T> a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t t, int lane, int lanes) const {
    combine_token<kCast>(a, peers, s, static_cast<int>(t), lane, lanes);
  }
};
template <typename T, typename Peers>
struct CombineTokenEntries {
  CombineArgs<T> a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t t, int lane, int lanes) const {
    combine_token_entries(a, peers, s, static_cast<int>(t), lane, lanes);
  }
};
struct LowLatencyCount {
  LowLatencyArgs a;
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t g, int lane, int lanes) const {
    ll_count(a, s, static_cast<int>(g), lane, lanes);
  }
};
// The tail of LowLatencyCount for its sources [first, first + ranks): their totals; with
// every rank of the group here, then the receive's count of each expert (its messages from
// every source), so that the receive has nothing left to do.
template <typename Peers>
struct LowLatencyTotals {
  LowLatencyArgs a;
  int first, ranks;
  Peers peers{};
  JAX_EP_HOST_DEVICE int64_t early_items() const {
    return static_cast<int64_t>(ranks) * (a.num_experts + 1);
  }
  JAX_EP_HOST_DEVICE int64_t publish_items() const {
    return static_cast<int64_t>(ranks) * a.num_ranks;
  }
  JAX_EP_HOST_DEVICE int64_t items() const { return ranks == a.num_ranks ? a.num_experts : 0; }
  JAX_EP_HOST_DEVICE void early(int64_t i) const {
    const int n = a.num_experts + 1, s = first + static_cast<int>(i / n);
    count_total(a.chunk_counts + a.local(s) * a.num_chunks * n, a.num_chunks, n,
                static_cast<int>(i % n), a.counts + static_cast<int64_t>(s) * a.num_experts,
                a.num_invalid + a.local(s));
  }
  JAX_EP_HOST_DEVICE void publish(int64_t i, int lane, int lanes) const {
    const int s = first + static_cast<int>(i / a.num_ranks), E = a.num_experts;
    publish_totals(peers, a.counts + static_cast<int64_t>(s) * E, E,
                   static_cast<int>(i % a.num_ranks), s, lane, lanes);
  }
  JAX_EP_HOST_DEVICE void operator()(int64_t e) const {
    int32_t count = 0;
    for (int s = 0; s < a.num_ranks; ++s) count += a.counts[s * a.num_experts + e];
    a.count[e] = count;  // [R, E/R]: expert e's rank, then its index there
  }
};
// One kernel per wire format: in one, the casts would hold more registers than any of them.
// with_ll_send picks the one of the args. The NVFP4 cast computes more than it copies (a
// correctly rounded reciprocal per block): its kernel takes the registers it needs.
template <typename Peers, int kWire>
struct LowLatencySend {
  static constexpr bool kCopy = kWire != kWireNvfp4;
  LowLatencyArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t item, int lane, int lanes) const {
    ll_send<kWire>(a, peers, s, item, lane, lanes);
  }
  int64_t items() const { return ll_send_items(a); }
};
// Between devices, the tail of a send that numbers its messages itself (counts_in_send): its
// row of counts, one put (or the stores) to every other rank, before it tells them it is done.
template <typename Peers>
struct LowLatencySendTail {
  LowLatencyArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE int64_t early_items() const { return 0; }
  JAX_EP_HOST_DEVICE int64_t publish_items() const {
    return a.counts_in_send() && a.per_source_slots ? a.num_ranks : 0;
  }
  JAX_EP_HOST_DEVICE int64_t items() const { return 0; }
  JAX_EP_HOST_DEVICE void early(int64_t) const {}
  JAX_EP_HOST_DEVICE void publish(int64_t d, int lane, int lanes) const {
    const int s = a.first_rank, E = a.num_experts;
    publish_totals(peers, a.counts + static_cast<int64_t>(s) * E, E, static_cast<int>(d), s,
                   lane, lanes);
  }
  JAX_EP_HOST_DEVICE void operator()(int64_t) const {}
};
template <typename Peers, typename Launch>
void with_ll_send(const LowLatencyArgs& a, const Peers& peers, const Launch& launch) {
  with_wire(a.wire, [&](auto wire) { launch(LowLatencySend<Peers, wire.value>{a, peers}); });
}
// Put views: the row of each token into the send area, before the send (ll_stage).
template <int kWire>
struct LowLatencyStage {
  static constexpr bool kCopy = true;
  LowLatencyArgs a;
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t item, int lane, int lanes) const {
    ll_stage<kWire>(a, s, item, lane, lanes);
  }
  int64_t items() const { return ll_row_items(a.num_tokens, a.hidden, a.send_cut_rows(kWire)); }
};
template <typename Launch>
void with_ll_stage(const LowLatencyArgs& a, const Launch& launch) {
  with_wire(a.wire, [&](auto wire) { launch(LowLatencyStage<wire.value>{a}); });
}
template <typename Peers>
struct LowLatencyFinish {
  static constexpr bool kCopy = true;
  LowLatencyArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t r, int lane, int lanes) const {
    ll_finish(a, peers, d, r, lane, lanes);
  }
};
template <typename Peers>
struct LowLatencyCombineSend {
  static constexpr bool kCopy = true;
  LowLatencyCombineArgs a;
  Peers peers{};
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t src, int lane, int lanes) const {
    ll_combine_send(a, peers, d, src, lane, lanes);
  }
};
// Put views: the rows the combine send returns, into the send area (ll_combine_stage).
struct LowLatencyCombineStage {
  static constexpr bool kCopy = true;
  LowLatencyCombineArgs a;
  JAX_EP_HOST_DEVICE void operator()(int d, int64_t src, int lane, int lanes) const {
    ll_combine_stage(a, d, src, lane, lanes);
  }
};
struct LowLatencyCombineToken {
  LowLatencyCombineArgs a;
  JAX_EP_HOST_DEVICE void operator()(int s, int64_t item, int lane, int lanes) const {
    ll_combine_token(a, s, item, lane, lanes);
  }
  int64_t items() const { return ll_row_items(a.num_tokens, a.hidden, a.num_tokens); }
};

}  // namespace jax_ep
