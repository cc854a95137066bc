// CUDA handlers of the exchange targets: the parsers of exchange.cc, then the op on XLA's
// stream (cuda/kernels.h): virtual ranks, or one rank per device through NVSHMEM or CUDA peer
// access (`device`: the CUDA device XLA runs the call on).
//
// Every handler is command-buffer compatible: XLA may record its launches into a CUDA graph
// once and replay them. A call's launches depend only on its attributes and buffers: what
// changes from call to call (arrival counts, the low-latency regions' records) lives in device
// memory and only the launches change it (cuda/peer_ops.h, Meet); one-time setup runs off the
// captured stream (cuda/setup.cuh). A failure found on the device (a timeout, a send on a
// low-latency region in flight) is reported by the next call whose handler runs: under a
// replayed graph, the next call XLA records or runs outside one.
#include <cuda_runtime_api.h>

#include <variant>

#include "cuda/kernels.h"
#include "ffi/exchange.h"

namespace jax_ep::ffi {
namespace {

using Stream = xffi::PlatformStream<cudaStream_t>;

template <int Op>
xffi::Error ExchangeCudaImpl(cudaStream_t stream, int32_t device, xffi::AnyBuffer ranks,
                             xffi::Token, xffi::RemainingArgs args, xffi::Result<xffi::Token>,
                             xffi::RemainingRets rets, xffi::Dictionary attrs) {
  Call call;
  JAX_EP_RETURN_IF_ERROR(ParseCall(Op, ranks, args, rets, attrs, &call));
  const PeerError error = std::visit(
      [&](const auto& a) {
        return cuda::run(Op, a, call.between ? call.ranks : nullptr, call.num_sms, stream,
                         call.groups, device);
      },
      call.args);
  return error.ok() ? xffi::Error::Success() : xffi::Error::Internal(error.message);
}

// The binding of every target.
auto Binding() {
  return xffi::Ffi::Bind()
      .Ctx<Stream>()
      .Ctx<xffi::DeviceOrdinal>()
      .Arg<xffi::AnyBuffer>()
      .Arg<xffi::Token>()
      .RemainingArgs()
      .Ret<xffi::Token>()
      .RemainingRets()
      .Attrs<xffi::Dictionary>();
}

}  // namespace

#define JAX_EP_DEFINE_HANDLER(Name, op)                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Name##Cuda, ExchangeCudaImpl<op>, Binding(), \
                                {xffi::Traits::kCmdBufferCompatible});
JAX_EP_FOR_EACH_EXCHANGE_TARGET(JAX_EP_DEFINE_HANDLER)
#undef JAX_EP_DEFINE_HANDLER

}  // namespace jax_ep::ffi
