// The exchange ops on a GPU: one entry point for every op, with virtual ranks and between
// devices.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/ep_group.h"
#include "cuda/exchange.h"
#include "cuda/peer_ops.h"

namespace jax_ep::cuda {

// Runs op `op` (PeerOp) on `stream`, each launch on at most `num_sms` SMs' worth of blocks
// (0: no bound but the grid cap of cuda/phases.cuh); the error is empty on success. With
// `axis_index` null: virtual ranks, the op of cuda/virtual_ops.h over operands and results
// stacked [R, ...] (cuda/exchange.cu). Else one rank per device: the op of cuda/peer_ops.h for
// this device's rank in its EP group of `groups` (cuda/ep_group.h), operands and results
// stacked [1, ...], `axis_index` the device address of the op's EP axis index, peers through
// NVSHMEM (one GPU per process, cuda/peer_exchange.cu) or CUDA peer access (the GPUs of this
// process, CUDA device `device_ordinal`: run_local). Args is one of JAX_EP_FOR_EACH_OP_ARGS.
template <typename Args>
PeerError run(int op, const Args& args, const int32_t* axis_index, int num_sms,
              cudaStream_t stream, const GroupTable& groups, int device_ordinal);

// One rank per GPU of this process (cuda/local_exchange.cu): the op on CUDA device `ordinal`.
template <typename Args>
PeerError run_local(int op, const Args& args, const int32_t* axis_index, int num_sms,
                    cudaStream_t stream, const GroupTable& groups, int ordinal);

// The virtual-rank half of run (cuda/exchange.cu).
template <typename Args>
PeerError run_virtual_ranks(int op, const Args& args, int num_sms, cudaStream_t stream);

// "CUDA error in <op>: ..." for a failed launch, empty for cudaSuccess.
PeerError launch_error(int op, cudaError_t status);

}  // namespace jax_ep::cuda
