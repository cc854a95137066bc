// CPU handlers of the exchange targets: the phases of cuda/exchange.h on the CPU, so the CPU
// results are the kernels' results (the same bodies, the same rounding).
//
// With virtual ranks (all R ranks stacked in one call) they run the ops of cuda/virtual_ops.h,
// as the virtual-rank kernels do (cuda/exchange.cu). With one rank per device (R > 1
// CPU devices in shard_map) each device's handler runs the ops of cuda/peer_ops.h through host
// peers (cuda/host_peers.h), meeting the other devices' handlers at barriers. Either way the
// phases run on the grid of $JAX_EP_CPU_GRID (cuda/host_launch.h): a plain loop by default,
// GPU-shaped warps and blocks when asked.
#include <cstdint>
#include <cstring>
#include <string>

#include "cuda/host_launch.h"
#include "cuda/host_peers.h"
#include "cuda/virtual_ops.h"
#include "ffi/exchange.h"

namespace jax_ep::ffi {
namespace {

// The CPU launcher of cuda/virtual_ops.h: every launch over all R ranks on the grid.
struct HostLauncher {
  int ranks;
  HostGrid grid;
  template <typename Phase>
  void per_thread(const Phase& phase, int64_t items) {
    host_per_thread(phase, 0, ranks, items, grid);
  }
  template <typename Phase>
  void per_warp(const Phase& phase, int64_t items) {
    host_per_warp(phase, 0, ranks, items, grid);
  }
};

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

// Rows of received data past a count are unspecified (docs/contract.md, "Padding"). On the
// CPU they hold all-ones bytes, a NaN in every float type the ops move, written before the op
// runs: a consumer that reads them fails loudly in tests instead of finding zeros by chance.
void Poison(void* data, int64_t bytes) {
  if (bytes > 0) std::memset(data, 0xFF, static_cast<size_t>(bytes));
}

// Where a call's ranks are and the grid its phases run on.
struct Placement {
  bool between;  // one rank of several devices: host peers
  int rank;      // the first stacked rank's EP rank (this device's, between devices)
  HostGrid grid;
};

// Parses the ranks operand (args[stacked_operand] stacks the op's ranks) and the grid.
xffi::Error Place(const char* op, const xffi::AnyBuffer& ranks, const xffi::RemainingArgs& args,
                  size_t stacked_operand, int num_ranks, Placement* at) {
  const int32_t* data = nullptr;
  JAX_EP_RETURN_IF_ERROR(
      ParseRanks(op, ranks, args, stacked_operand, num_ranks, &at->between, &data));
  at->rank = data[0];
  return Grid(op, &at->grid);
}

xffi::Error DispatchCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                            xffi::RemainingRets rets, int64_t num_ranks, int64_t num_experts,
                            int64_t capacity, int64_t expert_major, int64_t zero_padding) {
  DispatchArgs a;
  JAX_EP_RETURN_IF_ERROR(
      ParseDispatch(args, rets, num_ranks, num_experts, capacity, expert_major, &a));
  a.zero_padding = zero_padding != 0;
  Placement at;
  JAX_EP_RETURN_IF_ERROR(Place(kDispatchOp, ranks, args, 2, a.num_ranks, &at));
  if (!a.zero_padding) {
    const int64_t rows = (at.between ? 1 : a.num_ranks) * int64_t{a.capacity};
    Poison(a.recv_x, rows * a.row_bytes);
    Poison(a.recv_scales, rows * a.scale_cols * 4);
  }
  if (at.between) return Done(host::dispatch(a, at.rank, at.grid));
  HostLauncher l{a.num_ranks, at.grid};
  run_virtual_dispatch(l, a);
  return xffi::Error::Success();
}

template <typename T>
xffi::Error Combine(const CombineArgs<float>& untyped, const Placement& at) {
  const CombineArgs<T> a = Retype<T>(untyped);
  if (at.between) return Done(host::combine(a, at.rank, at.grid));
  HostLauncher l{a.num_ranks, at.grid};
  run_virtual_combine(l, a);
  return xffi::Error::Success();
}

xffi::Error CombineCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                           xffi::RemainingRets rets, int64_t num_ranks, int64_t expert_major) {
  CombineArgs<float> a;
  RowType type;
  JAX_EP_RETURN_IF_ERROR(ParseCombine(args, rets, num_ranks, expert_major, &type, &a));
  Placement at;
  JAX_EP_RETURN_IF_ERROR(Place(kCombineOp, ranks, args, 0, a.num_ranks, &at));
  switch (type) {
    case RowType::kF32: return Combine<float>(a, at);
    case RowType::kBF16: return Combine<Bf16>(a, at);
    case RowType::kF16: return Combine<F16>(a, at);
  }
  return xffi::Error::Internal("jax_ep_combine: unknown row type");
}

xffi::Error LowLatencyDispatch(int op, const LowLatencyArgs& a, const Placement& at) {
  if (at.between) return Done(host::ll_dispatch(op, a, at.rank, at.grid));
  HostLauncher l{a.num_ranks, at.grid};
  run_virtual_ll_dispatch(l, op, a);
  return xffi::Error::Success();
}

xffi::Error LowLatencyDispatchSendCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                                          xffi::RemainingRets rets, int64_t num_ranks,
                                          int64_t num_experts, int64_t use_fp8) {
  LowLatencyArgs a;
  JAX_EP_RETURN_IF_ERROR(
      ParseLowLatencyDispatchSend(args, rets, num_ranks, num_experts, use_fp8, &a));
  Placement at;
  JAX_EP_RETURN_IF_ERROR(Place(kLowLatencyDispatchSendOp, ranks, args, 1, a.num_ranks, &at));
  const int64_t slots = (at.between ? 1 : a.num_ranks) * a.experts_per_rank() * a.slots();
  Poison(a.recv_x, slots * a.row_bytes());
  if (a.use_fp8) Poison(a.recv_scales, slots * (a.hidden / kFp8Block) * 4);
  return LowLatencyDispatch(kPeerLlDispatchSend, a, at);
}

xffi::Error LowLatencyDispatchRecvCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                                          xffi::RemainingRets rets, int64_t num_ranks,
                                          int64_t num_experts) {
  LowLatencyArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyDispatchRecv(args, rets, num_ranks, num_experts, &a));
  Placement at;
  JAX_EP_RETURN_IF_ERROR(Place(kLowLatencyDispatchRecvOp, ranks, args, 0, a.num_ranks, &at));
  return LowLatencyDispatch(kPeerLlDispatchRecv, a, at);
}

xffi::Error LowLatencyCombineSendCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                                         xffi::RemainingRets rets, int64_t num_ranks,
                                         int64_t num_experts) {
  LowLatencyCombineArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyCombineSend(args, rets, num_ranks, num_experts, &a));
  Placement at;
  JAX_EP_RETURN_IF_ERROR(Place(kLowLatencyCombineSendOp, ranks, args, 0, a.num_ranks, &at));
  return Done(host::ll_combine(kPeerLlCombineSend, a, at.rank, at.grid));  // between only
}

xffi::Error LowLatencyCombineRecvCpuImpl(xffi::AnyBuffer ranks, xffi::RemainingArgs args,
                                         xffi::RemainingRets rets, int64_t num_ranks,
                                         int64_t num_experts) {
  LowLatencyCombineArgs a;
  JAX_EP_RETURN_IF_ERROR(ParseLowLatencyCombineRecv(args, rets, num_ranks, num_experts, &a));
  Placement at;
  JAX_EP_RETURN_IF_ERROR(Place(kLowLatencyCombineRecvOp, ranks, args, 2, a.num_ranks, &at));
  if (at.between) return Done(host::ll_combine(kPeerLlCombineRecv, a, at.rank, at.grid));
  HostLauncher l{a.num_ranks, at.grid};
  run_virtual_ll_combine(l, a);
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
                                  .Attr<int64_t>("expert_major")
                                  .Attr<int64_t>("zero_padding"));

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
