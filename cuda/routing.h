// Routing arithmetic shared by the CUDA kernels and the CPU handlers (host + device).
// An expert id is a choice when 0 <= id < num_experts, a mask when -1, and invalid otherwise;
// invalid ids are counted and never used as addresses. Expert e lives on rank
// e / experts_per_rank as local expert e % experts_per_rank.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JAX_EP_HOST_DEVICE __host__ __device__ __forceinline__
#define JAX_EP_UNROLL _Pragma("unroll")
#define JAX_EP_NO_UNROLL _Pragma("unroll 1")
#else
#define JAX_EP_NO_UNROLL
#define JAX_EP_HOST_DEVICE inline
#define JAX_EP_UNROLL
#endif

namespace jax_ep {

JAX_EP_HOST_DEVICE bool is_choice(int32_t id, int num_experts) {
  return id >= 0 && id < num_experts;
}

JAX_EP_HOST_DEVICE bool is_invalid(int32_t id, int num_experts) {
  return id != -1 && !is_choice(id, num_experts);
}

// Rank holding the expert of a choice, or -1 for masked and invalid ids.
JAX_EP_HOST_DEVICE int choice_rank(int32_t id, int num_experts, int experts_per_rank) {
  return is_choice(id, num_experts) ? id / experts_per_rank : -1;
}

// A clean id (a choice, or -1) as rank's local expert, or -1 where its expert lives elsewhere:
// the ids a receiver keeps of a token's row.
JAX_EP_HOST_DEVICE int32_t local_expert(int32_t id, int rank, int experts_per_rank) {
  const int32_t first = rank * experts_per_rank;
  return id >= first && id < first + experts_per_rank ? id - first : -1;
}

// True when choice k of a token is the first of its choices that lives on its rank, so that a
// token counts once per rank. `ids` points at the token's top_k ids.
JAX_EP_HOST_DEVICE bool first_choice_on_rank(const int32_t* ids, int k, int num_experts,
                                             int experts_per_rank) {
  const int rank = choice_rank(ids[k], num_experts, experts_per_rank);
  if (rank < 0) return false;
  for (int j = 0; j < k; ++j) {
    if (choice_rank(ids[j], num_experts, experts_per_rank) == rank) return false;
  }
  return true;
}

}  // namespace jax_ep
