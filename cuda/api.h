// Host launchers of the CUDA kernels: raw pointers, sizes and a stream; no XLA or Python types.
// Each returns the CUDA error of its launches (cudaSuccess when all went well).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep::cuda {

// "cudaErrorX: what it means" for a failed CUDA call; for a GPU this build has no kernels for,
// also its compute capability, the architectures built, and the command that rebuilds for it.
std::string error_text(cudaError_t status);

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

// The copy-rate microbenchmark (cuda/copy_rate.cu): copies `bytes` from src to dst as rows of
// `row_bytes` with `warps` warps, one per block (0: one per SM of the current device), each
// lane keeping `words_in_flight` loads in flight (4, 8 or 16; 0: Hopper's bulk copies, the
// plain copy before sm_90). Returns cudaErrorInvalidValue, launching nothing, for any other
// words_in_flight, warps < 0, row_bytes outside [1, 2^31 - 1] or bytes < 0.
cudaError_t copy_rate(const void* src, void* dst, int64_t bytes, int64_t row_bytes, int warps,
                      int words_in_flight, cudaStream_t stream);

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
  int rank;        // this process's PE
  int num_ranks;   // PEs
  int generation;  // counts initializations: per-buffer state elsewhere starts over on a change
  bool puts;       // the peers are reached with puts (cuda/peer_exchange.cu, NvshmemPutPeers)
  int ranks_per_node;  // with puts: node-aware, stores within nodes of this many; 0: one node
  std::vector<int64_t> device_of_pe;  // the JAX id of each PE's GPU (the EP groups list ids)
  std::vector<int> node_of_pe;        // the node each PE runs on
};
const SymmetricBuffer* symmetric_buffer();

// Initializes NVSHMEM on CUDA device `device` as PE `rank` of `num_ranks` with the unique id of
// rank 0, checks the host and device views of the PE numbering, and allocates a zeroed
// symmetric buffer of `buffer_bytes` whose last `low_latency_bytes` hold the low-latency
// regions, laid out for peers reached with puts where `puts` says (node-aware with
// ranks_per_node > 0). device_of_pe and node_of_pe (num_ranks each) give every PE's GPU (its
// JAX device id) and node, for the EP groups of a mesh (cuda/ep_group.h). Collective: every
// rank calls it. Returns an empty string on success, else what failed. NVSHMEM ends the
// process when its bootstrap fails, so the caller checks every precondition first.
std::string runtime_initialize(const uint8_t* unique_id, int rank, int num_ranks, int device,
                               size_t buffer_bytes, size_t low_latency_bytes, bool puts,
                               int ranks_per_node, const std::vector<int64_t>& device_of_pe,
                               const std::vector<int>& node_of_pe);

// Frees the symmetric buffer and finalizes NVSHMEM (collective). Empty string on success.
std::string runtime_finalize();

// The GPUs of one process (cuda/local_exchange.cu): a buffer of the same size and layout on
// each, reached by the others through CUDA peer access; nullptr from local_buffers() when not
// initialized.
constexpr int kMaxLocalGpus = 64;
struct LocalBuffers {
  std::vector<int> ordinals;          // the CUDA device of each GPU
  std::vector<int64_t> device_ids;    // its JAX device id (the EP groups list ids)
  std::vector<char*> ptrs;            // its buffer, on that GPU
  size_t bytes;
  size_t low_latency_offset;          // where the low-latency regions start (cuda/peer_ops.h)
  int generation;  // counts initializations: per-buffer state elsewhere starts over on a change
};
const LocalBuffers* local_buffers();

// Allocates a zeroed buffer of `buffer_bytes` (its last `low_latency_bytes` the low-latency
// regions) on each of the CUDA devices `ordinals` (JAX ids `device_ids`) and enables peer
// access between every pair. Empty string on success, else what failed (a pair of GPUs
// without peer access among them).
std::string local_initialize(const std::vector<int>& ordinals,
                             const std::vector<int64_t>& device_ids, size_t buffer_bytes,
                             size_t low_latency_bytes);

// Frees the buffers of local_initialize. Empty string on success.
std::string local_finalize();

// What the doctor reports (jax_ep/tools/doctor.py): the CUDA driver's version and the version of the
// CUDA runtime built in (1000 x major + 10 x minor; 0 where the call fails, as without a
// driver), and whether each GPU this process sees can access each other's memory
// (cudaDeviceCanAccessPeer; row a, column b; empty without a driver). And the memory of the
// GPU of CUDA ordinal `ordinal` (0 where the query fails), which bounds the symmetric buffer.
struct CudaVersions {
  int driver = 0;
  int runtime = 0;
};
CudaVersions cuda_versions();
std::vector<std::vector<bool>> peer_access_matrix();
size_t device_memory_bytes(int ordinal);

// Version of the NVSHMEM headers and device library compiled in.
int nvshmem_version_major();
int nvshmem_version_minor();
int nvshmem_version_patch();

}  // namespace jax_ep::cuda
