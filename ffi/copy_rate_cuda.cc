// CUDA handler of "jax_ep_copy_rate": the shared checks, then the kernel of cuda/copy_rate.cu
// on XLA's stream. Compiled only when the CUDA kernels are built.
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/api.h"
#include "ffi/copy_rate.h"
#include "ffi/ffi_helpers.h"

namespace jax_ep::ffi {
namespace {

xffi::Error CopyRateCudaImpl(cudaStream_t stream, U8 x, xffi::Result<U8> out, int64_t warps,
                             int64_t words_in_flight, int64_t row_bytes) {
  JAX_EP_RETURN_IF_ERROR(CheckCopyRateArgs(x, out, warps, words_in_flight, row_bytes, true));
  // The checks bound warps, words_in_flight and row_bytes to int.
  const cudaError_t status =
      cuda::copy_rate(x.typed_data(), out->typed_data(), static_cast<int64_t>(x.element_count()),
                      row_bytes, static_cast<int>(warps), static_cast<int>(words_in_flight),
                      stream);
  if (status != cudaSuccess) {
    return xffi::Error::Internal(std::string("CUDA error in ") + kCopyRateOp + ": " +
                                 cuda::error_text(status));
  }
  return xffi::Error::Success();
}

}  // namespace

// Command-buffer compatible: one launch, nothing allocated, no wait on the stream.
XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyRateCuda,
                              CopyRateCudaImpl,
                              xffi::Ffi::Bind()
                                  .Ctx<xffi::PlatformStream<cudaStream_t>>()
                                  .Arg<U8>()  // x
                                  .Ret<U8>()  // its copy
                                  .Attr<int64_t>("warps")
                                  .Attr<int64_t>("words_in_flight")
                                  .Attr<int64_t>("row_bytes"),
                              {xffi::Traits::kCmdBufferCompatible});

}  // namespace jax_ep::ffi
