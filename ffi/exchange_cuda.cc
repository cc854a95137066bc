// CUDA handlers of the exchange targets: the parsers of exchange.cc, then, on XLA's stream,
// the kernels of cuda/exchange.cu (virtual ranks) or of cuda/peer_exchange.cu (one rank per
// device). Not marked command-buffer compatible: the peers path sets up its barrier state on
// first use.
#include <cuda_runtime_api.h>

#include <string>

#include "cuda/kernels.h"
#include "cuda/peer_exchange.h"
#include "ffi/exchange.h"

namespace jax_ep::ffi {
namespace {

using Stream = xffi::PlatformStream<cudaStream_t>;

xffi::Error Done(const PeerError& error) {
  return error.ok() ? xffi::Error::Success() : xffi::Error::Internal(error.message);
}

xffi::Error Launched(const char* op, cudaError_t status) {
  if (status == cudaSuccess) return xffi::Error::Success();
  return xffi::Error::Internal(std::string("CUDA error in ") + op + ": " +
                               cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

xffi::Error DispatchCudaImpl(cudaStream_t stream, xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                             xffi::RemainingRets rets, int64_t num_ranks, int64_t num_experts,
                             int64_t capacity, int64_t expert_major, int64_t zero_padding) {
  DispatchArgs a;
  JAX_EP_RETURN_IF_ERROR(
      ParseDispatch(args, rets, num_ranks, num_experts, capacity, expert_major, &a));
  a.zero_padding = zero_padding != 0;
  bool between;
  const int32_t* axis;
  JAX_EP_RETURN_IF_ERROR(
      ParseRanks(kDispatchOp, ranks, args, 2, a.num_ranks, &between, &axis));
  if (between) return Done(cuda::peer_dispatch(a, axis, stream));
  return Launched(kDispatchOp, cuda::launch_dispatch(a, stream));
}

xffi::Error CombineCudaImpl(cudaStream_t stream, xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                            xffi::RemainingRets rets, int64_t num_ranks, int64_t expert_major) {
  CombineArgs<float> a;
  RowType type;
  JAX_EP_RETURN_IF_ERROR(ParseCombine(args, rets, num_ranks, expert_major, &type, &a));
  bool between;
  const int32_t* axis;
  JAX_EP_RETURN_IF_ERROR(
      ParseRanks(kCombineOp, ranks, args, 0, a.num_ranks, &between, &axis));
  if (between) {
    switch (type) {
      case RowType::kF32: return Done(cuda::peer_combine(a, axis, stream));
      case RowType::kBF16: return Done(cuda::peer_combine(Retype<Bf16>(a), axis, stream));
      case RowType::kF16: return Done(cuda::peer_combine(Retype<F16>(a), axis, stream));
    }
  }
  cudaError_t status = cudaSuccess;
  switch (type) {
    case RowType::kF32: status = cuda::launch_combine(a, stream); break;
    case RowType::kBF16: status = cuda::launch_combine(Retype<Bf16>(a), stream); break;
    case RowType::kF16: status = cuda::launch_combine(Retype<F16>(a), stream); break;
  }
  return Launched(kCombineOp, status);
}

xffi::Error LowLatencyDispatchSendCudaImpl(cudaStream_t stream, xffi::AnyBuffer ranks,
                                           xffi::RemainingArgs args, xffi::RemainingRets rets,
                                           int64_t num_ranks, int64_t num_experts,
                                           int64_t use_fp8) {
  LowLatencyArgs a;
  JAX_EP_RETURN_IF_ERROR(
      ParseLowLatencyDispatchSend(args, rets, num_ranks, num_experts, use_fp8, &a));
  bool between;
  const int32_t* axis;
  JAX_EP_RETURN_IF_ERROR(
      ParseRanks(kLowLatencyDispatchSendOp, ranks, args, 1, a.num_ranks, &between, &axis));
  if (between) return Done(cuda::peer_ll_dispatch(kPeerLlDispatchSend, a, axis, stream));
  return Launched(kLowLatencyDispatchSendOp,
                  cuda::launch_ll_dispatch(kPeerLlDispatchSend, a, stream));
}

xffi::Error LowLatencyDispatchRecvCudaImpl(cudaStream_t stream, xffi::AnyBuffer ranks,
                                           xffi::RemainingArgs args, xffi::RemainingRets rets,
                                           int64_t num_ranks, int64_t num_experts) {
  LowLatencyArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyDispatchRecv(args, rets, num_ranks, num_experts, &a));
  bool between;
  const int32_t* axis;
  JAX_EP_RETURN_IF_ERROR(
      ParseRanks(kLowLatencyDispatchRecvOp, ranks, args, 0, a.num_ranks, &between, &axis));
  if (between) return Done(cuda::peer_ll_dispatch(kPeerLlDispatchRecv, a, axis, stream));
  return Launched(kLowLatencyDispatchRecvOp,
                  cuda::launch_ll_dispatch(kPeerLlDispatchRecv, a, stream));
}

xffi::Error LowLatencyCombineSendCudaImpl(cudaStream_t stream, xffi::AnyBuffer ranks,
                                          xffi::RemainingArgs args, xffi::RemainingRets rets,
                                          int64_t num_ranks, int64_t num_experts) {
  LowLatencyCombineArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyCombineSend(args, rets, num_ranks, num_experts, &a));
  bool between;
  const int32_t* axis;
  JAX_EP_RETURN_IF_ERROR(
      ParseRanks(kLowLatencyCombineSendOp, ranks, args, 0, a.num_ranks, &between, &axis));
  return Done(cuda::peer_ll_combine(kPeerLlCombineSend, a, axis, stream));  // between only
}

xffi::Error LowLatencyCombineRecvCudaImpl(cudaStream_t stream, xffi::AnyBuffer ranks,
                                          xffi::RemainingArgs args, xffi::RemainingRets rets,
                                          int64_t num_ranks, int64_t num_experts) {
  LowLatencyCombineArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyCombineRecv(args, rets, num_ranks, num_experts, &a));
  bool between;
  const int32_t* axis;
  JAX_EP_RETURN_IF_ERROR(
      ParseRanks(kLowLatencyCombineRecvOp, ranks, args, 2, a.num_ranks, &between, &axis));
  if (between) return Done(cuda::peer_ll_combine(kPeerLlCombineRecv, a, axis, stream));
  return Launched(kLowLatencyCombineRecvOp, cuda::launch_ll_combine(a, stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchCuda, DispatchCudaImpl,
                              xffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("expert_major")
                                  .Attr<int64_t>("zero_padding"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineCuda, CombineCudaImpl,
                              xffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("expert_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchSendCuda, LowLatencyDispatchSendCudaImpl,
                              xffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("use_fp8"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchRecvCuda, LowLatencyDispatchRecvCudaImpl,
                              xffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineSendCuda, LowLatencyCombineSendCudaImpl,
                              xffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineRecvCuda, LowLatencyCombineRecvCudaImpl,
                              xffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts"));

}  // namespace jax_ep::ffi
