// CPU handlers of the exchange targets: the phases of cuda/exchange.h on the CPU, so the CPU
// results are the kernels' results (the same bodies, the same rounding).
//
// With virtual ranks (all R ranks stacked in one call) they run the ops of cuda/virtual_ops.h,
// as the virtual-rank kernels do (cuda/exchange.cu). With one rank per device (R > 1
// CPU devices in shard_map) each device's handler runs the ops of cuda/peer_ops.h through host
// peers (cuda/host_peers.h), meeting the other devices' handlers at the same flags as the
// GPUs. Either way the phases run on the grid of $JAX_EP_CPU_GRID (cuda/host_launch.h): a
// plain loop by default, GPU-shaped warps and blocks when asked.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "cuda/host_launch.h"
#include "cuda/host_peers.h"
#include "cuda/virtual_ops.h"
#include "ffi/exchange.h"

namespace jax_ep::ffi {
namespace {

// The grid of the phases; an error when $JAX_EP_CPU_GRID is malformed.
xffi::Error Grid(const char* op, HostGrid* grid) {
  std::string error;
  *grid = cpu_handler_grid(&error);
  if (error.empty()) return xffi::Error::Success();
  return xffi::Error::InvalidArgument(std::string(op) + ": " + error);
}

// Rows of received data past a count are unspecified (docs/contract.md, "Padding"). On the
// CPU they hold all-ones bytes, a NaN in every float type the ops move, written before the op
// runs: a consumer that reads them fails loudly in tests instead of finding zeros by chance.
void Poison(void* data, int64_t bytes) {
  if (bytes > 0) std::memset(data, 0xFF, static_cast<size_t>(bytes));
}
// The received rows of the ops that deliver them; `ranks`: the ranks stacked in this call.
void PoisonPadding(int, const DispatchArgs& a, int64_t ranks) {
  if (a.zero_padding) return;
  Poison(a.recv_x, ranks * a.capacity * a.result_row_bytes());
  Poison(a.recv_scales, ranks * a.capacity * a.result_scale_cols() * 4);
}
void PoisonPadding(int op, const LowLatencyArgs& a, int64_t ranks) {
  if (op != kPeerLlDispatchSend) return;
  const int64_t slots = ranks * a.experts_per_rank() * a.slots();
  Poison(a.recv_x, slots * a.row_bytes());
  Poison(a.recv_scales, slots * a.scale_words() * 4);
}
template <typename Args>
void PoisonPadding(int, const Args&, int64_t) {}

// A call's result that is known now.
xffi::Future Ready(const xffi::Error& error) {
  xffi::Promise promise;
  if (error.success()) {
    promise.SetAvailable();
  } else {
    promise.SetError(error);
  }
  return xffi::Future(promise);
}

// Runs `run` (returning a PeerError) on a thread of its own and returns the future of its
// result. Between devices an exchange waits for its peers; XLA:CPU runs a device's other
// operations (an all-reduce of the loss, say) on the threads it has, in an order that may
// differ from device to device, and a handler that blocked one of them could wait for a peer
// that waits in that all-reduce for this device: a deadlock. As a future, the exchange frees
// XLA's thread while it waits, as a GPU kernel leaves the host free.
template <typename Run>
xffi::Future Async(Run run) {
  xffi::Promise promise;
  xffi::Future future(promise);
  std::thread([promise, run = std::move(run)]() mutable {
    const PeerError error = run();
    if (error.ok()) {
      promise.SetAvailable();
    } else {
      promise.SetError(xffi::Error::Internal(error.message));
    }
  }).detach();
  return future;
}

// Replays, as XLA's command buffers run a call on a GPU (host::record, host::replay): with
// the attribute replay_site (jax_ep/_exchange_ffi.py sets it, one per traced call, when
// $JAX_EP_CPU_REPLAY is set at trace time), a call between devices is recorded the first time
// its site runs on a device and replayed from then on, none of its host code run again; like
// XLA, it is recorded again when its buffers moved. The recordings live for the process.
class Replays {
 public:
  template <typename Args>
  PeerError run(int64_t site, int device, std::vector<void*> buffers, int op, const Args& a,
                int rank, const HostGrid& grid, const GroupTable& groups) {
    std::shared_ptr<const host::Recording> recording;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const Entry& entry = entries_[{site, device}];
      if (entry.buffers == buffers && entry.recording && host::current(*entry.recording)) {
        recording = entry.recording;
      }
    }
    if (recording == nullptr) {
      PeerError error = host::record(op, a, rank, grid, groups, &recording);
      if (!error.ok()) return error;
      meter().recordings.fetch_add(1, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lock(mutex_);
      entries_[{site, device}] = Entry{std::move(buffers), recording};
    } else {
      meter().replays.fetch_add(1, std::memory_order_relaxed);
    }
    return host::replay(*recording);
  }

 private:
  struct Entry {
    std::vector<void*> buffers;  // the call's operands and results, in order
    std::shared_ptr<const host::Recording> recording;
  };
  std::mutex mutex_;
  std::map<std::pair<int64_t, int>, Entry> entries_;
};

Replays& replays() {
  static Replays r;
  return r;
}

// The addresses of a call's operands and results.
std::vector<void*> Addresses(const xffi::RemainingArgs& args, const xffi::RemainingRets& rets) {
  std::vector<void*> out;
  for (size_t i = 0; i < args.size(); ++i) out.push_back(args.get<xffi::AnyBuffer>(i)->untyped_data());
  for (size_t i = 0; i < rets.size(); ++i) {
    out.push_back((*rets.get<xffi::AnyBuffer>(i))->untyped_data());
  }
  return out;
}

// Every target: parse, then run the op with virtual ranks (cuda/virtual_ops.h) or, between
// devices, for this device's rank through host peers, in its EP group (`device` is the CPU
// device's id, the one the groups list), asynchronously (Async).
template <int Op>
xffi::Future ExchangeCpuImpl(int32_t device, xffi::AnyBuffer ranks, xffi::Token,
                             xffi::RemainingArgs args, xffi::Result<xffi::Token>,
                             xffi::RemainingRets rets, xffi::Dictionary attrs) {
  Call call;
  if (xffi::Error e = ParseCall(Op, ranks, args, rets, attrs, &call); e.failure()) {
    return Ready(e);
  }
  HostGrid grid;
  if (xffi::Error e = Grid(kPeerOpNames[Op], &grid); e.failure()) return Ready(e);
  if (call.num_sms > 0) grid.blocks = std::min(grid.blocks, call.num_sms);  // as on the GPU
  const xffi::ErrorOr<int64_t> site = attrs.get<int64_t>("replay_site");
  return std::visit(
      [&](const auto& a) {
        PoisonPadding(Op, a, call.between ? 1 : a.num_ranks);
        if (call.between) {
          // The groups' ids live in the call's attributes: the thread keeps a copy.
          std::vector<int64_t> devices(call.groups.devices,
                                       call.groups.devices + call.groups.size);
          std::vector<void*> buffers = site.has_value() ? Addresses(args, rets)
                                                         : std::vector<void*>{};
          return Async([a, grid, devices = std::move(devices), rank = call.ranks[0], device,
                        site = site.has_value() ? *site : int64_t{-1},
                        buffers = std::move(buffers)]() mutable {
            const GroupTable groups{devices.data(), static_cast<int64_t>(devices.size()),
                                    device};
            if (site < 0) return host::run(Op, a, rank, grid, groups);
            return replays().run(site, device, std::move(buffers), Op, a, rank, grid, groups);
          });
        }
        HostLauncher l{a.num_ranks, grid};
        run_virtual(l, Op, a);
        return Ready(xffi::Error::Success());
      },
      call.args);
}

// The binding of every target.
auto Binding() {
  return xffi::Ffi::Bind()
      .Ctx<xffi::DeviceOrdinal>()
      .Arg<xffi::AnyBuffer>()
      .Arg<xffi::Token>()
      .RemainingArgs()
      .Ret<xffi::Token>()
      .RemainingRets()
      .Attrs<xffi::Dictionary>();
}

}  // namespace

// Replay-safe as the CUDA handlers (exchange_cuda.cc): declared so, as they are.
#define JAX_EP_DEFINE_HANDLER(Name, op)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Name##Cpu, ExchangeCpuImpl<op>, Binding(), \
                                {xffi::Traits::kCmdBufferCompatible});
JAX_EP_FOR_EACH_EXCHANGE_TARGET(JAX_EP_DEFINE_HANDLER)
#undef JAX_EP_DEFINE_HANDLER

}  // namespace jax_ep::ffi
