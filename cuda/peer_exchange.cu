// The exchange between GPUs: one rank per device, peers through NVSHMEM.
//
// The ops are those of cuda/peer_ops.h (carving, launch order, how the launches meet the
// peers), shared with the CPU's host peers; this file is their GPU platform. Every buffer one
// rank writes for another lives in the NVSHMEM symmetric buffer (same offset on every rank)
// and `NvshmemPeers::at` turns it into the peer's address with nvshmem_ptr, so writes and
// reads are plain stores and loads over NVLink/P2P. Phases are kernels on XLA's stream, and they
// meet the peers inside (cuda/peer_ops.h, Meet; DeviceMeet below): no barrier kernels.
//
// Peers reached by puts (another node, or $JAX_EP_PEER_ACCESS=put): `NvshmemPutPeers` puts
// with NVSHMEM, which takes whatever transport reaches the peer (P2P on one node, IBGDA or IBRC
// over InfiniBand or RoCE); every thread quiets its puts before its block counts itself
// finished, and the arrival quiets again before it signals (DeviceMeet::done, tell_peers).
// The group chooses its view once, at jax_ep.initialize() (SymmetricBuffer::puts).
//
// Rank: the kernels use this process's NVSHMEM PE. The op also receives its EP axis index;
// every launch compares the two on the device and a mismatch (a mesh whose EP order differs
// from the process order) is recorded and reported by the next call, like a timeout.
//
// Safety: every wait is bounded (cuda/peer_ops.h, Wait: by the start timeout where peers may
// not have started the op, else by the op timeout). A wait that lasts longer for a peer
// records (op, peer) in a status word in host memory and gives up; the next call of any op on
// this process reports it as an error.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cuda/api.h"
#include "cuda/kernels.h"
#include "cuda/peer_ops.h"
#include "cuda/phases.cuh"

namespace jax_ep::cuda {
namespace {

struct NvshmemPeers {
  static constexpr bool kPuts = false;
  template <typename T>
  __host__ __device__ T* at(T* base, int64_t /*stride*/, int rank) const {
#if defined(__CUDA_ARCH__)
    return static_cast<T*>(nvshmem_ptr(base, rank));
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
  // Every lane of a warp calls put with the same arguments (the bodies put a row with the
  // lanes of one item): one warp-wide put.
  template <typename T>
  __host__ __device__ void put(T* dst, int rank, const T* src, int64_t bytes, int /*lane*/,
                               int /*lanes*/) const {
#if defined(__CUDA_ARCH__)
    nvshmemx_putmem_nbi_warp(dst, src, static_cast<size_t>(bytes), rank);
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
    nvshmem_int32_p(reinterpret_cast<int32_t*>(dst), bits, rank);
#else
    (void)dst, (void)rank, (void)value;
#endif
  }
  template <typename T>
  __host__ __device__ T* own(T* base, int /*rank*/) const {
    return base;  // the rank a phase reads as is always this one
  }
};

// What went wrong in a wait. In mapped host memory.
struct PeerStatus {
  // 0 ok; 1 or 3: a wait gave up waiting for `peer` inside the op (1) or to start it (3);
  // 2: rank mismatch (EP axis index `peer`).
  int code;
  int op;
  int peer;
};

struct State {
  PeerStatus* status = nullptr;         // host pointer (mapped)
  PeerStatus* device_status = nullptr;  // the same memory, as the device sees it
  uint64_t* epoch = nullptr;            // launches of this rank that arrived (device memory)
  uint64_t arrivals = 0;                // the arriving launches issued so far: *epoch once
                                        // they ran
  RegionUse low_latency[2];             // the two low-latency regions (peer_ops.h)
  Timeouts timeouts;
  int generation = 0;                   // the symmetric buffer the state above belongs to
};

State& state() {
  static State s;
  return s;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A Meet (cuda/peer_ops.h) on the GPU, for per_warp_kernel (cuda/phases.cuh). signals[p] in
// this rank's symmetric buffer counts the launches of peer p that arrived; `epoch` those of
// this rank.
struct DeviceMeet {
  uint64_t* signals;
  uint64_t* epoch;
  int me, n, op;
  const int32_t* axis_index;
  PeerStatus* status;
  uint64_t before_ns = 0, after_ns = 0;  // bounds of the waits; 0: no wait
  int before_code = 0, after_code = 0;   // PeerStatus codes of their timeouts
  uint64_t before_arrivals = kAllEarlier;  // Meet::before_arrivals
  bool arrive = false;
  bool quiet = false;  // an arriving launch over puts: done() completes the thread's puts

  __host__ __device__ bool waits_first() const { return before_ns != 0; }
  __host__ __device__ bool has_last() const { return arrive || after_ns != 0; }

  __device__ void first() const {
    if (blockIdx.x == 0 && threadIdx.x == 0) check_rank();
    if (before_ns != 0) wait_for_peers(before_ns, before_code, before_arrivals);
  }
  // Every thread after its items. NVSHMEM specifies nvshmem_quiet per PE; each thread quiets
  // its own puts anyway, so that the arrival's signal follows every put of the launch however
  // an implementation scopes it.
  __device__ void done() const {
    if (quiet) nvshmem_quiet();
  }
  __device__ void last() const {
    if (arrive) tell_peers();
    if (after_ns != 0) wait_for_peers(after_ns, after_code, kAllEarlier);
  }

  // The op's EP axis index must be this PE.
  __device__ void check_rank() const {
    const int32_t index = *axis_index;
    if (index != me && static_cast<volatile PeerStatus*>(status)->code == 0) report(2, index);
  }

  // Records what went wrong, for the next call. Host memory: plain stores (any thread's
  // report is a fine one).
  __device__ void report(int code, int peer) const {
    volatile PeerStatus* out = status;
    out->op = op;
    out->peer = peer;
    __threadfence_system();
    out->code = code;
  }

  // Every thread of the block: this rank's writes (every block's, is_last_block) are visible,
  // then each thread p < n sets this rank's signal in peer p.
  __device__ void tell_peers() const {
    __shared__ uint64_t arrivals;
    if (threadIdx.x == 0) {
      arrivals = *epoch + 1;
      *epoch = arrivals;
    }
    __syncthreads();
    nvshmem_quiet();
    __threadfence_system();
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
      nvshmemx_signal_op(signals + me, arrivals, NVSHMEM_SIGNAL_SET, p);
    }
  }

  // Every thread of the block: until each peer arrived as often as this rank (or `arrivals`
  // times), thread p watching peer p, bounded by `timeout_ns`; then the peers' writes are
  // visible to the block.
  __device__ void wait_for_peers(uint64_t timeout_ns, int timeout_code,
                                 uint64_t arrivals) const {
    __syncthreads();  // the block's reads of *epoch come after tell_peers' write
    const uint64_t target = arrivals == kAllEarlier ? *epoch : arrivals;
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
      volatile uint64_t* arrived = signals + p;
      const uint64_t start = global_ns();
      while (*arrived < target) {
        if (static_cast<volatile PeerStatus*>(status)->code != 0) break;
        if (global_ns() - start > timeout_ns) {
          report(timeout_code, p);
          break;
        }
        __nanosleep(200);
      }
    }
    __threadfence_system();
    __syncthreads();
  }
};

// The peers-mode preconditions; on success `*out` is the symmetric buffer of
// jax_ep.initialize(), whose group has `num_ranks` ranks.
PeerError prepare(int op, int num_ranks, const SymmetricBuffer** out) {
  const SymmetricBuffer* buffer = symmetric_buffer();
  if (buffer == nullptr) {
    return PeerError{std::string(kPeerOpNames[op]) +
                     ": the exchange between GPUs needs jax_ep.initialize() first (NVSHMEM and "
                     "its symmetric buffer)"};
  }
  if (buffer->num_ranks != num_ranks) {
    return PeerError{std::string(kPeerOpNames[op]) + ": the EP axis has " +
                     std::to_string(num_ranks) + " ranks but NVSHMEM was initialized with " +
                     std::to_string(buffer->num_ranks) +
                     "; the EP axis must span every process of jax_ep.initialize()"};
  }
  if (num_ranks > kMaxPeers) {
    return PeerError{std::string(kPeerOpNames[op]) + ": at most " + std::to_string(kMaxPeers) +
                     " ranks are supported"};
  }
  State& st = state();
  if (st.status == nullptr) {  // once per process: the status word and the epoch counter
    void* host = nullptr;
    if (cudaHostAlloc(&host, sizeof(PeerStatus), cudaHostAllocMapped) != cudaSuccess ||
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&st.device_status), host, 0) !=
            cudaSuccess ||
        cudaMalloc(&st.epoch, sizeof(uint64_t)) != cudaSuccess) {
      return PeerError{std::string(kPeerOpNames[op]) + ": cannot allocate the peers' state"};
    }
    st.status = static_cast<PeerStatus*>(host);
    st.timeouts = timeouts_from_env();
  }
  if (st.generation != buffer->generation) {
    // A new initialize(): its buffer's signals are zero, so arrivals count from zero again,
    // an old timeout no longer applies, and the new group's peers must be checked.
    if (cudaMemset(st.epoch, 0, sizeof(uint64_t)) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {
      return PeerError{std::string(kPeerOpNames[op]) + ": cannot reset the peers' state"};
    }
    *st.status = PeerStatus{0, 0, 0};
    st.arrivals = 0;
    st.low_latency[0] = st.low_latency[1] = RegionUse{};
    // With stores, every peer must be reachable by loads and stores (NVLink / P2P); node-aware,
    // those of this rank's node.
    const int node = buffer->ranks_per_node;
    for (int p = 0; p < num_ranks; ++p) {
      const bool stores = !buffer->puts || (node > 0 && p / node == buffer->rank / node);
      if (stores && nvshmem_ptr(buffer->ptr, p) == nullptr) {
        return PeerError{std::string(kPeerOpNames[op]) + ": peer " + std::to_string(p) +
                         " is not reachable by loads and stores (another node, or no "
                         "NVLink/P2P); set JAX_EP_PEER_ACCESS=put before jax_ep.initialize() "
                         "to reach the peers with puts"};
      }
    }
    st.generation = buffer->generation;
  }
  const volatile PeerStatus* report = st.status;  // written by the device
  if (report->code == 1 || report->code == 3) {
    return after_timeout(op, report->op, report->peer,
                         report->code == 3 ? Wait::kStart : Wait::kInOp, st.timeouts,
                         "restart the processes");
  }
  if (report->code == 2) {
    return PeerError{std::string(kPeerOpNames[op]) + ": an earlier call of " +
                     kPeerOpNames[report->op] + " ran as EP rank " +
                     std::to_string(report->peer) + " on the process of NVSHMEM PE " +
                     std::to_string(buffer->rank) +
                     "; the mesh's EP axis must list the devices in process order (device of "
                     "process i at EP index i); the EP group is unusable, restart the "
                     "processes"};
  }
  *out = buffer;
  return PeerError{};
}

// The GPU platform of cuda/peer_ops.h: launches on `stream` that meet the peers inside.
class DevicePlatform {
 public:
  using Peers = NvshmemPeers;
  using PutPeers = NvshmemPutPeers;
  static constexpr bool kPutPeers = true;

  // Checks the preconditions of `op`; rank() etc. are valid when the result is ok.
  PeerError open(int op, int num_ranks, const int32_t* axis_index, int num_sms,
                 cudaStream_t stream) {
    op_ = op;
    axis_index_ = axis_index;
    num_sms_ = num_sms;
    stream_ = stream;
    return prepare(op, num_ranks, &buffer_);
  }

  Peers peers() const { return Peers{}; }
  bool puts() const { return buffer_->puts; }
  int ranks_per_node() const { return buffer_->ranks_per_node; }
  PutPeers put_peers() const { return PutPeers{}; }
  int rank() const { return buffer_->rank; }
  char* symmetric() const { return static_cast<char*>(buffer_->ptr); }
  size_t bytes() const { return buffer_->bytes; }
  size_t low_latency_offset() const { return buffer_->low_latency_offset; }
  uint64_t arrivals() const { return state().arrivals; }
  RegionUse& region_use(int buffer) { return state().low_latency[buffer]; }

  template <typename Phase, typename Tail = NoTail>
  void per_warp(const Phase& phase, int64_t items, const Meet& meet, const Tail& tail = {}) {
    if (status_ != cudaSuccess) return;
    State& st = state();
    DeviceMeet m{reinterpret_cast<uint64_t*>(symmetric()), st.epoch, rank(), buffer_->num_ranks,
                 op_, axis_index_, st.device_status};
    auto bound = [&](const std::optional<Wait>& wait, uint64_t* ns, int* code) {
      if (!wait) return;
      *ns = std::max<uint64_t>(st.timeouts.of(*wait), 1);
      *code = *wait == Wait::kStart ? 3 : 1;
    };
    bound(meet.before, &m.before_ns, &m.before_code);
    bound(meet.after, &m.after_ns, &m.after_code);
    m.before_arrivals = meet.before_arrivals;
    m.arrive = meet.arrive;
    m.quiet = meet.arrive && puts();
    status_ = cuda::per_warp(phase, rank(), 1, items, stream_, num_sms_, tail, m);
    if (status_ == cudaSuccess && meet.arrive) ++st.arrivals;
  }
  PeerError result(int op) const { return launch_error(op, status_); }

 private:
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
              cudaStream_t stream) {
  if (axis_index == nullptr) return run_virtual_ranks(op, args, num_sms, stream);
  DevicePlatform platform;
  PeerError error = platform.open(op, args.num_ranks, axis_index, num_sms, stream);
  return error.ok() ? run_op(platform, op, args) : error;
}

#define JAX_EP_INSTANTIATE(Args) \
  template PeerError run<Args>(int, const Args&, const int32_t*, int, cudaStream_t);
JAX_EP_FOR_EACH_OP_ARGS(JAX_EP_INSTANTIATE)
#undef JAX_EP_INSTANTIATE

}  // namespace jax_ep::cuda
