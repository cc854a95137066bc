// The exchange between ranks that each hold one rank (V = 1), written once for every peer
// platform: the GPUs through NVSHMEM (cuda/peer_exchange.cu) and the CPU devices of one
// process through host memory (cuda/host_peers.cc). The phases are the bodies of
// cuda/exchange.h; this file adds what the ranks must agree on: the carving of the symmetric
// buffer, the order of phases and barriers, and the copies out to the results XLA owns.
//
// Symmetric buffer: the same size on every rank, and each rank's buffer reachable by the
// others through the platform's Peers view. Layout: [0, 4 KiB) barrier signals (one uint64
// per peer); normal-mode regions from 4 KiB upwards; low-latency regions at the end, so that a
// split low-latency dispatch or combine in flight is not overwritten by normal-mode ops.
//
// A Platform P provides:
//   using Peers; Peers peers() const;        the view that turns a symmetric address into a
//                                             peer's copy of it
//   int rank() const;                         this rank
//   char* symmetric() const; size_t bytes() const;   this rank's symmetric buffer
//   void barrier(int op);                     every rank meets; earlier writes are visible
//   void per_thread(phase, items), per_warp(phase, items)   runs a phase for this rank
//   void copy(void* dst, const void* src, int64_t bytes)
//   PeerError result(int op);                 the first failure of the steps above, if any
// Steps after a failure do nothing, so the ops below read as straight sequences.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda/phase_functors.h"

namespace jax_ep {

struct PeerError {
  std::string message;
  bool ok() const { return message.empty(); }
};

constexpr size_t kSignalBytes = 4096;
constexpr int kMaxPeers = static_cast<int>(kSignalBytes / sizeof(uint64_t));
constexpr size_t kAlign = 256;

enum PeerOp { kPeerDispatch, kPeerCombine, kPeerLlDispatchSend, kPeerLlDispatchRecv,
              kPeerLlCombineSend, kPeerLlCombineRecv };
inline const char* const kPeerOpNames[] = {
    "jax_ep_dispatch", "jax_ep_combine", "jax_ep_ll_dispatch_send",
    "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv"};

// Consecutive, aligned pieces of a symmetric region.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    used_ = (used_ + kAlign - 1) / kAlign * kAlign;
    T* out = reinterpret_cast<T*>(base_ + used_);
    used_ += static_cast<size_t>(count) * sizeof(T);
    return out;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

inline PeerError too_small(int op, size_t needed, size_t bytes) {
  return PeerError{std::string(kPeerOpNames[op]) + ": needs " + std::to_string(needed) +
                   " bytes of symmetric buffer, but jax_ep.initialize() allocated " +
                   std::to_string(bytes) +
                   "; initialize with a configuration as large as this call "
                   "(jax_ep.runtime.BufferConfig)"};
}

// Low-latency regions sit at the end of the buffer: [end - bytes, end).
struct LowLatencyRegions {
  int32_t* counts;
  char* recv_x;
  float* recv_scales;
  int32_t* src_row;
  Bf16* staging;
  size_t bytes;
};

inline LowLatencyRegions ll_regions(char* symmetric, size_t total, int R, int T, int K, int E,
                                    int H, bool fp8) {
  const int64_t slots = static_cast<int64_t>(E / R) * R * T;
  LowLatencyRegions r{};
  auto carve = [&](char* base) {
    Carver c(base);
    r.counts = c.take<int32_t>(static_cast<int64_t>(R) * E);
    r.recv_x = c.take<char>(slots * (fp8 ? H : 2 * H));
    r.recv_scales = c.take<float>(fp8 ? slots * (H / kFp8Block) : 0);
    r.src_row = c.take<int32_t>(static_cast<int64_t>(R) * T * K);
    r.staging = c.take<Bf16>(static_cast<int64_t>(T) * K * H);
    return c.used();
  };
  r.bytes = (carve(symmetric) + kAlign - 1) / kAlign * kAlign;  // the size first
  if (r.bytes + kSignalBytes <= total) carve(symmetric + (total - r.bytes) / kAlign * kAlign);
  return r;
}

template <typename Platform>
PeerError run_dispatch(Platform& p, const DispatchArgs& out) {
  constexpr int op = kPeerDispatch;
  const int R = out.num_ranks, me = p.rank();
  DispatchArgs a = out;
  a.first_rank = me;
  const int cap = a.capacity, K = a.top_k, rows = a.rows(), cols = a.idx_cols();
  const bool em = a.expert_major;
  Carver c(p.symmetric() + kSignalBytes);
  a.counts = c.take<int32_t>(static_cast<int64_t>(R) * a.num_counters());
  a.recv_x = c.take<char>(cap * a.row_bytes);
  a.recv_scales = c.take<float>(cap * a.scale_cols);
  a.recv_idx = c.take<int32_t>(static_cast<int64_t>(cap) * cols);
  a.recv_weights = c.take<float>(static_cast<int64_t>(cap) * cols);
  a.recv_src = c.take<int32_t>(rows);
  a.src_row = c.take<int32_t>(static_cast<int64_t>(R) * a.num_tokens);
  a.entry_row = c.take<int32_t>(em ? cap : 0);
  a.entry_choice = c.take<int32_t>(em ? cap : 0);
  a.row_entries = c.take<int32_t>(em ? static_cast<int64_t>(rows) * K : 0);
  if (kSignalBytes + c.used() > p.bytes()) {
    return too_small(op, kSignalBytes + c.used(), p.bytes());
  }
  using Peers = typename Platform::Peers;
  p.barrier(op);  // peers are done with the last op's data
  p.per_warp(DispatchCount<Peers>{a, p.peers()}, a.num_counters() + 1);
  p.barrier(op);  // every rank's counts are here
  p.per_thread(DispatchBases{a}, a.num_counters());
  p.per_warp(DispatchSend<Peers>{a, p.peers()}, a.num_tokens);
  p.barrier(op);  // every row has arrived
  p.per_warp(DispatchFinish<Peers>{a, p.peers()}, std::max({cap, rows, a.experts_per_rank()}));
  // Copy out what XLA owns.
  p.copy(out.recv_x, a.recv_x, cap * a.row_bytes);
  p.copy(out.recv_scales, a.recv_scales, cap * a.scale_cols * 4);
  p.copy(out.recv_idx, a.recv_idx, int64_t{4} * cap * cols);
  p.copy(out.recv_weights, a.recv_weights, int64_t{4} * cap * cols);
  p.copy(out.recv_src, a.recv_src, int64_t{4} * rows);
  p.copy(out.src_row, a.src_row, int64_t{4} * R * a.num_tokens);
  if (em) {
    p.copy(out.entry_row, a.entry_row, int64_t{4} * cap);
    p.copy(out.entry_choice, a.entry_choice, int64_t{4} * cap);
    p.copy(out.row_entries, a.row_entries, int64_t{4} * rows * K);
  }
  return p.result(op);
}

template <typename Platform, typename T>
PeerError run_combine(Platform& p, const CombineArgs<T>& in) {
  constexpr int op = kPeerCombine;
  const int R = in.num_ranks;
  CombineArgs<T> a = in;
  a.first_rank = p.rank();
  const int64_t H = a.hidden, rows = static_cast<int64_t>(R) * a.num_tokens;
  const bool em = a.expert_major;
  // What peers read: the rows (or the per-row partial sums), their weights, src_row.
  Carver c(p.symmetric() + kSignalBytes);
  T* y = c.take<T>(em ? 0 : a.capacity * H);
  float* weights = c.take<float>(!em && a.weights ? a.capacity : 0);
  int32_t* src_row = c.take<int32_t>(rows);
  T* partial = c.take<T>(em ? rows * H : 0);
  if (kSignalBytes + c.used() > p.bytes()) {
    return too_small(op, kSignalBytes + c.used(), p.bytes());
  }
  p.barrier(op);  // peers are done reading the last op's data
  if (!em) p.copy(y, in.y, a.capacity * H * int64_t{sizeof(T)});
  if (!em && a.weights) p.copy(weights, in.weights, int64_t{4} * a.capacity);
  p.copy(src_row, in.src_row, int64_t{4} * rows);
  a.src_row = src_row;
  if (!em) {
    a.y = y;
    a.weights = a.weights ? weights : nullptr;
  } else {
    a.partial = partial;  // reduce_entries reads the local y, row_entries and weights
    p.per_warp(CombineReduceEntries<T>{a}, rows);
  }
  p.barrier(op);  // every rank's rows are in place
  p.per_warp(CombineToken<T, typename Platform::Peers>{a, p.peers()}, a.num_tokens);
  return p.result(op);
}

// The low-latency regions of one call, or why they do not fit.
template <typename Platform>
PeerError open_ll(Platform& p, int op, int R, int T, int K, int E, int H, bool fp8,
                  LowLatencyRegions* r) {
  *r = ll_regions(p.symmetric(), p.bytes(), R, T, K, E, H, fp8);
  if (r->bytes + kSignalBytes > p.bytes()) {
    return too_small(op, r->bytes + kSignalBytes, p.bytes());
  }
  return PeerError{};
}

template <typename Platform>
PeerError run_ll_dispatch_send(Platform& p, const LowLatencyArgs& out) {
  constexpr int op = kPeerLlDispatchSend;
  LowLatencyRegions r;
  PeerError error = open_ll(p, op, out.num_ranks, out.num_tokens, out.top_k, out.num_experts,
                            out.hidden, out.use_fp8, &r);
  if (!error.ok()) return error;
  LowLatencyArgs a = out;
  a.first_rank = p.rank();
  a.counts = r.counts;
  a.recv_x = r.recv_x;
  a.recv_scales = r.recv_scales;
  a.src_row = r.src_row;
  using Peers = typename Platform::Peers;
  p.barrier(op);  // peers are done with the last low-latency dispatch's data
  p.per_warp(LowLatencyCount<Peers>{a, p.peers()}, a.num_experts + 1);
  p.barrier(op);  // every rank's counts are here
  p.per_warp(LowLatencySend<Peers>{a, p.peers()}, a.num_tokens);
  return p.result(op);
}

template <typename Platform>
PeerError run_ll_dispatch_recv(Platform& p, const LowLatencyArgs& out) {
  constexpr int op = kPeerLlDispatchRecv;
  LowLatencyRegions r;
  PeerError error = open_ll(p, op, out.num_ranks, out.num_tokens, out.top_k, out.num_experts,
                            out.hidden, out.use_fp8, &r);
  if (!error.ok()) return error;
  LowLatencyArgs a = out;
  a.first_rank = p.rank();
  a.counts = r.counts;
  a.recv_x = r.recv_x;
  a.recv_scales = r.recv_scales;
  const int64_t slots = a.experts_per_rank() * a.slots();
  const int64_t scale_bytes = a.use_fp8 ? slots * (a.hidden / kFp8Block) * 4 : 0;
  p.barrier(op);  // every message has arrived
  p.per_warp(LowLatencyFinish<typename Platform::Peers>{a, p.peers()}, slots);
  p.copy(out.recv_x, r.recv_x, slots * a.row_bytes());
  p.copy(out.recv_scales, r.recv_scales, scale_bytes);
  p.copy(out.src_row, r.src_row, int64_t{4} * a.num_ranks * a.num_tokens * a.top_k);
  return p.result(op);
}

// Both halves of low-latency combine: the send pushes rows into the homes' staging slots
// (after the homes are done with them), the receive sums them (after they all arrived).
template <typename Platform>
PeerError run_ll_combine(Platform& p, int op, const LowLatencyCombineArgs& in) {
  LowLatencyRegions r;
  PeerError error = open_ll(p, op, in.num_ranks, in.num_tokens, in.top_k, in.num_experts,
                            in.hidden, false, &r);
  if (!error.ok()) return error;
  LowLatencyCombineArgs a = in;
  a.first_rank = p.rank();
  a.staging = r.staging;
  p.barrier(op);
  if (op == kPeerLlCombineSend) {
    p.per_warp(LowLatencyCombineSend<typename Platform::Peers>{a, p.peers()},
               int64_t{a.num_ranks} * a.num_tokens);
  } else {
    p.per_warp(LowLatencyCombineToken{a}, a.num_tokens);
  }
  return p.result(op);
}

}  // namespace jax_ep
