// Launchers of the exchange between GPUs (cuda/peer_exchange.cu): one rank per device, peers
// through NVSHMEM. Each takes the arguments parsed for one rank (operands and results stacked
// V = 1) and runs every phase of the op on `stream`, with barriers between the phases that
// need other ranks' data. The returned error is empty on success.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "cuda/exchange.h"

namespace jax_ep::cuda {

struct PeerError {
  std::string message;
  bool ok() const { return message.empty(); }
};

PeerError peer_dispatch(const DispatchArgs& args, cudaStream_t stream);
template <typename T>
PeerError peer_combine(const CombineArgs<T>& args, cudaStream_t stream);
PeerError peer_ll_dispatch_send(const LowLatencyArgs& args, cudaStream_t stream);
PeerError peer_ll_dispatch_recv(const LowLatencyArgs& args, cudaStream_t stream);
PeerError peer_ll_combine_send(const LowLatencyCombineArgs& args, cudaStream_t stream);
PeerError peer_ll_combine_recv(const LowLatencyCombineArgs& args, cudaStream_t stream);

}  // namespace jax_ep::cuda
