// The copy-rate microbenchmark's kernel: the body of cuda/copy_rate.h with one warp per block,
// `warps` blocks. A grid that small is spread by the block scheduler over as many SMs, so the
// rate measured is that of `warps` SMs each with one warp copying, the unit of the
// performance model's per-SM rate.
#include <cstdint>
#include <type_traits>

#include "cuda/api.h"
#include "cuda/common.cuh"
#include "cuda/copy_rate.h"

namespace jax_ep::cuda {
namespace {

template <typename Body>
__global__ void __launch_bounds__(kWarpSize) copy_rate_kernel(Body body) {
  // Grid-stride, although the launch below gives each warp a block of its own.
  for (int64_t w = blockIdx.x; w < body.a.warps; w += gridDim.x) {
    body(0, w, static_cast<int>(threadIdx.x), kWarpSize);
  }
}

}  // namespace

cudaError_t copy_rate(const void* src, void* dst, int64_t bytes, int64_t row_bytes, int warps,
                      int words_in_flight, cudaStream_t stream) {
  if (warps == 0) {  // one warp per SM of the current device
    int device = 0;
    const cudaError_t status = cudaGetDevice(&device);
    if (status != cudaSuccess) return status;
    const cudaError_t sms = cudaDeviceGetAttribute(&warps, cudaDevAttrMultiProcessorCount, device);
    if (sms != cudaSuccess) return sms;
  }
  if (warps < 1 || row_bytes < 1 || row_bytes > INT32_MAX || bytes < 0) {
    return cudaErrorInvalidValue;
  }
  if (bytes == 0) return cudaSuccess;
  const CopyRateArgs a{static_cast<const char*>(src), static_cast<char*>(dst), bytes, row_bytes,
                       warps};
  cudaError_t status = cudaErrorInvalidValue;
  with_copy_rate_body(a, words_in_flight, [&](const auto& body) {
    status = launch(copy_rate_kernel<std::decay_t<decltype(body)>>, static_cast<unsigned>(warps),
                    kWarpSize, stream, body);
  });
  return status;
}

}  // namespace jax_ep::cuda
