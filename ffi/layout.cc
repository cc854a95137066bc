// CPU handler of "jax_ep_dispatch_layout", and the argument checks both handlers share.
#include "ffi/layout.h"

#include <algorithm>
#include <string>

#include "cuda/routing.h"
#include "ffi/ffi_helpers.h"

namespace jax_ep::ffi {
namespace {

namespace xffi = ::xla::ffi;

xffi::Error LayoutCpuImpl(S32 topk_idx,
                          xffi::Result<S32> per_rank,
                          xffi::Result<S32> per_expert,
                          xffi::Result<Pred> in_rank,
                          xffi::Result<S32> invalid,
                          int64_t num_experts,
                          int64_t num_ranks) {
  JAX_EP_RETURN_IF_ERROR(
      CheckLayoutArgs(topk_idx, per_rank, per_expert, in_rank, invalid, num_experts, num_ranks));
  const auto dims = topk_idx.dimensions();
  const int64_t num_tokens = dims[0];
  const int top_k = static_cast<int>(dims[1]);
  const int experts = static_cast<int>(num_experts);
  const int experts_per_rank = static_cast<int>(num_experts / num_ranks);

  const int32_t* ids = topk_idx.typed_data();
  int32_t* rank_counts = per_rank->typed_data();
  int32_t* expert_counts = per_expert->typed_data();
  bool* token_in_rank = in_rank->typed_data();
  std::fill(rank_counts, rank_counts + num_ranks, 0);
  std::fill(expert_counts, expert_counts + num_experts, 0);
  std::fill(token_in_rank, token_in_rank + num_tokens * num_ranks, false);
  int32_t invalid_count = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t* token_ids = ids + t * top_k;
    for (int k = 0; k < top_k; ++k) {
      if (is_choice(token_ids[k], experts)) {
        ++expert_counts[token_ids[k]];
        if (first_choice_on_rank(token_ids, k, experts, experts_per_rank)) {
          const int rank = token_ids[k] / experts_per_rank;
          token_in_rank[t * num_ranks + rank] = true;
          ++rank_counts[rank];
        }
      } else if (is_invalid(token_ids[k], experts)) {
        ++invalid_count;
      }
    }
  }
  *invalid->typed_data() = invalid_count;
  return xffi::Error::Success();
}

}  // namespace

xffi::Error CheckLayoutArgs(S32 topk_idx,
                            xffi::Result<S32> per_rank,
                            xffi::Result<S32> per_expert,
                            xffi::Result<Pred> in_rank,
                            xffi::Result<S32> invalid,
                            int64_t num_experts,
                            int64_t num_ranks) {
  JAX_EP_RETURN_IF_ERROR(CheckDims(kLayoutOp, "topk_idx", topk_idx, {-1, -1}));
  const int64_t num_tokens = topk_idx.dimensions()[0];
  const int64_t top_k = topk_idx.dimensions()[1];
  if (num_ranks < 1 || num_experts < 1 || num_experts % num_ranks != 0) {
    return xffi::Error::InvalidArgument(
        std::string(kLayoutOp) + ": num_experts (" + std::to_string(num_experts) +
        ") must be a positive multiple of num_ranks (" + std::to_string(num_ranks) + ")");
  }
  if (top_k < 1 || top_k > kMaxTopK) {
    return xffi::Error::InvalidArgument(std::string(kLayoutOp) + ": topk_idx has " +
                                        std::to_string(top_k) + " choices per token; at most " +
                                        std::to_string(kMaxTopK) + " are supported");
  }
  JAX_EP_RETURN_IF_ERROR(CheckDims(kLayoutOp, "num_tokens_per_rank", *per_rank, {num_ranks}));
  JAX_EP_RETURN_IF_ERROR(
      CheckDims(kLayoutOp, "num_tokens_per_expert", *per_expert, {num_experts}));
  JAX_EP_RETURN_IF_ERROR(
      CheckDims(kLayoutOp, "is_token_in_rank", *in_rank, {num_tokens, num_ranks}));
  return CheckDims(kLayoutOp, "num_invalid", *invalid, {});
}

}  // namespace jax_ep::ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLayoutCpu,
                              jax_ep::ffi::LayoutCpuImpl,
                              ::xla::ffi::Ffi::Bind()
                                  .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()   // topk_idx
                                  .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()   // per rank
                                  .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()   // per expert
                                  .Ret<::xla::ffi::Buffer<::xla::ffi::PRED>>()  // token in rank
                                  .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()   // invalid ids
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks"));
