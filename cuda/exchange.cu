// Exchange kernels with virtual ranks: each phase of cuda/exchange.h is one launch over all R
// ranks' items (VirtualPeers), so the launch boundary is the barrier between phases.
#include <algorithm>
#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/phases.cuh"

namespace jax_ep::cuda {
namespace {

using Peers = VirtualPeers;

#define JAX_EP_RETURN_IF_CUDA_ERROR(expr)       \
  do {                                          \
    const cudaError_t _status = (expr);         \
    if (_status != cudaSuccess) return _status; \
  } while (0)

}  // namespace

cudaError_t launch_dispatch(const DispatchArgs& a, cudaStream_t stream) {
  const int R = a.num_ranks;
  JAX_EP_RETURN_IF_CUDA_ERROR(per_warp(DispatchCount<Peers>{a}, 0, R, a.num_counters() + 1, stream));
  JAX_EP_RETURN_IF_CUDA_ERROR(per_thread(DispatchBases{a}, 0, R, a.num_counters(), stream));
  JAX_EP_RETURN_IF_CUDA_ERROR(per_warp(DispatchSend<Peers>{a}, 0, R, a.num_tokens, stream));
  const int items = std::max({a.capacity, a.rows(), a.experts_per_rank()});
  return per_warp(DispatchFinish<Peers>{a}, 0, R, items, stream);
}

template <typename T>
cudaError_t launch_combine(const CombineArgs<T>& a, cudaStream_t stream) {
  const int R = a.num_ranks;
  if (a.expert_major) {
    JAX_EP_RETURN_IF_CUDA_ERROR(
        per_warp(CombineReduceEntries<T>{a}, 0, R, static_cast<int64_t>(R) * a.num_tokens, stream));
  }
  return per_warp(CombineToken<T, Peers>{a}, 0, R, a.num_tokens, stream);
}

template cudaError_t launch_combine<float>(const CombineArgs<float>&, cudaStream_t);
template cudaError_t launch_combine<Bf16>(const CombineArgs<Bf16>&, cudaStream_t);
template cudaError_t launch_combine<F16>(const CombineArgs<F16>&, cudaStream_t);

cudaError_t launch_ll_dispatch_send(const LowLatencyArgs& a, cudaStream_t stream) {
  JAX_EP_RETURN_IF_CUDA_ERROR(per_warp(LowLatencyCount<Peers>{a}, 0, a.num_ranks, a.num_experts + 1, stream));
  return per_warp(LowLatencySend<Peers>{a}, 0, a.num_ranks, a.num_tokens, stream);
}

cudaError_t launch_ll_dispatch_recv(const LowLatencyArgs& a, cudaStream_t stream) {
  return per_warp(LowLatencyFinish<Peers>{a}, 0, a.num_ranks, a.experts_per_rank() * a.slots(), stream);
}

cudaError_t launch_ll_combine_send(const LowLatencyCombineArgs& a, cudaStream_t stream) {
  return per_warp(LowLatencyCombineSend<Peers>{a}, 0, a.num_ranks,
                  static_cast<int64_t>(a.num_ranks) * a.num_tokens, stream);
}

cudaError_t launch_ll_combine_recv(const LowLatencyCombineArgs& a, cudaStream_t stream) {
  return per_warp(LowLatencyCombineToken{a}, 0, a.num_ranks, a.num_tokens, stream);
}

}  // namespace jax_ep::cuda
