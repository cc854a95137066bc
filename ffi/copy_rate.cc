// CPU handler of "jax_ep_copy_rate", and the argument checks both handlers share. The CPU runs
// the GPU's body (cuda/copy_rate.h) on a grid of 32-lane warps, so CI checks the very copy
// the kernel times: every lane's words, the narrower units of a row whose size or place is
// not a multiple of 16, and the split of the rows among the warps.
#include "ffi/copy_rate.h"

#include <string>

#include "cuda/copy_rate.h"
#include "cuda/host_launch.h"
#include "ffi/ffi_helpers.h"

namespace jax_ep::ffi {
namespace {

xffi::Error CopyRateCpuImpl(U8 x, xffi::Result<U8> out, int64_t warps, int64_t words_in_flight,
                            int64_t row_bytes) {
  JAX_EP_RETURN_IF_ERROR(CheckCopyRateArgs(x, out, warps, words_in_flight, row_bytes, false));
  const CopyRateArgs a{reinterpret_cast<const char*>(x.typed_data()),
                       reinterpret_cast<char*>(out->typed_data()),
                       static_cast<int64_t>(x.element_count()), row_bytes, warps};
  HostGrid grid;
  grid.lanes = 32;  // the GPU's warp (cuda/host_launch.h)
  with_copy_rate_body(a, words_in_flight, [&](const auto& body) {
    host_per_warp(body, 0, 1, a.bytes > 0 ? warps : 0, grid);
  });
  return xffi::Error::Success();
}

}  // namespace

xffi::Error CheckCopyRateArgs(const U8& x, xffi::Result<U8> out, int64_t warps,
                              int64_t words_in_flight, int64_t row_bytes, bool gpu) {
  const std::string op = kCopyRateOp;
  if (words_in_flight != 0 && words_in_flight != 4 && words_in_flight != 8 &&
      words_in_flight != 16) {
    return xffi::Error::InvalidArgument(op + ": words_in_flight must be 4, 8 or 16 (0: the "
                                        "bulk copy), got " + std::to_string(words_in_flight));
  }
  // Each warp is a block of the launch (at most 2^31 - 1 on a GPU).
  if (warps < (gpu ? 0 : 1) || warps > INT32_MAX) {
    return xffi::Error::InvalidArgument(
        op + ": warps must be in [" + (gpu ? "0" : "1") + ", 2^31 - 1]" +
        (gpu ? " (0: one per SM)" : "") + ", got " + std::to_string(warps));
  }
  if (row_bytes < 1 || row_bytes > INT32_MAX) {
    return xffi::Error::InvalidArgument(op + ": row_bytes must be in [1, 2^31 - 1], got " +
                                        std::to_string(row_bytes));
  }
  const auto in_dims = x.dimensions(), out_dims = out->dimensions();
  bool same = in_dims.size() == out_dims.size();
  for (size_t i = 0; same && i < in_dims.size(); ++i) same = in_dims[i] == out_dims[i];
  if (!same) {
    return xffi::Error::InvalidArgument(op + ": the result must have the shape of x, " +
                                        DimsToString(in_dims) + ", got " +
                                        DimsToString(out_dims));
  }
  return xffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyRateCpu,
                              CopyRateCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<U8>()  // x
                                  .Ret<U8>()  // its copy
                                  .Attr<int64_t>("warps")
                                  .Attr<int64_t>("words_in_flight")
                                  .Attr<int64_t>("row_bytes"));

}  // namespace jax_ep::ffi
