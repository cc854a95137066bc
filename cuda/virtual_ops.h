// The ops with virtual ranks: all R ranks of the group in one call, inputs and outputs stacked
// [R, ...], peers reached as slices of the stacks (VirtualPeers). Each phase is one launch
// over every rank's items, so a launch boundary is the barrier between phases.
//
// run_virtual(launcher, op, args) runs op `op` (PeerOp, cuda/peer_ops.h), one overload per
// argument struct. Written once for both launchers: the GPU's kernels (cuda/exchange.cu) and
// the CPU's emulated grids (ffi/exchange_cpu.cc). A Launcher L provides
//   void per_warp(phase, items[, tail])   one launch over ranks [0, R), the tail after all its
//                                          items (cuda/phases.cuh)
// (cuda/peer_ops.h is the same for one rank per device, meeting the peers in the launches).
#pragma once

#include <cstdint>

#include "cuda/peer_ops.h"
#include "cuda/phase_functors.h"

namespace jax_ep {

template <typename L>
void run_virtual(L& l, int, const DispatchArgs& in) {
  using Peers = VirtualPeers;
  DispatchArgs a = in;
  a.rings = Rings{};  // virtual ranks move rows in phases (rings stream between devices)
  l.per_warp(DispatchCount{a}, a.num_chunks, DispatchTail<Peers>{a, 0, a.num_ranks});
  with_wire(a.wire, [&](auto wire) {
    l.per_warp(DispatchSend<Peers, wire.value>{a}, a.num_tokens);  // kWire: it casts the rows
  });
  l.per_warp(DispatchFinish<Peers>{a}, a.finish_items());
}

// Combine reads every receiver's rows where they are (expert-major, each entry's row).
template <typename L, typename T>
void run_virtual(L& l, int, const CombineArgs<T>& a) {
  if (a.expert_major) {
    l.per_warp(CombineTokenEntries<T, VirtualPeers>{a}, a.num_tokens);
  } else {
    l.per_warp(CombineToken<T, VirtualPeers>{a}, a.num_tokens);
  }
}

// Low-latency dispatch has only its send (`op` kPeerLlDispatchSend): the messages land in
// their compact slots, and the count's tail (or, with one rank, the send) writes the counts.
template <typename L>
void run_virtual(L& l, int, const LowLatencyArgs& a) {
  using Peers = VirtualPeers;
  if (!a.counts_in_send()) {
    l.per_warp(LowLatencyCount{a}, a.num_chunks, LowLatencyTotals<Peers>{a, 0, a.num_ranks});
  }
  with_ll_send(a, Peers{}, [&](const auto& send) { l.per_warp(send, send.items()); });
}

// Low-latency combine has only its receive (`op` kPeerLlCombineRecv): it reads the expert
// rows in place.
template <typename L>
void run_virtual(L& l, int, const LowLatencyCombineArgs& a) {
  const LowLatencyCombineToken sums{a};
  l.per_warp(sums, sums.items());
}

// Rows along a dispatch's routing: every receiver reads its rows from the stacked x.
template <typename L>
void run_virtual(L& l, int, const RowsArgs& a) {
  l.per_warp(RowsPull<VirtualPeers>{a, VirtualPeers{}}, a.capacity);
}

}  // namespace jax_ep
