// FFI handlers of the target "jax_ep_copy_rate" (CPU and CUDA) and their shared checks: the
// copy-rate microbenchmark (cuda/copy_rate.h, jax_ep/tools/copy_rate.py).
//
// Operand: x u8[...], any shape. Result: its copy, u8 of the same shape. Attributes (int64):
// warps (the warps that share the copy, at least 1; 0 on a GPU: one per SM), words_in_flight
// (loads in flight per lane: 4, 8 or 16; 0: the bulk copy), row_bytes (the rows the warps
// take, at least 1).
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi {

inline constexpr const char kCopyRateOp[] = "jax_ep_copy_rate";

using U8 = ::xla::ffi::Buffer<::xla::ffi::U8>;

// Validates the attributes and that the result has the operand's shape; `gpu` allows warps 0.
::xla::ffi::Error CheckCopyRateArgs(const U8& x, ::xla::ffi::Result<U8> out, int64_t warps,
                                    int64_t words_in_flight, int64_t row_bytes, bool gpu);

// The handlers (C symbols, wrapped in capsules by module.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(CopyRateCpu);
#ifdef JAX_EP_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(CopyRateCuda);
#endif

}  // namespace jax_ep::ffi
