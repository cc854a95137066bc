// Launchers of the exchange between GPUs (cuda/peer_exchange.cu): one rank per device, peers
// through NVSHMEM. Each takes the arguments parsed for one rank (operands and results stacked
// V = 1) and the device address of the op's EP axis index, and runs the op of
// cuda/peer_ops.h on `stream`. The returned error is empty on success.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/exchange.h"
#include "cuda/peer_ops.h"

namespace jax_ep::cuda {

PeerError peer_dispatch(const DispatchArgs& args, const int32_t* axis_index,
                        cudaStream_t stream);
template <typename T>
PeerError peer_combine(const CombineArgs<T>& args, const int32_t* axis_index,
                       cudaStream_t stream);
// `op`: kPeerLlDispatchSend or kPeerLlDispatchRecv.
PeerError peer_ll_dispatch(int op, const LowLatencyArgs& args, const int32_t* axis_index,
                           cudaStream_t stream);
// `op`: kPeerLlCombineSend or kPeerLlCombineRecv.
PeerError peer_ll_combine(int op, const LowLatencyCombineArgs& args, const int32_t* axis_index,
                          cudaStream_t stream);

}  // namespace jax_ep::cuda
