// Host launchers of the CUDA kernels: raw pointers, sizes and a stream; no XLA or Python types.
// Each returns the CUDA error of its launches (cudaSuccess when all went well).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>

namespace jax_ep::cuda {

// Dispatch layout of one rank's routing (purely local). Zeroes and fills:
//   num_tokens_per_rank [num_ranks], num_tokens_per_expert [num_experts],
//   is_token_in_rank [num_tokens, num_ranks], num_invalid [1].
// Requires num_experts % num_ranks == 0 and 1 <= top_k <= kMaxTopK.
cudaError_t dispatch_layout(const int32_t* topk_idx,
                            int num_tokens,
                            int top_k,
                            int num_experts,
                            int num_ranks,
                            int32_t* num_tokens_per_rank,
                            int32_t* num_tokens_per_expert,
                            bool* is_token_in_rank,
                            int32_t* num_invalid,
                            cudaStream_t stream);

// Largest num_experts + num_ranks that dispatch_layout counts in shared memory.
int dispatch_layout_max_counters();

// Writes nvshmem_my_pe() of this GPU to device memory `pe` (after NVSHMEM is initialized).
cudaError_t query_my_pe(int* pe, cudaStream_t stream);

// NVSHMEM unique id (128 bytes) for rank 0 to share; works without a GPU. Returns the NVSHMEM
// status (0 on success).
int nvshmem_unique_id(std::array<uint8_t, 128>* id);

// Version of the NVSHMEM headers and device library compiled in.
int nvshmem_version_major();
int nvshmem_version_minor();
int nvshmem_version_patch();

}  // namespace jax_ep::cuda
