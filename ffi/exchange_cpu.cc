// CPU handlers of the exchange targets: the phases of cuda/exchange.h run in loops, one lane,
// so the CPU results are the kernels' results (the same bodies, the same rounding).
#include <cstdint>
#include <string>

#include "ffi/exchange.h"

namespace jax_ep::ffi {
namespace {

constexpr VirtualPeers kPeers{};

// The CPU handlers run virtual ranks only: every rank's operands in one call.
xffi::Error AllRanksHere(const char* op, int stacked, int num_ranks) {
  if (stacked == num_ranks) return xffi::Error::Success();
  return xffi::Error::InvalidArgument(
      std::string(op) + ": on CPU the exchange runs with virtual ranks only (all " +
      std::to_string(num_ranks) + " ranks stacked in one call, jax_ep.virtual); between "
      "devices it needs GPUs with NVSHMEM (jax_ep.initialize()). Use backend='xla' here.");
}

xffi::Error DispatchCpuImpl(xffi::RemainingArgs args, xffi::RemainingRets rets,
                            int64_t num_ranks, int64_t num_experts, int64_t capacity,
                            int64_t expert_major) {
  DispatchArgs a;
  JAX_EP_RETURN_IF_ERROR(
      ParseDispatch(args, rets, num_ranks, num_experts, capacity, expert_major, &a));
  JAX_EP_RETURN_IF_ERROR(AllRanksHere(kDispatchOp, args.get<xffi::AnyBuffer>(2)->dimensions()[0], a.num_ranks));
  const int R = a.num_ranks, T = a.num_tokens;
  for (int s = 0; s < R; ++s) {
    for (int c = 0; c <= a.num_counters(); ++c) dispatch_count(a, kPeers, s, c, 0, 1);
  }
  for (int s = 0; s < R; ++s) {
    for (int c = 0; c < a.num_counters(); ++c) dispatch_bases(a, s, c);
  }
  for (int s = 0; s < R; ++s) {
    for (int t = 0; t < T; ++t) dispatch_send(a, kPeers, s, t, 0, 1);
  }
  const int items = a.capacity > a.rows() ? a.capacity : a.rows();
  for (int d = 0; d < R; ++d) {
    for (int i = 0; i < items || i < a.experts_per_rank(); ++i) {
      dispatch_finish(a, kPeers, d, i, 0, 1);
    }
  }
  return xffi::Error::Success();
}

template <typename T>
void Combine(const CombineArgs<float>& untyped) {
  const CombineArgs<T> a = Retype<T>(untyped);
  const int R = a.num_ranks, rows = a.num_ranks * a.num_tokens;
  if (a.expert_major) {
    for (int d = 0; d < R; ++d) {
      for (int i = 0; i < rows; ++i) combine_reduce_entries(a, d, i, 0, 1);
    }
  }
  for (int s = 0; s < R; ++s) {
    for (int t = 0; t < a.num_tokens; ++t) combine_token(a, kPeers, s, t, 0, 1);
  }
}

xffi::Error CombineCpuImpl(xffi::RemainingArgs args, xffi::RemainingRets rets,
                           int64_t num_ranks, int64_t expert_major) {
  CombineArgs<float> a;
  RowType type;
  JAX_EP_RETURN_IF_ERROR(ParseCombine(args, rets, num_ranks, expert_major, &type, &a));
  JAX_EP_RETURN_IF_ERROR(AllRanksHere(kCombineOp, args.get<xffi::AnyBuffer>(0)->dimensions()[0], a.num_ranks));
  switch (type) {
    case RowType::kF32: Combine<float>(a); break;
    case RowType::kBF16: Combine<Bf16>(a); break;
    case RowType::kF16: Combine<F16>(a); break;
  }
  return xffi::Error::Success();
}

xffi::Error LowLatencyDispatchSendCpuImpl(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                          int64_t num_ranks, int64_t num_experts,
                                          int64_t use_fp8) {
  LowLatencyArgs a;
  JAX_EP_RETURN_IF_ERROR(
      ParseLowLatencyDispatchSend(args, rets, num_ranks, num_experts, use_fp8, &a));
  JAX_EP_RETURN_IF_ERROR(AllRanksHere(kLowLatencyDispatchSendOp, args.get<xffi::AnyBuffer>(1)->dimensions()[0], a.num_ranks));
  for (int s = 0; s < a.num_ranks; ++s) {
    for (int c = 0; c <= a.num_experts; ++c) ll_count(a, kPeers, s, c, 0, 1);
  }
  for (int s = 0; s < a.num_ranks; ++s) {
    for (int t = 0; t < a.num_tokens; ++t) ll_send(a, kPeers, s, t, 0, 1);
  }
  return xffi::Error::Success();
}

xffi::Error LowLatencyDispatchRecvCpuImpl(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                          int64_t num_ranks, int64_t num_experts) {
  LowLatencyArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyDispatchRecv(args, rets, num_ranks, num_experts, &a));
  JAX_EP_RETURN_IF_ERROR(AllRanksHere(kLowLatencyDispatchRecvOp, args.get<xffi::AnyBuffer>(0)->dimensions()[0], a.num_ranks));
  const int64_t rows = a.experts_per_rank() * a.slots();
  for (int d = 0; d < a.num_ranks; ++d) {
    for (int64_t r = 0; r < rows; ++r) ll_finish(a, kPeers, d, r, 0, 1);
  }
  return xffi::Error::Success();
}

xffi::Error LowLatencyCombineSendCpuImpl(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                         int64_t num_ranks, int64_t num_experts) {
  LowLatencyCombineArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyCombineSend(args, rets, num_ranks, num_experts, &a));
  JAX_EP_RETURN_IF_ERROR(AllRanksHere(kLowLatencyCombineSendOp, args.get<xffi::AnyBuffer>(0)->dimensions()[0], a.num_ranks));
  const int64_t slots = static_cast<int64_t>(a.num_ranks) * a.num_tokens;
  for (int d = 0; d < a.num_ranks; ++d) {
    for (int64_t src = 0; src < slots; ++src) ll_combine_send(a, kPeers, d, src, 0, 1);
  }
  return xffi::Error::Success();
}

xffi::Error LowLatencyCombineRecvCpuImpl(xffi::RemainingArgs args, xffi::RemainingRets rets,
                                         int64_t num_ranks, int64_t num_experts) {
  LowLatencyCombineArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyCombineRecv(args, rets, num_ranks, num_experts, &a));
  JAX_EP_RETURN_IF_ERROR(AllRanksHere(kLowLatencyCombineRecvOp, args.get<xffi::AnyBuffer>(0)->dimensions()[0], a.num_ranks));
  for (int s = 0; s < a.num_ranks; ++s) {
    for (int t = 0; t < a.num_tokens; ++t) ll_combine_token(a, s, t, 0, 1);
  }
  return xffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchCpu, DispatchCpuImpl,
                              xffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("expert_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineCpu, CombineCpuImpl,
                              xffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("expert_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchSendCpu, LowLatencyDispatchSendCpuImpl,
                              xffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("use_fp8"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchRecvCpu, LowLatencyDispatchRecvCpuImpl,
                              xffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineSendCpu, LowLatencyCombineSendCpuImpl,
                              xffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineRecvCpu, LowLatencyCombineRecvCpuImpl,
                              xffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts"));

}  // namespace jax_ep::ffi
