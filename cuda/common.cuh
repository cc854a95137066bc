// Device helpers shared by the kernels in cuda/: warp and block reductions.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_ep::cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarpMask = 0xffffffffu;

// Sum of `value` over the 32 lanes of the calling warp, returned to every lane. All lanes must
// call it (no divergence around the call).
__device__ __forceinline__ int32_t warp_sum(int32_t value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(kFullWarpMask, value, offset);
  }
  return value;
}

// Sums each of the N per-thread values `values[j]` over the whole block and returns total j to
// thread j (for threadIdx.x < N; other threads get 0). `scratch` is shared memory of
// kThreads / 32 * N ints. Every thread of the block must call it; it synchronizes the block.
template <int kThreads, int N>
__device__ __forceinline__ int32_t block_sum_to_thread(const int32_t (&values)[N],
                                                       int32_t* scratch) {
  static_assert(kThreads % kWarpSize == 0, "whole warps only");
  static_assert(N <= kThreads, "one thread per result");
  constexpr int kWarps = kThreads / kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int32_t total = warp_sum(values[j]);
    if (lane == 0) scratch[warp * N + j] = total;
  }
  __syncthreads();
  int32_t total = 0;
  if (threadIdx.x < N) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += scratch[w * N + threadIdx.x];
  }
  return total;
}

}  // namespace jax_ep::cuda
