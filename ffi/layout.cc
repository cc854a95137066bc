// CPU handler of "jax_ep_dispatch_layout", and the argument checks both handlers share.
#include "ffi/layout.h"

#include <algorithm>
#include <string>

#include "cuda/routing.h"
#include "ffi/ffi_helpers.h"

namespace jax_ep::ffi {
namespace {

xffi::Error LayoutCpuImpl(S32 topk_idx,
                          xffi::Result<S32> num_tokens_per_rank,
                          xffi::Result<S32> num_tokens_per_expert,
                          xffi::Result<Pred> is_token_in_rank,
                          xffi::Result<S32> num_invalid,
                          int64_t num_experts,
                          int64_t num_ranks) {
  JAX_EP_RETURN_IF_ERROR(CheckLayoutArgs(topk_idx,
                                         num_tokens_per_rank,
                                         num_tokens_per_expert,
                                         is_token_in_rank,
                                         num_invalid,
                                         num_experts,
                                         num_ranks));
  const int64_t num_tokens = topk_idx.dimensions()[0];
  const int64_t top_k = topk_idx.dimensions()[1];
  const int experts = static_cast<int>(num_experts);
  const int experts_per_rank = static_cast<int>(num_experts / num_ranks);

  const int32_t* ids = topk_idx.typed_data();
  int32_t* per_rank = num_tokens_per_rank->typed_data();
  int32_t* per_expert = num_tokens_per_expert->typed_data();
  bool* in_rank = is_token_in_rank->typed_data();
  std::fill(per_rank, per_rank + num_ranks, 0);
  std::fill(per_expert, per_expert + num_experts, 0);
  std::fill(in_rank, in_rank + num_tokens * num_ranks, false);
  int32_t invalid = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t* token_ids = ids + t * top_k;
    for (int k = 0; k < top_k; ++k) {
      const int32_t id = token_ids[k];
      if (is_choice(id, experts)) {
        ++per_expert[id];
        // A token counts once per rank, however many of its experts live there.
        if (first_choice_on_rank(token_ids, k, experts, experts_per_rank)) {
          const int rank = id / experts_per_rank;
          in_rank[t * num_ranks + rank] = true;
          ++per_rank[rank];
        }
      } else if (is_invalid(id, experts)) {
        ++invalid;
      }
    }
  }
  *num_invalid->typed_data() = invalid;
  return xffi::Error::Success();
}

}  // namespace

xffi::Error CheckLayoutArgs(S32 topk_idx,
                            xffi::Result<S32> num_tokens_per_rank,
                            xffi::Result<S32> num_tokens_per_expert,
                            xffi::Result<Pred> is_token_in_rank,
                            xffi::Result<S32> num_invalid,
                            int64_t num_experts,
                            int64_t num_ranks) {
  JAX_EP_RETURN_IF_ERROR(CheckRank(kLayoutOp, "topk_idx", topk_idx, 2));
  const int64_t num_tokens = topk_idx.dimensions()[0];
  const int64_t top_k = topk_idx.dimensions()[1];
  if (num_ranks < 1) {
    return xffi::Error::InvalidArgument(std::string(kLayoutOp) + ": num_ranks must be >= 1, got " +
                                        std::to_string(num_ranks));
  }
  if (num_experts < 1 || num_experts % num_ranks != 0 || num_experts > INT32_MAX) {
    return xffi::Error::InvalidArgument(
        std::string(kLayoutOp) + ": num_experts (" + std::to_string(num_experts) +
        ") must be a positive multiple of num_ranks (" + std::to_string(num_ranks) + ")");
  }
  // The kernels index entries with 32-bit counts.
  if (num_tokens * top_k > INT32_MAX) {
    return xffi::Error::InvalidArgument(std::string(kLayoutOp) + ": topk_idx has " +
                                        std::to_string(num_tokens * top_k) +
                                        " entries; at most 2^31 - 1 are supported");
  }
  JAX_EP_RETURN_IF_ERROR(
      CheckDims(kLayoutOp, "num_tokens_per_rank", *num_tokens_per_rank, {num_ranks}));
  JAX_EP_RETURN_IF_ERROR(
      CheckDims(kLayoutOp, "num_tokens_per_expert", *num_tokens_per_expert, {num_experts}));
  JAX_EP_RETURN_IF_ERROR(
      CheckDims(kLayoutOp, "is_token_in_rank", *is_token_in_rank, {num_tokens, num_ranks}));
  return CheckDims(kLayoutOp, "num_invalid", *num_invalid, {});
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayoutCpu,
                              LayoutCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<S32>()   // topk_idx [T, K]
                                  .Ret<S32>()   // num_tokens_per_rank [R]
                                  .Ret<S32>()   // num_tokens_per_expert [E]
                                  .Ret<Pred>()  // is_token_in_rank [T, R]
                                  .Ret<S32>()   // num_invalid []
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks"));

}  // namespace jax_ep::ffi
