// Device helpers shared by the kernels in cuda/: warp and block reductions.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <tuple>

namespace jax_ep::cuda {

// Calls launch(pointers) with an array of pointers to `args`, converted to the kernel's
// parameter types, as the launch APIs take them.
template <typename... Params, typename... Args, typename Launch>
cudaError_t with_kernel_args(void (*)(Params...), const Launch& launch, Args... args) {
  static_assert(sizeof...(Params) > 0 && sizeof...(Params) == sizeof...(Args),
                "one argument per kernel parameter");
  std::tuple<Params...> values(args...);
  void* pointers[sizeof...(Params)];
  std::apply(
      [&pointers](auto&... value) {
        int i = 0;
        ((pointers[i++] = &value), ...);
      },
      values);
  return launch(pointers);
}

// Launches kernel<<<blocks, threads, 0, stream>>>(args...) and returns the status of this
// launch alone (cudaGetLastError after a <<<>>> launch would also report, and clear, an
// earlier unrelated error of the thread). Errors that poison the context are still reported.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), unsigned blocks, unsigned threads,
                   cudaStream_t stream, Args... args) {
  return with_kernel_args(
      kernel,
      [&](void** pointers) {
        return cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(blocks),
                                dim3(threads), pointers, 0, stream);
      },
      args...);
}

// launch() as a cooperative launch: every block of the grid is resident at once, or the launch
// fails (cudaErrorCooperativeLaunchTooLarge), whatever else runs on the GPU (other kernels,
// an MPS client's share of the SMs): for kernels whose blocks wait on each other. A stream
// capture records it as a cooperative kernel node.
template <typename... Params, typename... Args>
cudaError_t launch_cooperative(void (*kernel)(Params...), unsigned blocks, unsigned threads,
                               cudaStream_t stream, Args... args) {
  return with_kernel_args(
      kernel,
      [&](void** pointers) {
        cudaLaunchAttribute cooperative{};
        cooperative.id = cudaLaunchAttributeCooperative;
        cooperative.val.cooperative = 1;
        cudaLaunchConfig_t config{};
        config.gridDim = dim3(blocks);
        config.blockDim = dim3(threads);
        config.stream = stream;
        config.attrs = &cooperative;
        config.numAttrs = 1;
        return cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(kernel), pointers);
      },
      args...);
}

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
