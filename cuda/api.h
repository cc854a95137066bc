// Host launchers of the CUDA kernels: raw pointers, sizes and a stream; no XLA or Python types.
// Each returns the CUDA error of its launches (cudaSuccess when all went well).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace jax_ep::cuda {

// Dispatch layout of one rank's routing (purely local; docs/contract.md). Writes every element of:
//   num_tokens_per_rank [num_ranks]: tokens with at least one valid choice on each rank;
//   num_tokens_per_expert [num_experts]: valid choices per expert (duplicates count twice);
//   is_token_in_rank [num_tokens, num_ranks]: token t has a valid choice on rank r;
//   num_invalid [1]: entries that are neither -1 nor in [0, num_experts).
// topk_idx is [num_tokens, top_k], row-major. Requires num_ranks >= 1, num_experts a positive
// multiple of num_ranks, top_k >= 0 and num_tokens * top_k < 2^31; otherwise it launches
// nothing and returns cudaErrorInvalidValue.
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

// Writes nvshmem_my_pe() of this GPU to device memory `pe` (after NVSHMEM is initialized).
cudaError_t query_my_pe(int* pe,
                        cudaStream_t stream);

// Size of an NVSHMEM unique id (nvshmemx_uniqueid_t).
constexpr int kNvshmemUniqueIdBytes = 128;

// Writes a fresh NVSHMEM unique id (kNvshmemUniqueIdBytes bytes) to `id`, for rank 0 to share
// before initialization. Needs no GPU and initializes nothing. Returns the NVSHMEM status (0 on
// success).
int nvshmem_unique_id(uint8_t* id);

// The NVSHMEM symmetric buffer of jax_ep.initialize(): the same size and layout on every
// rank; nullptr from symmetric_buffer() when not initialized.
struct SymmetricBuffer {
  void* ptr;
  size_t bytes;
  size_t low_latency_offset;  // where the low-latency regions start (cuda/peer_ops.h)
  int rank;
  int num_ranks;
  int generation;  // counts initializations: per-buffer state elsewhere starts over on a change
  bool puts;       // the peers are reached with puts (cuda/peer_exchange.cu, NvshmemPutPeers)
  int ranks_per_node;  // with puts: node-aware, stores within nodes of this many; 0: one node
};
const SymmetricBuffer* symmetric_buffer();

// Initializes NVSHMEM on CUDA device `device` as PE `rank` of `num_ranks` with the unique id of
// rank 0, checks the host and device views of the PE numbering, and allocates a zeroed
// symmetric buffer of `buffer_bytes` whose last `low_latency_bytes` hold the low-latency
// regions, laid out for peers reached with puts where `puts` says (node-aware with
// ranks_per_node > 0). Collective: every rank calls it. Returns an empty string on success,
// else what failed. NVSHMEM ends the process when its bootstrap fails, so the caller checks
// every precondition first.
std::string runtime_initialize(const uint8_t* unique_id, int rank, int num_ranks, int device,
                               size_t buffer_bytes, size_t low_latency_bytes, bool puts,
                               int ranks_per_node);

// Frees the symmetric buffer and finalizes NVSHMEM (collective). Empty string on success.
std::string runtime_finalize();

// Version of the NVSHMEM headers and device library compiled in.
int nvshmem_version_major();
int nvshmem_version_minor();
int nvshmem_version_patch();

}  // namespace jax_ep::cuda
