// Launching the phases of cuda/exchange.h as kernels, for any Peers view.
//
// A launch covers ranks [first_rank, first_rank + ranks) x items [0, items): all R ranks with
// virtual ranks, this rank alone between GPUs, one item per warp, its 32 lanes copying
// 16-byte words. Grids are one wave (the blocks the SMs hold at once) and grid-stride, so any
// problem size fits one launch and every block meets the peers once.
//
// A launch may also have a tail (NoTail): items that need every item of the launch done (the
// count phase's totals and bases). The block that finishes last, found with a ticket, runs
// them with its threads, one item per thread: no launch of its own. Between GPUs a launch
// also meets the other ranks (Meet, cuda/peer_ops.h): before its items, every block
// waits for the peers' earlier launches; after them, the last block tells the peers this
// launch is done.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "cuda/channels.h"
#include "cuda/common.cuh"
#include "cuda/phase_functors.h"

namespace jax_ep::cuda {

constexpr int kPhaseWarps = kBlockWarps;  // cuda/exchange.h sizes its shared tables by it
constexpr int kPhaseThreads = kPhaseWarps * kWarpSize;
constexpr int64_t kMaxPhaseBlocks = 132 * 16;  // fills an H100 several times over

// The ticket of the launches on `stream`: a zeroed device counter (cuda/exchange.cu). Launches
// on one stream run one after another, so they can share it; the last block resets it.
cudaError_t stream_ticket(cudaStream_t stream, unsigned** ticket);

// True in the block that finishes last; every thread of every block calls it. What any block
// wrote before (to peers too) is visible to the last block after it.
__device__ __forceinline__ bool is_last_block(unsigned* ticket) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // this block's writes before its ticket
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    if (last) *ticket = 0;  // ready for the stream's next launch
    __threadfence_system();  // the other blocks' writes before what the last block reads
  }
  __syncthreads();
  return last;
}

// The current device's SMs; false when CUDA cannot say.
inline bool device_sms(int* sms) {
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess;
}

// Blocks of kPhaseThreads threads that one SM holds at once (at least 1).
template <typename Kernel>
int blocks_per_sm(Kernel kernel) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kPhaseThreads, 0) !=
      cudaSuccess) {
    cudaGetLastError();  // not sticky; the launch reports real errors
    return 1;
  }
  return std::max(blocks, 1);
}

template <typename Phase, typename Tail, typename Meeting>
__global__ void __launch_bounds__(kPhaseThreads, MinBlocksPerSm<Phase>::value)
    per_warp_kernel(Phase phase, Tail tail, Meeting meet, unsigned* ticket, int first_rank,
                    int ranks, int64_t items) {
  // A block whose wait gave up (meet.failed(): the op fails, and the peers' data may not be
  // there) skips its items and, as the last block, the tail's; it still meets the peers.
  meet.first();
  const int64_t total = static_cast<int64_t>(ranks) * items;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kPhaseWarps) + threadIdx.x / kWarpSize;
       i < total && !meet.failed(); i += static_cast<int64_t>(gridDim.x) * kPhaseWarps) {
    phase(first_rank + static_cast<int>(i / items), i % items, lane, kWarpSize);
  }
  meet.done();
  if (ticket == nullptr || !is_last_block(ticket)) return;  // no ticket: nothing comes after
  const bool skip = meet.failed();
  for (int64_t i = threadIdx.x; !skip && i < tail.early_items(); i += kPhaseThreads) {
    tail.early(i);
  }
  __syncthreads();  // the early items' writes before what publishes them
  for (int64_t i = threadIdx.x / kWarpSize; !skip && i < tail.publish_items(); i += kPhaseWarps) {
    tail.publish(i, lane, kWarpSize);
  }
  __syncthreads();  // the tail's writes before the meet and the other items
  meet.last();
  for (int64_t i = threadIdx.x; !skip && i < tail.items(); i += kPhaseThreads) tail(i);
}

// One launch of `phase` over ranks x items, then `tail`, meeting as `meet` says, on at most
// `num_sms` SMs' worth of blocks (0: every SM's): num_sms times the blocks one SM holds at
// once, so the launch takes no more warp slots than num_sms SMs have. A launch with
// no items still runs when it has a tail or meets its peers.
template <typename Phase, typename Tail = NoTail, typename Meeting = NoMeet>
cudaError_t per_warp(const Phase& phase, int first_rank, int ranks, int64_t items,
                     cudaStream_t stream, int num_sms, const Tail& tail = {},
                     const Meeting& meet = {}) {
  const int64_t total = static_cast<int64_t>(ranks) * items;
  const bool after = runs_after(tail, meet);
  if (total == 0 && !after && !meet.waits_first()) return cudaSuccess;
  unsigned* ticket = nullptr;
  if (after) {
    const cudaError_t status = stream_ticket(stream, &ticket);
    if (status != cudaSuccess) return status;
  }
  // One wave: at most the blocks the SMs (num_sms of them, or every one) hold at once, so that
  // every block is resident from the start and meets the peers once; the grid strides.
  static const int per_sm = blocks_per_sm(per_warp_kernel<Phase, Tail, Meeting>);
  int sms = num_sms;
  if (sms <= 0 && !device_sms(&sms)) sms = static_cast<int>(kMaxPhaseBlocks / per_sm);
  const int64_t most = std::min<int64_t>(static_cast<int64_t>(sms) * per_sm, kMaxPhaseBlocks);
  const int64_t blocks = std::clamp<int64_t>((total + kPhaseWarps - 1) / kPhaseWarps, 1, most);
  return launch(per_warp_kernel<Phase, Tail, Meeting>, static_cast<unsigned>(blocks),
                kPhaseThreads, stream, phase, tail, meet, ticket, first_rank, ranks, items);
}

// A streaming launch (cuda/channels.h): body(rank, unit, warp, watch) for each unit of ranks
// [first_rank, first_rank + ranks) x [0, units), one warp each, every lane calling it; the
// blocks meet the peers as per_warp_kernel's do (no tail).
template <typename Body, typename Meeting, typename Watch>
__global__ void __launch_bounds__(kPhaseThreads, kStreamBlocksPerSm)
    per_unit_kernel(Body body, Meeting meet, Watch watch, unsigned* ticket, int first_rank,
                    int ranks, int64_t units) {
  meet.first();
  const int64_t unit = blockIdx.x * static_cast<int64_t>(kPhaseWarps) + threadIdx.x / kWarpSize;
  if (unit < ranks * units && !meet.failed()) {
    body(first_rank + static_cast<int>(unit / units), unit % units,
         Warp{static_cast<int>(threadIdx.x % kWarpSize), kWarpSize}, watch);
  }
  meet.done();
  if (ticket == nullptr || !is_last_block(ticket)) return;
  meet.last();
}

// One streaming launch: its units wait for each other, so every block must be resident at
// once: a cooperative launch, which the GPU schedules whole or refuses
// (cudaErrorCooperativeLaunchTooLarge, also for more blocks than it holds at once), so that
// other work on the GPU or an MPS client's share of its SMs cannot leave a partner
// unscheduled.
template <typename Body, typename Meeting, typename Watch>
cudaError_t per_unit(const Body& body, int first_rank, int ranks, int64_t units,
                     cudaStream_t stream, const Meeting& meet, const Watch& watch) {
  const int64_t total = static_cast<int64_t>(ranks) * units;
  if (total == 0 && !meet.has_last() && !meet.waits_first()) return cudaSuccess;
  unsigned* ticket = nullptr;
  if (meet.has_last()) {
    const cudaError_t status = stream_ticket(stream, &ticket);
    if (status != cudaSuccess) return status;
  }
  const int64_t blocks = std::max<int64_t>((total + kPhaseWarps - 1) / kPhaseWarps, 1);
  return launch_cooperative(per_unit_kernel<Body, Meeting, Watch>,
                            static_cast<unsigned>(blocks), kPhaseThreads, stream, body, meet,
                            watch, ticket, first_rank, ranks, units);
}

}  // namespace jax_ep::cuda
