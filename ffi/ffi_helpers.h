// Checks shared by the FFI handlers. Each returns ffi::Error::InvalidArgument with a message
// that names the op and the argument, what was expected and what was received, e.g.
// "jax_ep_dispatch_layout: topk_idx must be rank 2, got rank 3". Handlers return errors and
// never throw: an exception must not cross the FFI boundary.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi {

namespace xffi = ::xla::ffi;

// Any dimension, in the shapes given to CheckDims.
inline constexpr int64_t kAnyDim = -1;

inline std::string DimsToString(xffi::Span<const int64_t> dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
}

// `buffer` must have `rank` dimensions.
template <typename Buffer>
xffi::Error CheckRank(std::string_view op,
                      std::string_view name,
                      const Buffer& buffer,
                      size_t rank) {
  const size_t got = buffer.dimensions().size();
  if (got == rank) return xffi::Error::Success();
  std::ostringstream msg;
  msg << op << ": " << name << " must be rank " << rank << ", got rank " << got << " (shape "
      << DimsToString(buffer.dimensions()) << ")";
  return xffi::Error::InvalidArgument(msg.str());
}

// `buffer` must have exactly the dimensions `want` (kAnyDim matches any size).
template <typename Buffer>
xffi::Error CheckDims(std::string_view op,
                      std::string_view name,
                      const Buffer& buffer,
                      std::initializer_list<int64_t> want) {
  const auto dims = buffer.dimensions();
  bool ok = dims.size() == want.size();
  size_t i = 0;
  for (int64_t w : want) {
    if (!ok) break;
    ok = w == kAnyDim || dims[i++] == w;
  }
  if (ok) return xffi::Error::Success();
  std::ostringstream msg;
  msg << op << ": " << name << " must have shape [";
  i = 0;
  for (int64_t w : want) {
    msg << (i++ ? ", " : "");
    if (w == kAnyDim) {
      msg << "?";
    } else {
      msg << w;
    }
  }
  msg << "], got " << DimsToString(dims);
  return xffi::Error::InvalidArgument(msg.str());
}

}  // namespace jax_ep::ffi

#define JAX_EP_RETURN_IF_ERROR(expr)       \
  do {                                     \
    ::xla::ffi::Error _status = (expr);    \
    if (_status.failure()) return _status; \
  } while (0)
