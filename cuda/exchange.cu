// Exchange kernels with virtual ranks: each phase of cuda/exchange.h is one launch over all
// (rank, item) pairs, so the launch boundary is the barrier between phases.
//
// Counting and addressing phases run one item per thread; phases that move rows run one item
// per warp, its 32 lanes copying 16-byte words. Grids are capped and grid-stride, so any
// problem size fits one launch.
#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace jax_ep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
constexpr int64_t kMaxBlocks = 132 * 16;  // enough to fill an H100 several times over

// One item per thread: phase(rank, item).
template <typename Phase>
__global__ void __launch_bounds__(kThreads) per_thread_kernel(Phase phase, int ranks,
                                                              int64_t items) {
  const int64_t total = static_cast<int64_t>(ranks) * items;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    phase(static_cast<int>(i / items), i % items);
  }
}

// One item per warp: phase(rank, item, lane, 32).
template <typename Phase>
__global__ void __launch_bounds__(kThreads) per_warp_kernel(Phase phase, int ranks,
                                                            int64_t items) {
  const int64_t total = static_cast<int64_t>(ranks) * items;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / kWarpSize;
       i < total; i += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    phase(static_cast<int>(i / items), i % items, lane, kWarpSize);
  }
}

template <typename Phase>
cudaError_t per_thread(const Phase& phase, int ranks, int64_t items, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(ranks) * items;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks);
  per_thread_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(phase, ranks, items);
  return cudaGetLastError();
}

template <typename Phase>
cudaError_t per_warp(const Phase& phase, int ranks, int64_t items, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(ranks) * items;
  if (total == 0) return cudaSuccess;
  const int64_t blocks =
      std::min<int64_t>((total + kWarpsPerBlock - 1) / kWarpsPerBlock, kMaxBlocks);
  per_warp_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(phase, ranks, items);
  return cudaGetLastError();
}

#define JAX_EP_RETURN_IF_CUDA_ERROR(expr)     \
  do {                                        \
    const cudaError_t _status = (expr);       \
    if (_status != cudaSuccess) return _status; \
  } while (0)

// The phases as function objects (kernel arguments, passed by value).
struct DispatchCount {
  DispatchArgs a;
  __device__ void operator()(int s, int64_t c, int lane, int lanes) const {
    dispatch_count(a, VirtualPeers{}, s, static_cast<int>(c), lane, lanes);
  }
};
struct DispatchBases {
  DispatchArgs a;
  __device__ void operator()(int s, int64_t c) const { dispatch_bases(a, s, static_cast<int>(c)); }
};
struct DispatchSend {
  DispatchArgs a;
  __device__ void operator()(int s, int64_t t, int lane, int lanes) const {
    dispatch_send(a, VirtualPeers{}, s, static_cast<int>(t), lane, lanes);
  }
};
struct DispatchFinish {
  DispatchArgs a;
  __device__ void operator()(int d, int64_t i, int lane, int lanes) const {
    dispatch_finish(a, VirtualPeers{}, d, static_cast<int>(i), lane, lanes);
  }
};
template <typename T>
struct CombineReduceEntries {
  CombineArgs<T> a;
  __device__ void operator()(int d, int64_t i, int lane, int lanes) const {
    combine_reduce_entries(a, d, static_cast<int>(i), lane, lanes);
  }
};
template <typename T>
struct CombineToken {
  CombineArgs<T> a;
  __device__ void operator()(int s, int64_t t, int lane, int lanes) const {
    combine_token(a, VirtualPeers{}, s, static_cast<int>(t), lane, lanes);
  }
};
struct LowLatencyCount {
  LowLatencyArgs a;
  __device__ void operator()(int s, int64_t c, int lane, int lanes) const {
    ll_count(a, VirtualPeers{}, s, static_cast<int>(c), lane, lanes);
  }
};
struct LowLatencySend {
  LowLatencyArgs a;
  __device__ void operator()(int s, int64_t t, int lane, int lanes) const {
    ll_send(a, VirtualPeers{}, s, static_cast<int>(t), lane, lanes);
  }
};
struct LowLatencyFinish {
  LowLatencyArgs a;
  __device__ void operator()(int d, int64_t r, int lane, int lanes) const {
    ll_finish(a, VirtualPeers{}, d, r, lane, lanes);
  }
};
struct LowLatencyCombineSend {
  LowLatencyCombineArgs a;
  __device__ void operator()(int d, int64_t src, int lane, int lanes) const {
    ll_combine_send(a, VirtualPeers{}, d, src, lane, lanes);
  }
};
struct LowLatencyCombineToken {
  LowLatencyCombineArgs a;
  __device__ void operator()(int s, int64_t t, int lane, int lanes) const {
    ll_combine_token(a, s, static_cast<int>(t), lane, lanes);
  }
};

}  // namespace

cudaError_t launch_dispatch(const DispatchArgs& a, cudaStream_t stream) {
  const int R = a.num_ranks;
  JAX_EP_RETURN_IF_CUDA_ERROR(per_warp(DispatchCount{a}, R, a.num_counters() + 1, stream));
  JAX_EP_RETURN_IF_CUDA_ERROR(per_thread(DispatchBases{a}, R, a.num_counters(), stream));
  JAX_EP_RETURN_IF_CUDA_ERROR(per_warp(DispatchSend{a}, R, a.num_tokens, stream));
  const int items = std::max({a.capacity, a.rows(), a.experts_per_rank()});
  return per_warp(DispatchFinish{a}, R, items, stream);
}

template <typename T>
cudaError_t launch_combine(const CombineArgs<T>& a, cudaStream_t stream) {
  const int R = a.num_ranks;
  if (a.expert_major) {
    JAX_EP_RETURN_IF_CUDA_ERROR(
        per_warp(CombineReduceEntries<T>{a}, R, static_cast<int64_t>(R) * a.num_tokens, stream));
  }
  return per_warp(CombineToken<T>{a}, R, a.num_tokens, stream);
}

template cudaError_t launch_combine<float>(const CombineArgs<float>&, cudaStream_t);
template cudaError_t launch_combine<Bf16>(const CombineArgs<Bf16>&, cudaStream_t);
template cudaError_t launch_combine<F16>(const CombineArgs<F16>&, cudaStream_t);

cudaError_t launch_ll_dispatch_send(const LowLatencyArgs& a, cudaStream_t stream) {
  JAX_EP_RETURN_IF_CUDA_ERROR(per_warp(LowLatencyCount{a}, a.num_ranks, a.num_experts + 1, stream));
  return per_warp(LowLatencySend{a}, a.num_ranks, a.num_tokens, stream);
}

cudaError_t launch_ll_dispatch_recv(const LowLatencyArgs& a, cudaStream_t stream) {
  return per_warp(LowLatencyFinish{a}, a.num_ranks, a.experts_per_rank() * a.slots(), stream);
}

cudaError_t launch_ll_combine_send(const LowLatencyCombineArgs& a, cudaStream_t stream) {
  return per_warp(LowLatencyCombineSend{a}, a.num_ranks,
                  static_cast<int64_t>(a.num_ranks) * a.num_tokens, stream);
}

cudaError_t launch_ll_combine_recv(const LowLatencyCombineArgs& a, cudaStream_t stream) {
  return per_warp(LowLatencyCombineToken{a}, a.num_ranks, a.num_tokens, stream);
}

}  // namespace jax_ep::cuda
