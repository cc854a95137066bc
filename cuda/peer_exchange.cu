// The exchange between GPUs: one rank per device, peers through NVSHMEM.
//
// The ops are those of cuda/peer_ops.h (carving, launch order, how the launches meet the
// peers), shared with the CPU's host peers; this file is their GPU platform. Every buffer one
// rank writes for another lives in the NVSHMEM symmetric buffer (same offset on every rank)
// and `NvshmemPeers::at` turns it into the peer's address with nvshmem_ptr, so writes and
// reads are plain stores and loads over NVLink/P2P. Phases are kernels on XLA's stream, and they
// meet the peers inside (cuda/peer_ops.h, Meet; DeviceMeet, cuda/device_peers.cuh): no
// barrier kernels.
//
// Peers reached by puts (another node, or $JAX_EP_PEER_ACCESS=put): `NvshmemPutPeers` puts
// with NVSHMEM, which takes whatever transport reaches the peer (P2P on one node, IBGDA or IBRC
// over InfiniBand or RoCE); one thread per block quiets the block's puts before it counts
// itself finished, and the arrival quiets again before it signals (DeviceMeet::done,
// tell_peers).
// The group chooses its view once, at jax_ep.initialize() (SymmetricBuffer::puts).
//
// Groups: the EP axis may be one axis of a larger mesh (cuda/ep_group.h). The first exchange
// after jax_ep.initialize() fixes this GPU's EP group (its devices, in EP rank order) and maps
// it to NVSHMEM PEs (SymmetricBuffer::device_of_pe), its node split from their nodes; the
// views and the flags address peers by EP rank through that table. A later call in another
// group is refused: the flags count the launches of one group. Without a table the group is
// every PE in order. The op also receives its EP axis index; every launch compares it with
// this GPU's rank in the group on the device, and a mismatch (a program traced for another
// mesh) is recorded and reported by the next call, like a timeout.
//
// The state of this GPU, the Meet inside the kernels and their bounded waits are those of
// cuda/device_peers.cuh, shared with the GPUs of one process (cuda/local_exchange.cu).
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/api.h"
#include "cuda/device_peers.cuh"

namespace jax_ep::cuda {
namespace {

// Peers by EP rank; `pes` (device memory) holds the NVSHMEM PE of each rank of the group.
struct NvshmemPeers {
  static constexpr bool kPuts = false;
  const int* pes;
  template <typename T>
  __host__ __device__ T* at(T* base, int64_t /*stride*/, int rank) const {
#if defined(__CUDA_ARCH__)
    return static_cast<T*>(nvshmem_ptr(base, pes[rank]));
#else
    (void)base, (void)rank;
    return nullptr;  // phases run on the device only
#endif
  }
};

// The put view (cuda/exchange.h): sources in this rank's symmetric buffer, nonblocking puts
// completed before the launch's arrival (DeviceMeet::done).
struct NvshmemPutPeers {
  static constexpr bool kPuts = true;
  const int* pes;  // the PE of each EP rank, as NvshmemPeers
  // Every lane of a warp calls put with the same arguments (the bodies put a row with the
  // lanes of one item): one warp-wide put.
  template <typename T>
  __host__ __device__ void put(T* dst, int rank, const T* src, int64_t bytes, int /*lane*/,
                               int /*lanes*/) const {
#if defined(__CUDA_ARCH__)
    nvshmemx_putmem_nbi_warp(dst, src, static_cast<size_t>(bytes), pes[rank]);
#else
    (void)dst, (void)rank, (void)src, (void)bytes;  // phases run on the device only
#endif
  }
  // One lane's value (lanes may put different values).
  template <typename T>
  __host__ __device__ void put_value(T* dst, int rank, T value) const {
    static_assert(sizeof(T) == sizeof(int32_t), "put_value: 32-bit values");
#if defined(__CUDA_ARCH__)
    int32_t bits;
    memcpy(&bits, &value, sizeof(bits));
    nvshmem_int32_p(reinterpret_cast<int32_t*>(dst), bits, pes[rank]);
#else
    (void)dst, (void)rank, (void)value;
#endif
  }
  template <typename T>
  __host__ __device__ T* own(T* base, int /*rank*/) const {
    return base;  // the rank a phase reads as is always this one
  }
  // Adds `delta` to the counter `slot` in rank's buffer (an NVSHMEM signal add: no order
  // among such signals is needed), after this PE's earlier puts to it when `after_puts` (a
  // fence, which with several queue pairs per PE waits for all of them: kept for that case).
  __host__ __device__ void signal_add(uint64_t* slot, int rank, uint64_t delta,
                                      bool after_puts) const {
#if defined(__CUDA_ARCH__)
    if (after_puts) nvshmem_fence();
    nvshmemx_signal_op(slot, delta, NVSHMEM_SIGNAL_ADD, pes[rank]);
#else
    (void)slot, (void)rank, (void)delta, (void)after_puts;
#endif
  }
  // One warp-wide put, then `delta` added to the counter `slot` after it: one message.
  __host__ __device__ void put_signal_add(char* dst, int rank, const char* src, int64_t bytes,
                                          uint64_t* slot, uint64_t delta, int /*lane*/,
                                          int /*lanes*/) const {
#if defined(__CUDA_ARCH__)
    nvshmemx_putmem_signal_nbi_warp(dst, src, static_cast<size_t>(bytes), slot, delta,
                                    NVSHMEM_SIGNAL_ADD, pes[rank]);
#else
    (void)dst, (void)rank, (void)src, (void)bytes, (void)slot, (void)delta;
#endif
  }
};

// NVSHMEM's way to the peers, for DeviceMeet (cuda/device_peers.cuh): the signal is an
// NVSHMEM signal op to the rank's PE, and quiet completes the puts the PE issued before it.
struct NvshmemNet {
  const int* pes;
  __device__ void signal(uint64_t* slot, uint64_t value, int rank) const {
    nvshmemx_signal_op(slot, value, NVSHMEM_SIGNAL_SET, pes[rank]);
  }
  __device__ void quiet() const { nvshmem_quiet(); }
};

// The one process-wide state (one GPU per process).
PeerState& state() {
  static PeerState s;
  return s;
}

// This GPU's EP group for a call of `op` with num_ranks ranks and the program's `groups`
// (cuda/ep_group.h): joined by the first call after initialize (the PEs of its devices, its
// node split, every peer reachable as the access says), checked by the later ones.
PeerError join_group(int op, int num_ranks, GroupTable groups, const SymmetricBuffer& buffer,
                     PeerState& st) {
  const std::string name = kPeerOpNames[op];
  groups.device = buffer.device_of_pe[buffer.rank];
  std::vector<int64_t> row;
  int rank = 0;
  PeerError error = group_of_call(op, num_ranks, groups, buffer.device_of_pe, buffer.rank, st,
                                  &row, &rank);
  if (!error.ok() || !st.group.empty()) return error;
  std::vector<int> pes(num_ranks), nodes(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    const auto at = std::find(buffer.device_of_pe.begin(), buffer.device_of_pe.end(), row[r]);
    if (at == buffer.device_of_pe.end()) {
      return PeerError{name + ": device " + std::to_string(row[r]) + " of the EP group is "
                       "not the GPU of any process of jax_ep.initialize()"};
    }
    pes[r] = static_cast<int>(at - buffer.device_of_pe.begin());
    nodes[r] = buffer.node_of_pe[pes[r]];
  }
  std::string text;
  const int split = group_ranks_per_node(nodes, &text);
  if (split < 0) return PeerError{name + ": " + text};
  if (split > 0 && !buffer.puts) {
    return PeerError{name + ": the EP group " + devices_text(row) + " spans nodes, which "
                     "reach each other with puts: set JAX_EP_PEER_ACCESS=put before "
                     "jax_ep.initialize()"};
  }
  // With stores, every peer must be reachable by loads and stores (NVLink / P2P);
  // node-aware, those of this rank's node.
  for (int r = 0; r < num_ranks; ++r) {
    const bool stores = !buffer.puts || (split > 0 && r / split == rank / split);
    if (stores && nvshmem_ptr(buffer.ptr, pes[r]) == nullptr) {
      return PeerError{name + ": EP rank " + std::to_string(r) + " (PE " +
                       std::to_string(pes[r]) + ") is not reachable by loads and stores "
                       "(another node, or no NVLink/P2P); set JAX_EP_PEER_ACCESS=put before "
                       "jax_ep.initialize() to reach the peers with puts"};
    }
  }
  if (upload_table(pes, &st.peers) != cudaSuccess) {
    return PeerError{name + ": cannot allocate the EP group's table of PEs"};
  }
  st.group = row;
  st.group_rank = rank;
  st.group_nodes = split;
  return PeerError{};
}

// The peers-mode preconditions; on success `*out` is the symmetric buffer of
// jax_ep.initialize() and state() holds this GPU's EP group.
PeerError prepare(int op, int num_ranks, const GroupTable& groups,
                  const SymmetricBuffer** out) {
  const SymmetricBuffer* buffer = symmetric_buffer();
  if (buffer == nullptr) {
    return PeerError{std::string(kPeerOpNames[op]) +
                     ": the exchange between GPUs needs jax_ep.initialize() first (NVSHMEM and "
                     "its symmetric buffer)"};
  }
  if (num_ranks > kMaxPeers) {
    return PeerError{std::string(kPeerOpNames[op]) + ": at most " + std::to_string(kMaxPeers) +
                     " ranks are supported"};
  }
  PeerState& st = state();
  PeerError error = ready_state(op, buffer->generation, st);
  if (error.ok()) error = join_group(op, num_ranks, groups, *buffer, st);
  if (error.ok()) *out = buffer;
  return error;
}

// The GPU platform of cuda/peer_ops.h: launches on `stream` that meet the peers inside.
class DevicePlatform {
 public:
  using Peers = NvshmemPeers;
  using PutPeers = NvshmemPutPeers;
  static constexpr bool kPutPeers = true;

  // Checks the preconditions of `op`; rank() etc. are valid when the result is ok.
  PeerError open(int op, int num_ranks, const int32_t* axis_index, int num_sms,
                 cudaStream_t stream, const GroupTable& groups) {
    op_ = op;
    axis_index_ = axis_index;
    num_sms_ = num_sms;
    stream_ = stream;
    return prepare(op, num_ranks, groups, &buffer_);
  }

  Peers peers() const { return Peers{pes()}; }
  bool puts() const { return buffer_->puts; }
  int ranks_per_node() const { return state().group_nodes; }
  PutPeers put_peers() const { return PutPeers{pes()}; }
  int rank() const { return state().group_rank; }
  char* symmetric() const { return static_cast<char*>(buffer_->ptr); }
  size_t bytes() const { return buffer_->bytes; }
  size_t low_latency_offset() const { return buffer_->low_latency_offset; }

  template <typename Phase, typename Tail = NoTail>
  void per_warp(const Phase& phase, int64_t items, const Meet& meet, const Tail& tail = {}) {
    if (status_ != cudaSuccess) return;
    status_ = launch_meeting(phase, items, meet, tail, NvshmemNet{pes()}, puts(),
                             reinterpret_cast<uint64_t*>(symmetric()), op_, axis_index_,
                             num_sms_, stream_, state());
  }
  // A streaming launch (cuda/channels.h): its units one warp each, in blocks of kPhaseWarps
  // (several channels to a block).
  template <typename Body>
  void per_unit(const Body& body, const Meet& meet) {
    if (status_ != cudaSuccess) return;
    status_ = launch_units(body, meet, NvshmemNet{pes()}, puts(), reinterpret_cast<uint64_t*>(symmetric()),
                           op_, axis_index_, stream_, state());
  }
  // Warps per role per channel of a streaming launch, unless the rings name theirs.
  int channel_warps(bool combine) const {
    return combine ? kGpuCombineSenders : kGpuDispatchWarps;
  }
  PeerError result(int op) const { return launch_error(op, status_); }

 private:
  static const int* pes() { return static_cast<const int*>(state().peers); }
  int op_ = 0;
  const int32_t* axis_index_ = nullptr;
  int num_sms_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaError_t status_ = cudaSuccess;
  const SymmetricBuffer* buffer_ = nullptr;
};

}  // namespace

template <typename Args>
PeerError run(int op, const Args& args, const int32_t* axis_index, int num_sms,
              cudaStream_t stream, const GroupTable& groups, int device_ordinal) {
  if (axis_index == nullptr) return run_virtual_ranks(op, args, num_sms, stream);
  if (local_buffers() != nullptr) {  // the GPUs of this process
    return run_local(op, args, axis_index, num_sms, stream, groups, device_ordinal);
  }
  DevicePlatform platform;
  PeerError error = platform.open(op, args.num_ranks, axis_index, num_sms, stream, groups);
  return error.ok() ? run_op(platform, op, args) : error;
}

#define JAX_EP_INSTANTIATE(Args) \
  template PeerError run<Args>(int, const Args&, const int32_t*, int, cudaStream_t, \
                               const GroupTable&, int);
JAX_EP_FOR_EACH_OP_ARGS(JAX_EP_INSTANTIATE)
#undef JAX_EP_INSTANTIATE

}  // namespace jax_ep::cuda
