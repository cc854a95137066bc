// Launchers of the exchange kernels (cuda/exchange.cu) with virtual ranks: every phase of
// cuda/exchange.h as one kernel on `stream`, in order. Each returns the launch status.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/exchange.h"

namespace jax_ep::cuda {

cudaError_t launch_dispatch(const DispatchArgs& args, cudaStream_t stream);

template <typename T>
cudaError_t launch_combine(const CombineArgs<T>& args, cudaStream_t stream);

// `op`: kPeerLlDispatchSend or kPeerLlDispatchRecv (cuda/peer_ops.h).
cudaError_t launch_ll_dispatch(int op, const LowLatencyArgs& args, cudaStream_t stream);
// The receive of low-latency combine (with virtual ranks it has no send).
cudaError_t launch_ll_combine(const LowLatencyCombineArgs& args, cudaStream_t stream);

}  // namespace jax_ep::cuda
