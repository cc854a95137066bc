// CUDA handler of "jax_ep_dispatch_layout": the shared checks, then the kernel of
// cuda/layout.cu on XLA's stream. Compiled only when the CUDA kernels are built.
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/api.h"
#include "ffi/ffi_helpers.h"
#include "ffi/layout.h"

namespace jax_ep::ffi {
namespace {

xffi::Error LayoutCudaImpl(cudaStream_t stream,
                           S32 topk_idx,
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
  // The checks above bound every size by 2^31 - 1.
  const cudaError_t status = cuda::dispatch_layout(topk_idx.typed_data(),
                                                   static_cast<int>(topk_idx.dimensions()[0]),
                                                   static_cast<int>(topk_idx.dimensions()[1]),
                                                   static_cast<int>(num_experts),
                                                   static_cast<int>(num_ranks),
                                                   num_tokens_per_rank->typed_data(),
                                                   num_tokens_per_expert->typed_data(),
                                                   is_token_in_rank->typed_data(),
                                                   num_invalid->typed_data(),
                                                   stream);
  if (status != cudaSuccess) {
    return xffi::Error::Internal(std::string("CUDA error in ") + kLayoutOp + ": " +
                                cuda::error_text(status));
  }
  return xffi::Error::Success();
}

}  // namespace

// Command-buffer compatible: it only launches one kernel, allocates nothing and never waits
// on the stream, so XLA may capture it into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(LayoutCuda,
                              LayoutCudaImpl,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<S32>()   // topk_idx [T, K]
                                  .Ret<S32>()   // num_tokens_per_rank [R]
                                  .Ret<S32>()   // num_tokens_per_expert [E]
                                  .Ret<Pred>()  // is_token_in_rank [T, R]
                                  .Ret<S32>()   // num_invalid []
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks"),
                              {xffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ep::ffi
