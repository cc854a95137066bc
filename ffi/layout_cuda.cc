// CUDA handler of "jax_ep_dispatch_layout": checks, then the kernel on XLA's stream.
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/api.h"
#include "ffi/ffi_helpers.h"
#include "ffi/layout.h"

namespace jax_ep::ffi {
namespace {

namespace xffi = ::xla::ffi;

xffi::Error LayoutCudaImpl(cudaStream_t stream,
                           S32 topk_idx,
                           xffi::Result<S32> per_rank,
                           xffi::Result<S32> per_expert,
                           xffi::Result<Pred> in_rank,
                           xffi::Result<S32> invalid,
                           int64_t num_experts,
                           int64_t num_ranks) {
  JAX_EP_RETURN_IF_ERROR(
      CheckLayoutArgs(topk_idx, per_rank, per_expert, in_rank, invalid, num_experts, num_ranks));
  if (num_experts + num_ranks > cuda::dispatch_layout_max_counters()) {
    return xffi::Error::InvalidArgument(
        std::string(kLayoutOp) + ": num_experts + num_ranks (" +
        std::to_string(num_experts + num_ranks) + ") exceeds the kernel's limit of " +
        std::to_string(cuda::dispatch_layout_max_counters()));
  }
  const cudaError_t status = cuda::dispatch_layout(topk_idx.typed_data(),
                                                   static_cast<int>(topk_idx.dimensions()[0]),
                                                   static_cast<int>(topk_idx.dimensions()[1]),
                                                   static_cast<int>(num_experts),
                                                   static_cast<int>(num_ranks),
                                                   per_rank->typed_data(),
                                                   per_expert->typed_data(),
                                                   in_rank->typed_data(),
                                                   invalid->typed_data(),
                                                   stream);
  if (status != cudaSuccess) {
    // NOTE: the error may come from an earlier asynchronous launch on this stream.
    return xffi::Error::Internal(std::string("CUDA error in ") + kLayoutOp + ": " +
                                 cudaGetErrorString(status));
  }
  return xffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep::ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLayoutCuda,
                              jax_ep::ffi::LayoutCudaImpl,
                              ::xla::ffi::Ffi::Bind()
                                  .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>()       // topk_idx
                                  .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()       // per rank
                                  .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()       // per expert
                                  .Ret<::xla::ffi::Buffer<::xla::ffi::PRED>>()  // token in rank
                                  .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>()   // invalid ids
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks"),
                              {::xla::ffi::Traits::kCmdBufferCompatible});
