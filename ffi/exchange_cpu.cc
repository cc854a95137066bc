// CPU handlers of the exchange targets: the phases of cuda/exchange.h on the CPU, so the CPU
// results are the kernels' results (the same bodies, the same rounding).
//
// With virtual ranks (all R ranks stacked in one call) the phases run over every rank in
// order, as the virtual-rank kernels do (cuda/exchange.cu). With one rank per device (R > 1
// CPU devices in shard_map) each device's handler runs the ops of cuda/peer_ops.h through host
// peers (cuda/host_peers.h), meeting the other devices' handlers at barriers. Either way the
// phases run on the grid of $JAX_EP_CPU_GRID (cuda/host_launch.h): a plain loop by default,
// GPU-shaped warps and blocks when asked.
#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/host_launch.h"
#include "cuda/host_peers.h"
#include "cuda/phase_functors.h"
#include "ffi/exchange.h"

namespace jax_ep::ffi {
namespace {

using Peers = VirtualPeers;

// The grid of the phases; an error when $JAX_EP_CPU_GRID is malformed.
xffi::Error Grid(const char* op, HostGrid* grid) {
  std::string error;
  *grid = cpu_handler_grid(&error);
  if (error.empty()) return xffi::Error::Success();
  return xffi::Error::InvalidArgument(std::string(op) + ": " + error);
}

xffi::Error Done(const PeerError& error) {
  return error.ok() ? xffi::Error::Success() : xffi::Error::Internal(error.message);
}

// Parses the ranks operand and the grid; `*between` and `*rank` say where the ranks are.
xffi::Error Place(const char* op, const xffi::AnyBuffer& ranks, int64_t stacked, int num_ranks,
                  bool* between, int* rank, HostGrid* grid) {
  const int32_t* data = nullptr;
  JAX_EP_RETURN_IF_ERROR(ParseRanks(op, ranks, stacked, num_ranks, between, &data));
  *rank = data[0];
  return Grid(op, grid);
}

xffi::Error DispatchCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                            xffi::RemainingRets rets, int64_t num_ranks, int64_t num_experts,
                            int64_t capacity, int64_t expert_major) {
  DispatchArgs a;
  JAX_EP_RETURN_IF_ERROR(
      ParseDispatch(args, rets, num_ranks, num_experts, capacity, expert_major, &a));
  bool between;
  int rank;
  HostGrid g;
  JAX_EP_RETURN_IF_ERROR(Place(kDispatchOp, ranks, args.get<xffi::AnyBuffer>(2)->dimensions()[0],
                               a.num_ranks, &between, &rank, &g));
  if (between) return Done(host::dispatch(a, rank, g));
  const int R = a.num_ranks;
  host_per_warp(DispatchCount<Peers>{a}, 0, R, a.num_counters() + 1, g);
  host_per_thread(DispatchBases{a}, 0, R, a.num_counters(), g);
  host_per_warp(DispatchSend<Peers>{a}, 0, R, a.num_tokens, g);
  const int items = std::max({a.capacity, a.rows(), a.experts_per_rank()});
  host_per_warp(DispatchFinish<Peers>{a}, 0, R, items, g);
  return xffi::Error::Success();
}

template <typename T>
xffi::Error Combine(const CombineArgs<float>& untyped, bool between, int rank,
                    const HostGrid& g) {
  const CombineArgs<T> a = Retype<T>(untyped);
  if (between) return Done(host::combine(a, rank, g));
  const int R = a.num_ranks;
  if (a.expert_major) {
    host_per_warp(CombineReduceEntries<T>{a}, 0, R, static_cast<int64_t>(R) * a.num_tokens, g);
  }
  host_per_warp(CombineToken<T, Peers>{a}, 0, R, a.num_tokens, g);
  return xffi::Error::Success();
}

xffi::Error CombineCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                           xffi::RemainingRets rets, int64_t num_ranks, int64_t expert_major) {
  CombineArgs<float> a;
  RowType type;
  JAX_EP_RETURN_IF_ERROR(ParseCombine(args, rets, num_ranks, expert_major, &type, &a));
  bool between;
  int rank;
  HostGrid g;
  JAX_EP_RETURN_IF_ERROR(Place(kCombineOp, ranks, args.get<xffi::AnyBuffer>(0)->dimensions()[0],
                               a.num_ranks, &between, &rank, &g));
  switch (type) {
    case RowType::kF32: return Combine<float>(a, between, rank, g);
    case RowType::kBF16: return Combine<Bf16>(a, between, rank, g);
    case RowType::kF16: return Combine<F16>(a, between, rank, g);
  }
  return xffi::Error::Internal("jax_ep_combine: unknown row type");
}

xffi::Error LowLatencyDispatchSendCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                                          xffi::RemainingRets rets, int64_t num_ranks,
                                          int64_t num_experts, int64_t use_fp8) {
  LowLatencyArgs a;
  JAX_EP_RETURN_IF_ERROR(
      ParseLowLatencyDispatchSend(args, rets, num_ranks, num_experts, use_fp8, &a));
  bool between;
  int rank;
  HostGrid g;
  JAX_EP_RETURN_IF_ERROR(Place(kLowLatencyDispatchSendOp, ranks,
                               args.get<xffi::AnyBuffer>(1)->dimensions()[0], a.num_ranks,
                               &between, &rank, &g));
  if (between) return Done(host::ll_dispatch_send(a, rank, g));
  host_per_warp(LowLatencyCount<Peers>{a}, 0, a.num_ranks, a.num_experts + 1, g);
  host_per_warp(LowLatencySend<Peers>{a}, 0, a.num_ranks, a.num_tokens, g);
  return xffi::Error::Success();
}

xffi::Error LowLatencyDispatchRecvCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                                          xffi::RemainingRets rets, int64_t num_ranks,
                                          int64_t num_experts) {
  LowLatencyArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyDispatchRecv(args, rets, num_ranks, num_experts, &a));
  bool between;
  int rank;
  HostGrid g;
  JAX_EP_RETURN_IF_ERROR(Place(kLowLatencyDispatchRecvOp, ranks,
                               args.get<xffi::AnyBuffer>(0)->dimensions()[0], a.num_ranks,
                               &between, &rank, &g));
  if (between) return Done(host::ll_dispatch_recv(a, rank, g));
  host_per_warp(LowLatencyFinish<Peers>{a}, 0, a.num_ranks, a.experts_per_rank() * a.slots(), g);
  return xffi::Error::Success();
}

xffi::Error LowLatencyCombineSendCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                                         xffi::RemainingRets rets, int64_t num_ranks,
                                         int64_t num_experts) {
  LowLatencyCombineArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyCombineSend(args, rets, num_ranks, num_experts, &a));
  bool between;
  int rank;
  HostGrid g;
  JAX_EP_RETURN_IF_ERROR(Place(kLowLatencyCombineSendOp, ranks,
                               args.get<xffi::AnyBuffer>(0)->dimensions()[0], a.num_ranks,
                               &between, &rank, &g));
  if (between) return Done(host::ll_combine_send(a, rank, g));
  host_per_warp(LowLatencyCombineSend<Peers>{a}, 0, a.num_ranks,
                static_cast<int64_t>(a.num_ranks) * a.num_tokens, g);
  return xffi::Error::Success();
}

xffi::Error LowLatencyCombineRecvCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                                         xffi::RemainingRets rets, int64_t num_ranks,
                                         int64_t num_experts) {
  LowLatencyCombineArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyCombineRecv(args, rets, num_ranks, num_experts, &a));
  bool between;
  int rank;
  HostGrid g;
  JAX_EP_RETURN_IF_ERROR(Place(kLowLatencyCombineRecvOp, ranks,
                               args.get<xffi::AnyBuffer>(0)->dimensions()[0], a.num_ranks,
                               &between, &rank, &g));
  if (between) return Done(host::ll_combine_recv(a, rank, g));
  host_per_warp(LowLatencyCombineToken{a}, 0, a.num_ranks, a.num_tokens, g);
  return xffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchCpu, DispatchCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("expert_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineCpu, CombineCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("expert_major"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchSendCpu, LowLatencyDispatchSendCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("use_fp8"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchRecvCpu, LowLatencyDispatchRecvCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineSendCpu, LowLatencyCombineSendCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineRecvCpu, LowLatencyCombineRecvCpuImpl,
                              xffi::Ffi::Bind()
                                  .Arg<xffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("num_ranks")
                                  .Attr<int64_t>("num_experts"));

}  // namespace jax_ep::ffi
