// Dispatch-layout kernel: per-expert and per-rank token counts and the token-to-rank map of one
// rank's routing.
//
// The grid has two kinds of blocks, and each block owns a fixed range of outputs:
//   expert blocks: kExpertsPerBlock experts each. They stream all T*K entries of topk_idx
//     (coalesced, 16-byte loads when aligned) and count the entries that fall in their range;
//   rank blocks: kRanksPerBlock ranks each. One thread per token folds the token's K choices
//     into a bit mask over the block's ranks, writes that slice of is_token_in_rank and counts
//     tokens per rank. Rank block 0 also counts the invalid entries.
// Counters live in registers and are reduced once per block, so there are no atomics, the
// results do not depend on scheduling, every output element is written exactly once (no
// memset needed), and skewed routing (every token on one expert) costs the same as uniform.
// topk_idx is small (T*K ints) and every block reads it from L2.
#include <cstdint>

#include "cuda/api.h"
#include "cuda/common.cuh"
#include "cuda/routing.h"

namespace jax_ep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kExpertsPerBlock = 4;
constexpr int kRanksPerBlock = 8;  // at most 32: one bit per rank in a token's mask

static_assert(kRanksPerBlock <= 32, "rank masks are 32-bit");

// Adds one entry of topk_idx to the counters of experts [expert_begin, expert_begin + N).
// Entries outside that range (masks, invalid ids, other experts) add nothing. The unsigned
// difference maps every id below expert_begin to a large value, so one comparison suffices.
template <int N>
__device__ __forceinline__ void count_expert(int32_t id, int expert_begin, int32_t (&count)[N]) {
  const uint32_t local = static_cast<uint32_t>(id) - static_cast<uint32_t>(expert_begin);
#pragma unroll
  for (int j = 0; j < N; ++j) count[j] += local == static_cast<uint32_t>(j);
}

__device__ void expert_block(const int32_t* __restrict__ topk_idx,
                             int64_t num_entries,
                             int num_experts,
                             int expert_begin,
                             int32_t* __restrict__ num_tokens_per_expert,
                             int32_t* scratch) {
  int32_t count[kExpertsPerBlock] = {};
  int64_t scalar_begin = 0;
  // XLA's buffers are 16-byte aligned in practice; fall back to scalar loads otherwise.
  if (reinterpret_cast<uintptr_t>(topk_idx) % sizeof(int4) == 0) {
    const int4* vectors = reinterpret_cast<const int4*>(topk_idx);
    const int64_t num_vectors = num_entries / 4;
    for (int64_t i = threadIdx.x; i < num_vectors; i += kThreads) {
      const int4 v = __ldg(vectors + i);
      count_expert(v.x, expert_begin, count);
      count_expert(v.y, expert_begin, count);
      count_expert(v.z, expert_begin, count);
      count_expert(v.w, expert_begin, count);
    }
    scalar_begin = num_vectors * 4;
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < num_entries; i += kThreads) {
    count_expert(__ldg(topk_idx + i), expert_begin, count);
  }
  // NOTE: ids in [num_experts, expert_begin + kExpertsPerBlock) were counted in the last
  // block's tail slots; those slots are not written below, so invalid ids never count.
  const int32_t total = block_sum_to_thread<kThreads>(count, scratch);
  const int expert = expert_begin + static_cast<int>(threadIdx.x);
  if (threadIdx.x < kExpertsPerBlock && expert < num_experts) {
    num_tokens_per_expert[expert] = total;
  }
}

__device__ void rank_block(const int32_t* __restrict__ topk_idx,
                           int num_tokens,
                           int top_k,
                           int num_experts,
                           int num_ranks,
                           int rank_begin,
                           int32_t* __restrict__ num_tokens_per_rank,
                           bool* __restrict__ is_token_in_rank,
                           int32_t* __restrict__ num_invalid,
                           int32_t* scratch) {
  const int experts_per_rank = num_experts / num_ranks;
  const int ranks_here = min(kRanksPerBlock, num_ranks - rank_begin);
  // count[j]: tokens on rank rank_begin + j; count[kRanksPerBlock]: invalid entries.
  int32_t count[kRanksPerBlock + 1] = {};
  for (int64_t token = threadIdx.x; token < num_tokens; token += kThreads) {
    const int32_t* ids = topk_idx + token * top_k;
    uint32_t mask = 0;
#pragma unroll 4
    for (int k = 0; k < top_k; ++k) {
      const int32_t id = __ldg(ids + k);
      if (is_choice(id, num_experts)) {
        const uint32_t local = static_cast<uint32_t>(id / experts_per_rank - rank_begin);
        if (local < kRanksPerBlock) mask |= 1u << local;
      } else {
        count[kRanksPerBlock] += id != -1;
      }
    }
    bool* row = is_token_in_rank + token * num_ranks + rank_begin;
#pragma unroll
    for (int j = 0; j < kRanksPerBlock; ++j) {
      const int32_t hit = (mask >> j) & 1u;
      count[j] += hit;
      if (j < ranks_here) row[j] = hit;
    }
  }
  const int32_t total = block_sum_to_thread<kThreads>(count, scratch);
  if (static_cast<int>(threadIdx.x) < ranks_here) {
    num_tokens_per_rank[rank_begin + threadIdx.x] = total;
  }
  if (threadIdx.x == kRanksPerBlock && rank_begin == 0) *num_invalid = total;
}

__global__ void __launch_bounds__(kThreads) dispatch_layout_kernel(
    const int32_t* __restrict__ topk_idx,
    int num_tokens,
    int top_k,
    int num_experts,
    int num_ranks,
    int num_expert_blocks,
    int32_t* __restrict__ num_tokens_per_rank,
    int32_t* __restrict__ num_tokens_per_expert,
    bool* __restrict__ is_token_in_rank,
    int32_t* __restrict__ num_invalid) {
  constexpr int kMaxCounters =
      kExpertsPerBlock > kRanksPerBlock + 1 ? kExpertsPerBlock : kRanksPerBlock + 1;
  __shared__ int32_t scratch[kThreads / kWarpSize * kMaxCounters];
  // The branch is uniform per block: a block is either an expert block or a rank block.
  if (static_cast<int>(blockIdx.x) < num_expert_blocks) {
    expert_block(topk_idx,
                 static_cast<int64_t>(num_tokens) * top_k,
                 num_experts,
                 static_cast<int>(blockIdx.x) * kExpertsPerBlock,
                 num_tokens_per_expert,
                 scratch);
  } else {
    rank_block(topk_idx,
               num_tokens,
               top_k,
               num_experts,
               num_ranks,
               (static_cast<int>(blockIdx.x) - num_expert_blocks) * kRanksPerBlock,
               num_tokens_per_rank,
               is_token_in_rank,
               num_invalid,
               scratch);
  }
}

}  // namespace

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
  if (num_ranks < 1 || num_experts < 1 || num_experts % num_ranks != 0 || num_tokens < 0 ||
      top_k < 0 || static_cast<int64_t>(num_tokens) * top_k > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  const int num_expert_blocks = (num_experts + kExpertsPerBlock - 1) / kExpertsPerBlock;
  const int num_rank_blocks = (num_ranks + kRanksPerBlock - 1) / kRanksPerBlock;
  return launch(dispatch_layout_kernel, num_expert_blocks + num_rank_blocks, kThreads, stream,
                topk_idx, num_tokens, top_k, num_experts, num_ranks, num_expert_blocks,
                num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, num_invalid);
}

}  // namespace jax_ep::cuda
