// The exchange between the GPUs of one process: one rank per device, peers through CUDA peer
// access (P2P over NVLink or PCIe), no NVSHMEM.
//
// JAX's usual way to run one node is one process that drives its GPUs; NVSHMEM allows one GPU
// per process, so these GPUs reach each other directly: jax_ep.initialize() allocates a
// buffer of the same size and layout on every GPU of the process (cuda/runtime.cu,
// local_initialize) and enables peer access between every pair. The ops are those of
// cuda/peer_ops.h, run by the handler of each device on XLA's stream for that device: the
// same carving, launches and flags as between processes (cuda/device_peers.cuh), with a store
// view whose pointers are the other GPUs' buffers (`LocalPeers`, as HostPeers is on the CPU:
// the same offset in the rank's buffer) and signals set with plain stores after the
// system-scope fence of DeviceMeet.
// Host peers (cuda/host_peers.cc) are this platform's proof on the CPU: one thread per device,
// the same bodies, flags and view.
//
// Groups: as between processes, each GPU joins one EP group at its first exchange after
// jax_ep.initialize() (cuda/ep_group.h); its rank's buffers are found by the devices' ids.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/api.h"
#include "cuda/device_peers.cuh"

namespace jax_ep::cuda {
namespace {

// Peers by EP rank: `shifts` (device memory) holds how far each rank's buffer lies from this
// rank's (one table load per address, as nvshmem_ptr's).
struct LocalPeers {
  static constexpr bool kPuts = false;
  const intptr_t* shifts;
  template <typename T>
  __host__ __device__ T* at(T* base, int64_t /*stride*/, int rank) const {
    return reinterpret_cast<T*>(reinterpret_cast<intptr_t>(base) + shifts[rank]);
  }
};

// Peer access's way to the peers, for DeviceMeet: a signal is a store into the rank's buffer
// (ordered after this rank's writes by DeviceMeet's system-scope fence); there are no puts.
struct LocalNet {
  LocalPeers peers;
  __device__ void signal(uint64_t* slot, uint64_t value, int rank) const {
    *static_cast<volatile uint64_t*>(peers.at(slot, 0, rank)) = value;
  }
  __device__ void quiet() const {}
};

// The state of each GPU of the process, by its index in local_buffers().
std::vector<PeerState>& states() {
  static std::vector<PeerState> s(kMaxLocalGpus);
  return s;
}

// GPU `index`'s EP group for a call of `op` with num_ranks ranks (as join_group of
// cuda/peer_exchange.cu): where its devices' buffers lie, in EP rank order, in a table on the
// GPU.
PeerError join_group(int op, int num_ranks, GroupTable groups, const LocalBuffers& buffers,
                     int index, PeerState& st) {
  const std::string name = kPeerOpNames[op];
  groups.device = buffers.device_ids[index];
  std::vector<int64_t> row;
  int rank = 0;
  PeerError error = group_of_call(op, num_ranks, groups, buffers.device_ids, index, st, &row,
                                  &rank);
  if (!error.ok() || !st.group.empty()) return error;
  std::vector<intptr_t> shifts(num_ranks);
  const intptr_t own = reinterpret_cast<intptr_t>(buffers.ptrs[index]);
  for (int r = 0; r < num_ranks; ++r) {
    const auto at = std::find(buffers.device_ids.begin(), buffers.device_ids.end(), row[r]);
    if (at == buffers.device_ids.end()) {
      return PeerError{name + ": device " + std::to_string(row[r]) + " of the EP group is "
                       "not a GPU of this process's jax_ep.initialize()"};
    }
    shifts[r] = reinterpret_cast<intptr_t>(buffers.ptrs[at - buffers.device_ids.begin()]) - own;
  }
  if (upload_table(shifts, &st.peers) != cudaSuccess) {
    return PeerError{name + ": cannot allocate the EP group's table of buffers"};
  }
  st.group = row;
  st.group_rank = rank;
  st.group_nodes = 0;  // one process: one node
  return PeerError{};
}

// The GPU platform of cuda/peer_ops.h for the GPUs of one process: launches on this GPU's
// stream that meet the peers inside.
class LocalPlatform {
 public:
  using Peers = LocalPeers;
  static constexpr bool kPutPeers = false;

  // Checks the preconditions of `op` on CUDA device `ordinal`; rank() etc. are valid when the
  // result is ok.
  PeerError open(int op, int num_ranks, const int32_t* axis_index, int num_sms,
                 cudaStream_t stream, const GroupTable& groups, int ordinal) {
    op_ = op;
    axis_index_ = axis_index;
    num_sms_ = num_sms;
    stream_ = stream;
    const std::string name = kPeerOpNames[op];
    buffers_ = local_buffers();
    const auto at = std::find(buffers_->ordinals.begin(), buffers_->ordinals.end(), ordinal);
    if (at == buffers_->ordinals.end()) {
      return PeerError{name + ": CUDA device " + std::to_string(ordinal) + " is not one of "
                       "the GPUs of jax_ep.initialize()"};
    }
    if (num_ranks > kMaxPeers) {
      return PeerError{name + ": at most " + std::to_string(kMaxPeers) + " ranks are supported"};
    }
    index_ = static_cast<int>(at - buffers_->ordinals.begin());
    if (cudaSetDevice(ordinal) != cudaSuccess) {
      return PeerError{name + ": cannot make CUDA device " + std::to_string(ordinal) +
                       " current"};
    }
    PeerState& st = state();
    PeerError error = ready_state(op, buffers_->generation, st);
    return error.ok() ? join_group(op, num_ranks, groups, *buffers_, index_, st) : error;
  }

  Peers peers() const { return Peers{static_cast<const intptr_t*>(state().peers)}; }
  int rank() const { return state().group_rank; }
  char* symmetric() const { return buffers_->ptrs[index_]; }
  size_t bytes() const { return buffers_->bytes; }
  size_t low_latency_offset() const { return buffers_->low_latency_offset; }

  template <typename Phase, typename Tail = NoTail>
  void per_warp(const Phase& phase, int64_t items, const Meet& meet, const Tail& tail = {}) {
    if (status_ != cudaSuccess) return;
    status_ = launch_meeting(phase, items, meet, tail, LocalNet{peers()}, false,
                             reinterpret_cast<uint64_t*>(symmetric()), op_, axis_index_,
                             num_sms_, stream_, state());
  }
  // A streaming launch (cuda/channels.h): its units one warp each, in blocks of kPhaseWarps
  // (several channels to a block).
  template <typename Body>
  void per_unit(const Body& body, const Meet& meet) {
    if (status_ != cudaSuccess) return;
    status_ = launch_units(body, meet, LocalNet{peers()}, false, reinterpret_cast<uint64_t*>(symmetric()),
                           op_, axis_index_, stream_, state());
  }
  // Warps per role per channel of a streaming launch, unless the rings name theirs.
  int channel_warps(bool combine) const {
    return combine ? kGpuCombineSenders : kGpuDispatchWarps;
  }
  PeerError result(int op) const { return launch_error(op, status_); }

 private:
  PeerState& state() const { return states()[index_]; }
  int op_ = 0;
  const int32_t* axis_index_ = nullptr;
  int num_sms_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaError_t status_ = cudaSuccess;
  const LocalBuffers* buffers_ = nullptr;
  int index_ = 0;
};

// The calling thread's current device, made current again when the guard goes: a call makes
// its own GPU current (LocalPlatform::open), and XLA's thread must find the device it had.
class CurrentDeviceGuard {
 public:
  CurrentDeviceGuard() {
    if (cudaGetDevice(&device_) != cudaSuccess) device_ = -1;
  }
  ~CurrentDeviceGuard() {
    if (device_ >= 0) cudaSetDevice(device_);
  }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;

 private:
  int device_ = -1;
};

}  // namespace

template <typename Args>
PeerError run_local(int op, const Args& args, const int32_t* axis_index, int num_sms,
                    cudaStream_t stream, const GroupTable& groups, int ordinal) {
  const CurrentDeviceGuard restore;
  LocalPlatform platform;
  PeerError error =
      platform.open(op, args.num_ranks, axis_index, num_sms, stream, groups, ordinal);
  return error.ok() ? run_op(platform, op, args) : error;
}

#define JAX_EP_INSTANTIATE(Args)                                                           \
  template PeerError run_local<Args>(int, const Args&, const int32_t*, int, cudaStream_t, \
                                     const GroupTable&, int);
JAX_EP_FOR_EACH_OP_ARGS(JAX_EP_INSTANTIATE)
#undef JAX_EP_INSTANTIATE

}  // namespace jax_ep::cuda
