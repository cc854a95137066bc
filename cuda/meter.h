// What an op does, counted where its code runs on the CPU: the cross-check of the account
// (jax_ep/tools/account.py), which predicts the same numbers from the routing for the GPU.
//
// Counted: launches (phases with items, per rank's stream) and the warps of work in the
// smallest (one per item, every rank's with virtual ranks), barriers between ranks (the
// waits for all peers inside a launch: Meet's before and after), and the bytes of row data
// (token rows, FP8 scales, partial sums) that the phase bodies read and write. Bookkeeping
// (ids, weights, counters, offsets) is not counted: a few bytes per row next to kilobytes.
// Over puts, also the messages: every put and every value put (each a work request on a NIC).
// With replays (ffi/exchange_cpu.cc, $JAX_EP_CPU_REPLAY), the calls recorded and replayed.
// On the GPU the calls compile to nothing.
#pragma once

#include <atomic>
#include <cstdint>

#include "cuda/routing.h"  // JAX_EP_HOST_DEVICE

namespace jax_ep {

struct Meter {
  static constexpr int64_t kNoLaunch = INT64_MAX;
  std::atomic<int64_t> launches{0}, barriers{0}, read{0}, written{0}, messages{0};
  std::atomic<int64_t> smallest{kNoLaunch};  // warps of work in the smallest launch
  std::atomic<int64_t> recordings{0}, replays{0};
};

// The process's meter (jax_ep._ext.meter reads and resets it).
inline Meter& meter() {
  static Meter m;
  return m;
}

// A phase body read and wrote these bytes of row data (counted once per item, by lane 0).
JAX_EP_HOST_DEVICE void meter_rows(int64_t read, int64_t written) {
#if !defined(__CUDA_ARCH__)
  meter().read.fetch_add(read, std::memory_order_relaxed);
  meter().written.fetch_add(written, std::memory_order_relaxed);
#else
  (void)read, (void)written;
#endif
}

// A launch with `warps` warps of work.
inline void meter_launch(int64_t warps) {
  meter().launches.fetch_add(1, std::memory_order_relaxed);
  int64_t smallest = meter().smallest.load(std::memory_order_relaxed);
  while (warps < smallest &&
         !meter().smallest.compare_exchange_weak(smallest, warps, std::memory_order_relaxed)) {
  }
}
inline void meter_barrier() { meter().barriers.fetch_add(1, std::memory_order_relaxed); }
inline void meter_message() { meter().messages.fetch_add(1, std::memory_order_relaxed); }

}  // namespace jax_ep
