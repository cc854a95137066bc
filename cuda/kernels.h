// Launchers of the exchange kernels (cuda/exchange.cu) with virtual ranks: every phase of
// cuda/exchange.h as one kernel on `stream`, in order. Each returns the launch status.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/exchange.h"

namespace jax_ep::cuda {

cudaError_t launch_dispatch(const DispatchArgs& args, cudaStream_t stream);

template <typename T>
cudaError_t launch_combine(const CombineArgs<T>& args, cudaStream_t stream);

cudaError_t launch_ll_dispatch_send(const LowLatencyArgs& args, cudaStream_t stream);
cudaError_t launch_ll_dispatch_recv(const LowLatencyArgs& args, cudaStream_t stream);
cudaError_t launch_ll_combine_send(const LowLatencyCombineArgs& args, cudaStream_t stream);
cudaError_t launch_ll_combine_recv(const LowLatencyCombineArgs& args, cudaStream_t stream);

}  // namespace jax_ep::cuda
