// Running the phases of cuda/exchange.h on the CPU the way the GPU launches them
// (cuda/phases.cuh): a grid of blocks of warps of lanes, each unit taking items grid-stride.
//
// The default grid (1 block, 1 warp, 1 lane) is a plain loop: the fastest, and what the CPU
// handlers run unless told otherwise. A GPU-shaped grid (e.g. 2 blocks of 2 warps of 32
// lanes, $JAX_EP_CPU_GRID) runs the code paths only a GPU would: lane-split copies, the
// match counting of Tally, grid-stride loops of several waves. Units run from the
// last to the first, and the lanes of a warp one after another from the last, so a phase that
// depended on the order of its items or lanes (a bug on the GPU, where they run concurrently)
// gives different results here. With several threads a launch's warps are shared among OS
// threads that join at its end, like a kernel boundary (the ThreadSanitizer test uses this).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/channels.h"
#include "cuda/meter.h"
#include "cuda/phase_functors.h"

namespace jax_ep {

struct HostGrid {
  int blocks = 1;   // blocks of a launch
  int warps = 1;    // warps per block
  int lanes = 1;    // lanes per warp (32 on the GPU)
  int threads = 1;  // OS threads sharing a launch

  int64_t num_warps() const { return static_cast<int64_t>(blocks) * warps; }
};

// Parses "blocks,warps,lanes[,threads]" (e.g. "2,2,32"); false on a malformed text.
inline bool parse_host_grid(const char* text, HostGrid* grid) {
  HostGrid g;
  int* fields[] = {&g.blocks, &g.warps, &g.lanes, &g.threads};
  int n = 0;
  const char* p = text;
  for (;;) {
    char* end = nullptr;
    const long value = std::strtol(p, &end, 10);
    if (end == p || value < 1 || value > 1024 || n == 4) return false;
    *fields[n++] = static_cast<int>(value);
    if (*end == '\0') break;
    if (*end != ',') return false;
    p = end + 1;
  }
  if (n < 3) return false;
  *grid = g;
  return true;
}

// Runs unit(u) for every unit u of [0, units), from the last, on grid.threads threads.
template <typename Unit>
void for_units(int64_t units, int threads, const Unit& unit) {
  if (threads <= 1 || units <= 1) {
    for (int64_t u = units - 1; u >= 0; --u) unit(u);
    return;
  }
  std::vector<std::thread> pool;
  const int n = static_cast<int>(threads < units ? threads : units);
  pool.reserve(n);
  for (int t = 0; t < n; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t u = units - 1 - t; u >= 0; u -= n) unit(u);
    });
  }
  for (std::thread& thread : pool) thread.join();
}

// One launch (cuda/phases.cuh per_warp): phase(rank, item, lane, lanes) with one item per
// warp, then, in the unit that finishes last (found with a ticket, as on the GPU), the tail's
// early items, its publish items (all lanes of each), meet.last() and the tail's items, each
// from the last. Every unit runs meet.first() before its items and meet.done() after them. A
// launch with no items still runs when it has a tail or meets its peers.
template <typename Phase, typename Tail = NoTail, typename Meeting = NoMeet>
void host_per_warp(const Phase& phase, int first_rank, int ranks, int64_t items,
                   const HostGrid& grid, const Tail& tail = {}, const Meeting& meet = {}) {
  const int64_t total = static_cast<int64_t>(ranks) * items, units = grid.num_warps();
  const bool after = runs_after(tail, meet);
  if (total == 0 && !after && !meet.waits_first()) return;  // the GPU launches nothing either
  meter_launch(total);
  std::atomic<int64_t> ticket{0};
  for_units(units, grid.threads, [&](int64_t warp) {
    meet.first();
    // A wait that gave up (a peer timed out, the op fails): the peers' data may not be
    // there, so the items do not run.
    for (int64_t i = warp; i < total && !meet.failed(); i += units) {
      for (int lane = grid.lanes - 1; lane >= 0; --lane) {
        phase(first_rank + static_cast<int>(i / items), i % items, lane, grid.lanes);
      }
    }
    meet.done();
    if (!after || ticket.fetch_add(1, std::memory_order_acq_rel) != units - 1) return;
    for (int64_t i = tail.early_items() - 1; i >= 0 && !meet.failed(); --i) tail.early(i);
    for (int64_t i = tail.publish_items() - 1; i >= 0 && !meet.failed(); --i) {
      for (int lane = grid.lanes - 1; lane >= 0; --lane) tail.publish(i, lane, grid.lanes);
    }
    meet.last();
    for (int64_t i = tail.items() - 1; i >= 0 && !meet.failed(); --i) tail(i);
  });
}

// The most units one streaming launch of one rank runs on the CPU: its units wait for each
// other, so each needs a thread of its own (as a GPU refuses a cooperative launch larger than
// it holds at once), and more would exhaust the machine's threads.
constexpr int64_t kMaxHostUnits = 1024;

// A streaming launch (cuda/channels.h): body(rank, unit, warp, meet) for every unit of ranks
// [first_rank, first_rank + ranks) x [0, units), each on a thread of its own, since units wait
// for each other as the co-resident blocks of a GPU do; one call per unit runs all
// grid.lanes lanes (Warp::kAllLanes). Every unit runs meet.first() before its body and
// meet.done() after it, the last to finish meet.last().
template <typename Body, typename Meeting>
void host_per_unit(const Body& body, int first_rank, int ranks, int64_t units,
                   const HostGrid& grid, const Meeting& meet) {
  const int64_t total = static_cast<int64_t>(ranks) * units;
  if (total == 0 && !meet.has_last() && !meet.waits_first()) return;
  meter_launch(total);
  std::atomic<int64_t> ticket{0};
  auto unit = [&](int64_t u) {
    meet.first();
    if (!meet.failed()) {
      body(first_rank + static_cast<int>(u / units), u % units, Warp{Warp::kAllLanes, grid.lanes},
           meet);
    }
    meet.done();
    if (ticket.fetch_add(1, std::memory_order_acq_rel) == total - 1) meet.last();
  };
  if (total == 0) {
    meet.first();
    meet.last();
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(total);
  for (int64_t u = 0; u < total; ++u) pool.emplace_back(unit, u);
  for (std::thread& thread : pool) thread.join();
}

// The CPU launcher of cuda/virtual_ops.h: every launch over all R ranks on the grid.
struct HostLauncher {
  int ranks;
  HostGrid grid;
  template <typename Phase, typename Tail = NoTail>
  void per_warp(const Phase& phase, int64_t items, const Tail& tail = {}) {
    host_per_warp(phase, 0, ranks, items, grid, tail);
  }
};

// The grid of the CPU handlers: $JAX_EP_CPU_GRID ("blocks,warps,lanes[,threads]"), read once
// per process; a loop (1,1,1) when unset. A malformed value is reported by `error`.
inline const HostGrid& cpu_handler_grid(std::string* error = nullptr) {
  static const auto parsed = [] {
    std::pair<HostGrid, std::string> out;
    const char* text = std::getenv("JAX_EP_CPU_GRID");
    if (text != nullptr && *text != '\0' && !parse_host_grid(text, &out.first)) {
      out.second = std::string("$JAX_EP_CPU_GRID=") + text +
                   " is not \"blocks,warps,lanes[,threads]\" with each in [1, 1024]";
    }
    return out;
  }();
  if (error != nullptr) *error = parsed.second;
  return parsed.first;
}

}  // namespace jax_ep
