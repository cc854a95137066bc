// FFI handlers of the target "jax_ep_dispatch_layout" (CPU and CUDA) and their shared checks.
//
// Operand: topk_idx s32[T, K]. Attributes: num_experts, num_ranks (int64).
// Results, in order: num_tokens_per_rank s32[R], num_tokens_per_expert s32[E],
// is_token_in_rank pred[T, R], num_invalid s32[] (ids that are neither -1 nor in [0, E)).
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi {

inline constexpr const char kLayoutOp[] = "jax_ep_dispatch_layout";

using S32 = ::xla::ffi::Buffer<::xla::ffi::S32>;
using Pred = ::xla::ffi::Buffer<::xla::ffi::PRED>;

// Validates the operand's rank, the attributes and every result's shape.
::xla::ffi::Error CheckLayoutArgs(S32 topk_idx,
                                  ::xla::ffi::Result<S32> num_tokens_per_rank,
                                  ::xla::ffi::Result<S32> num_tokens_per_expert,
                                  ::xla::ffi::Result<Pred> is_token_in_rank,
                                  ::xla::ffi::Result<S32> num_invalid,
                                  int64_t num_experts,
                                  int64_t num_ranks);

// The handlers (C symbols, wrapped in capsules by module.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCpu);
#ifdef JAX_EP_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(LayoutCuda);
#endif

}  // namespace jax_ep::ffi
