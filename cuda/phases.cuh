// Launching the phases of cuda/exchange.h as kernels, for any Peers view.
//
// A launch covers ranks [first_rank, first_rank + ranks) x items [0, items): all R ranks with
// virtual ranks, this rank alone between GPUs. Counting and addressing phases run one item per
// thread; phases that move rows (and the counting phases, which vote per warp) one item per
// warp, its 32 lanes copying 16-byte words. Grids are capped and grid-stride, so any problem
// size fits one launch.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/phase_functors.h"

namespace jax_ep::cuda {

constexpr int kPhaseThreads = 256;
constexpr int kPhaseWarps = kPhaseThreads / kWarpSize;
constexpr int64_t kMaxPhaseBlocks = 132 * 16;  // fills an H100 several times over

template <typename Phase>
__global__ void __launch_bounds__(kPhaseThreads) per_thread_kernel(Phase phase, int first_rank,
                                                                   int ranks, int64_t items) {
  const int64_t total = static_cast<int64_t>(ranks) * items;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kPhaseThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kPhaseThreads) {
    phase(first_rank + static_cast<int>(i / items), i % items);
  }
}

template <typename Phase>
__global__ void __launch_bounds__(kPhaseThreads) per_warp_kernel(Phase phase, int first_rank,
                                                                 int ranks, int64_t items) {
  const int64_t total = static_cast<int64_t>(ranks) * items;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kPhaseWarps) + threadIdx.x / kWarpSize;
       i < total; i += static_cast<int64_t>(gridDim.x) * kPhaseWarps) {
    phase(first_rank + static_cast<int>(i / items), i % items, lane, kWarpSize);
  }
}

template <typename Phase>
cudaError_t per_thread(const Phase& phase, int first_rank, int ranks, int64_t items,
                       cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(ranks) * items;
  if (total == 0) return cudaSuccess;
  const int64_t blocks =
      std::min<int64_t>((total + kPhaseThreads - 1) / kPhaseThreads, kMaxPhaseBlocks);
  return launch(per_thread_kernel<Phase>, static_cast<unsigned>(blocks), kPhaseThreads, stream,
                phase, first_rank, ranks, items);
}

template <typename Phase>
cudaError_t per_warp(const Phase& phase, int first_rank, int ranks, int64_t items,
                     cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(ranks) * items;
  if (total == 0) return cudaSuccess;
  const int64_t blocks =
      std::min<int64_t>((total + kPhaseWarps - 1) / kPhaseWarps, kMaxPhaseBlocks);
  return launch(per_warp_kernel<Phase>, static_cast<unsigned>(blocks), kPhaseThreads, stream,
                phase, first_rank, ranks, items);
}

}  // namespace jax_ep::cuda
