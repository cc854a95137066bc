// Dispatch-layout kernel: per-rank and per-expert token counts and the token-to-rank map.
//
// One thread per token. Counts go to shared-memory histograms first, so each block issues one
// global atomic per counter instead of one per token; integer atomics make the totals exact
// and independent of the order in which blocks finish.
#include "cuda/api.h"
#include "cuda/routing.h"

namespace jax_ep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxSharedCounters = 12 * 1024;  // 48 KiB of int counters

__global__ void __launch_bounds__(kThreads) dispatch_layout_kernel(const int32_t* topk_idx,
                                                                   int num_tokens,
                                                                   int top_k,
                                                                   int num_experts,
                                                                   int num_ranks,
                                                                   int32_t* num_tokens_per_rank,
                                                                   int32_t* num_tokens_per_expert,
                                                                   bool* is_token_in_rank,
                                                                   int32_t* num_invalid) {
  // Shared counters: [num_experts] per expert, [num_ranks] per rank, [1] invalid ids.
  extern __shared__ int32_t counters[];
  int32_t* per_expert = counters;
  int32_t* per_rank = counters + num_experts;
  int32_t* invalid = per_rank + num_ranks;
  const int num_counters = num_experts + num_ranks + 1;
  for (int i = threadIdx.x; i < num_counters; i += kThreads) counters[i] = 0;
  __syncthreads();

  const int experts_per_rank = num_experts / num_ranks;
  const int token = blockIdx.x * kThreads + threadIdx.x;
  if (token < num_tokens) {
    int32_t ids[kMaxTopK];
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      ids[k] = k < top_k ? __ldg(topk_idx + static_cast<int64_t>(token) * top_k + k) : -1;
    }
    bool* row = is_token_in_rank + static_cast<int64_t>(token) * num_ranks;
    for (int r = 0; r < num_ranks; ++r) row[r] = false;
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      if (k < top_k) {
        if (is_choice(ids[k], num_experts)) {
          atomicAdd(per_expert + ids[k], 1);
          if (first_choice_on_rank(ids, k, num_experts, experts_per_rank)) {
            const int rank = ids[k] / experts_per_rank;
            row[rank] = true;
            atomicAdd(per_rank + rank, 1);
          }
        } else if (is_invalid(ids[k], num_experts)) {
          atomicAdd(invalid, 1);
        }
      }
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < num_counters; i += kThreads) {
    const int32_t count = counters[i];
    if (count == 0) continue;
    int32_t* out = i < num_experts              ? num_tokens_per_expert + i
                   : i < num_experts + num_ranks ? num_tokens_per_rank + (i - num_experts)
                                                 : num_invalid;
    atomicAdd(out, count);
  }
}

}  // namespace

int dispatch_layout_max_counters() { return kMaxSharedCounters - 1; }

cudaError_t dispatch_layout(const int32_t* topk_idx,
                            int num_tokens,
                            int top_k,
                            int num_experts,
                            int num_ranks,
                            int32_t* num_tokens_per_rank,
                            int32_t* num_tokens_per_expert,
                            bool* is_token_in_rank,
                            int32_t* num_invalid,
                            cudaStream_t stream) {
  cudaError_t status;
  if ((status = cudaMemsetAsync(num_tokens_per_rank, 0, sizeof(int32_t) * num_ranks, stream)) ||
      (status = cudaMemsetAsync(num_tokens_per_expert, 0, sizeof(int32_t) * num_experts, stream)) ||
      (status = cudaMemsetAsync(num_invalid, 0, sizeof(int32_t), stream))) {
    return status;
  }
  if (num_tokens == 0) return cudaSuccess;
  const int blocks = (num_tokens + kThreads - 1) / kThreads;
  const size_t shared = sizeof(int32_t) * (num_experts + num_ranks + 1);
  dispatch_layout_kernel<<<blocks, kThreads, shared, stream>>>(topk_idx,
                                                               num_tokens,
                                                               top_k,
                                                               num_experts,
                                                               num_ranks,
                                                               num_tokens_per_rank,
                                                               num_tokens_per_expert,
                                                               is_token_in_rank,
                                                               num_invalid);
  return cudaGetLastError();
}

}  // namespace jax_ep::cuda
