// The exchange between GPUs: one rank per device, peers through NVSHMEM.
//
// The phases are the bodies of cuda/exchange.h, unchanged; only the view differs: every
// buffer one rank writes for another lives in the NVSHMEM symmetric buffer (same offset on
// every rank) and `NvshmemPeers::at` turns it into the peer's address with nvshmem_ptr, so
// writes and reads are plain stores and loads over NVLink/P2P. Between phases that depend on
// other ranks' writes, a barrier (below) orders the ranks; results that XLA owns are copied
// out of the symmetric buffer at the end.
//
// Symmetric buffer layout: [0, 4 KiB) barrier signals (one uint64 per peer); normal-mode
// regions from 4 KiB upwards; low-latency regions at the end, so that a split low-latency
// dispatch or combine in flight is not overwritten by normal-mode ops.
//
// Safety: every wait is bounded. A barrier that waits longer than the timeout
// ($JAX_EP_TIMEOUT_S, default 60 s) for a peer records (op, peer) in a status word in host
// memory and gives up; the next call of any op on this process reports it as an error.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda/api.h"
#include "cuda/peer_exchange.h"
#include "cuda/phases.cuh"

namespace jax_ep::cuda {
namespace {

constexpr size_t kSignalBytes = 4096;
constexpr int kMaxPeers = static_cast<int>(kSignalBytes / sizeof(uint64_t));
constexpr size_t kAlign = 256;

struct NvshmemPeers {
  template <typename T>
  __device__ T* at(T* base, int64_t /*stride*/, int rank) const {
    return static_cast<T*>(nvshmem_ptr(base, rank));
  }
};
using Peers = NvshmemPeers;

// A barrier timeout: which op waited, for which peer. In mapped host memory.
struct PeerStatus {
  int code;  // 0 ok, 1 timeout
  int op;
  int peer;
};

struct State {
  PeerStatus* status = nullptr;         // host pointer (mapped)
  PeerStatus* device_status = nullptr;  // the same memory, as the device sees it
  uint64_t* epoch = nullptr;            // device counter of barriers passed
  uint64_t timeout_ns = 60ull * 1000 * 1000 * 1000;
  int generation = 0;                   // the symmetric buffer the state above belongs to
};

State& state() {
  static State s;
  return s;
}

const char* const kOpNames[] = {"jax_ep_dispatch", "jax_ep_combine", "jax_ep_ll_dispatch_send",
                                "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send",
                                "jax_ep_ll_combine_recv"};

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// All ranks meet: each thread p < n tells peer p that this rank arrived (after making this
// rank's earlier stores visible), then waits, bounded, until peer p arrived here.
__global__ void barrier_kernel(uint64_t* signals, uint64_t* epoch, int me, int n,
                               uint64_t timeout_ns, PeerStatus* status, int op) {
  __shared__ uint64_t target;
  if (threadIdx.x == 0) target = *epoch + 1;
  __syncthreads();
  if (threadIdx.x == 0) *epoch = target;
  nvshmem_quiet();
  __threadfence_system();
  const int p = threadIdx.x;
  if (p < n) {
    nvshmemx_signal_op(signals + me, target, NVSHMEM_SIGNAL_SET, p);
    volatile uint64_t* arrived = signals + p;
    const uint64_t start = global_ns();
    while (*arrived < target) {
      if (static_cast<volatile PeerStatus*>(status)->code != 0) break;
      if (global_ns() - start > timeout_ns) {
        // Host memory: plain stores (any waiting thread's peer is a fine report).
        volatile PeerStatus* report = status;
        report->op = op;
        report->peer = p;
        __threadfence_system();
        report->code = 1;
        break;
      }
      __nanosleep(200);
    }
  }
  __threadfence_system();
}

// Consecutive, aligned pieces of a symmetric region.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    used_ = (used_ + kAlign - 1) / kAlign * kAlign;
    T* out = reinterpret_cast<T*>(base_ + used_);
    used_ += static_cast<size_t>(count) * sizeof(T);
    return out;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

// The peers-mode preconditions; fills rank/size and the symmetric base, or an error message.
PeerError prepare(int op, int num_ranks, int* me, char** symmetric, size_t* bytes) {
  const SymmetricBuffer* buffer = symmetric_buffer();
  if (buffer == nullptr) {
    return PeerError{std::string(kOpNames[op]) +
                     ": the exchange between GPUs needs jax_ep.initialize() first (NVSHMEM and "
                     "its symmetric buffer)"};
  }
  if (buffer->num_ranks != num_ranks) {
    return PeerError{std::string(kOpNames[op]) + ": the EP axis has " +
                     std::to_string(num_ranks) + " ranks but NVSHMEM was initialized with " +
                     std::to_string(buffer->num_ranks) +
                     "; the EP axis must span every process of jax_ep.initialize()"};
  }
  if (num_ranks > kMaxPeers) {
    return PeerError{std::string(kOpNames[op]) + ": at most " + std::to_string(kMaxPeers) +
                     " ranks are supported"};
  }
  State& st = state();
  if (st.status == nullptr) {  // once per process: the status word and the epoch counter
    void* host = nullptr;
    if (cudaHostAlloc(&host, sizeof(PeerStatus), cudaHostAllocMapped) != cudaSuccess ||
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&st.device_status), host, 0) !=
            cudaSuccess ||
        cudaMalloc(&st.epoch, sizeof(uint64_t)) != cudaSuccess) {
      return PeerError{std::string(kOpNames[op]) + ": cannot allocate the barrier state"};
    }
    st.status = static_cast<PeerStatus*>(host);
    if (const char* env = std::getenv("JAX_EP_TIMEOUT_S")) {
      const double seconds = std::atof(env);
      if (seconds > 0) st.timeout_ns = static_cast<uint64_t>(seconds * 1e9);
    }
  }
  if (st.generation != buffer->generation) {
    // A new initialize(): its buffer's signals are zero, so barriers count from zero again,
    // an old timeout no longer applies, and the new group's peers must be checked.
    if (cudaMemset(st.epoch, 0, sizeof(uint64_t)) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {
      return PeerError{std::string(kOpNames[op]) + ": cannot reset the barrier state"};
    }
    *st.status = PeerStatus{0, 0, 0};
    // Every peer must be reachable by loads and stores (NVLink / P2P).
    for (int p = 0; p < num_ranks; ++p) {
      if (nvshmem_ptr(buffer->ptr, p) == nullptr) {
        return PeerError{std::string(kOpNames[op]) + ": peer " + std::to_string(p) +
                         " is not reachable by loads and stores (NVLink/P2P); this version "
                         "exchanges only between such GPUs"};
      }
    }
    st.generation = buffer->generation;
  }
  const volatile PeerStatus* report = st.status;  // written by the device
  if (report->code != 0) {
    return PeerError{std::string(kOpNames[op]) + ": an earlier call of " +
                     kOpNames[report->op] + " on this rank timed out after " +
                     std::to_string(st.timeout_ns / 1000000000ull) + " s waiting for peer " +
                     std::to_string(report->peer) +
                     " (did every process run the same ops?); the EP group is unusable, "
                     "restart the processes"};
  }
  *me = buffer->rank;
  *symmetric = static_cast<char*>(buffer->ptr);
  *bytes = buffer->bytes;
  return PeerError{};
}

PeerError too_small(int op, size_t needed, size_t bytes) {
  return PeerError{std::string(kOpNames[op]) + ": needs " + std::to_string(needed) +
                   " bytes of symmetric buffer, but jax_ep.initialize() allocated " +
                   std::to_string(bytes) +
                   "; initialize with a configuration as large as this call "
                   "(jax_ep.runtime.BufferConfig)"};
}

cudaError_t barrier(char* symmetric, int me, int n, int op, cudaStream_t stream) {
  State& st = state();
  return launch(barrier_kernel, 1, kMaxPeers, stream, reinterpret_cast<uint64_t*>(symmetric),
                st.epoch, me, n, st.timeout_ns, st.device_status, op);
}

cudaError_t copy(void* dst, const void* src, int64_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  return cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, stream);
}

PeerError launched(int op, cudaError_t status) {
  if (status == cudaSuccess) return PeerError{};
  return PeerError{std::string("CUDA error in ") + kOpNames[op] + ": " + cudaGetErrorName(status) +
                   ": " + cudaGetErrorString(status)};
}

// Low-latency regions sit at the end of the buffer: [end - ll_bytes, end).
struct LowLatencyRegions {
  int32_t* counts;
  char* recv_x;
  float* recv_scales;
  int32_t* src_row;
  Bf16* staging;
  size_t bytes;
};

LowLatencyRegions ll_regions(char* symmetric, size_t total, int R, int T, int K, int E, int H,
                             bool fp8) {
  const int64_t slots = static_cast<int64_t>(E / R) * R * T;
  LowLatencyRegions r{};
  auto carve = [&](char* base) {
    Carver c(base);
    r.counts = c.take<int32_t>(static_cast<int64_t>(R) * E);
    r.recv_x = c.take<char>(slots * (fp8 ? H : 2 * H));
    r.recv_scales = c.take<float>(fp8 ? slots * (H / kFp8Block) : 0);
    r.src_row = c.take<int32_t>(static_cast<int64_t>(R) * T * K);
    r.staging = c.take<Bf16>(static_cast<int64_t>(T) * K * H);
    return c.used();
  };
  r.bytes = (carve(symmetric) + kAlign - 1) / kAlign * kAlign;  // the size first
  if (r.bytes + kSignalBytes <= total) carve(symmetric + (total - r.bytes) / kAlign * kAlign);
  return r;
}

}  // namespace

PeerError peer_dispatch(const DispatchArgs& out, cudaStream_t stream) {
  constexpr int op = 0;
  int me;
  char* sym;
  size_t bytes;
  const int R = out.num_ranks;
  PeerError error = prepare(op, R, &me, &sym, &bytes);
  if (!error.ok()) return error;
  DispatchArgs a = out;
  a.first_rank = me;
  const int cap = a.capacity, K = a.top_k, rows = a.rows(), cols = a.idx_cols();
  const bool em = a.expert_major;
  Carver c(sym + kSignalBytes);
  a.counts = c.take<int32_t>(static_cast<int64_t>(R) * a.num_counters());
  a.recv_x = c.take<char>(cap * a.row_bytes);
  a.recv_scales = c.take<float>(cap * a.scale_cols);
  a.recv_idx = c.take<int32_t>(static_cast<int64_t>(cap) * cols);
  a.recv_weights = c.take<float>(static_cast<int64_t>(cap) * cols);
  a.recv_src = c.take<int32_t>(rows);
  a.src_row = c.take<int32_t>(static_cast<int64_t>(R) * a.num_tokens);
  a.entry_row = c.take<int32_t>(em ? cap : 0);
  a.entry_choice = c.take<int32_t>(em ? cap : 0);
  a.row_entries = c.take<int32_t>(em ? static_cast<int64_t>(rows) * K : 0);
  if (kSignalBytes + c.used() > bytes) return too_small(op, kSignalBytes + c.used(), bytes);

  const int items = std::max({cap, rows, a.experts_per_rank()});
  cudaError_t s = barrier(sym, me, R, op, stream);  // peers are done with the last op's data
  if (s == cudaSuccess) s = per_warp(DispatchCount<Peers>{a}, me, 1, a.num_counters() + 1, stream);
  if (s == cudaSuccess) s = barrier(sym, me, R, op, stream);  // every rank's counts are here
  if (s == cudaSuccess) s = per_thread(DispatchBases{a}, me, 1, a.num_counters(), stream);
  if (s == cudaSuccess) s = per_warp(DispatchSend<Peers>{a}, me, 1, a.num_tokens, stream);
  if (s == cudaSuccess) s = barrier(sym, me, R, op, stream);  // every row has arrived
  if (s == cudaSuccess) s = per_warp(DispatchFinish<Peers>{a}, me, 1, items, stream);
  // Copy out what XLA owns.
  if (s == cudaSuccess) s = copy(out.recv_x, a.recv_x, cap * a.row_bytes, stream);
  if (s == cudaSuccess) s = copy(out.recv_scales, a.recv_scales, cap * a.scale_cols * 4, stream);
  if (s == cudaSuccess) s = copy(out.recv_idx, a.recv_idx, int64_t{4} * cap * cols, stream);
  if (s == cudaSuccess) s = copy(out.recv_weights, a.recv_weights, int64_t{4} * cap * cols, stream);
  if (s == cudaSuccess) s = copy(out.recv_src, a.recv_src, int64_t{4} * rows, stream);
  if (s == cudaSuccess) s = copy(out.src_row, a.src_row, int64_t{4} * R * a.num_tokens, stream);
  if (s == cudaSuccess && em) {
    s = copy(out.entry_row, a.entry_row, int64_t{4} * cap, stream);
    if (s == cudaSuccess) s = copy(out.entry_choice, a.entry_choice, int64_t{4} * cap, stream);
    if (s == cudaSuccess) s = copy(out.row_entries, a.row_entries, int64_t{4} * rows * K, stream);
  }
  return launched(op, s);
}

template <typename T>
PeerError peer_combine(const CombineArgs<T>& in, cudaStream_t stream) {
  constexpr int op = 1;
  int me;
  char* sym;
  size_t bytes;
  const int R = in.num_ranks;
  PeerError error = prepare(op, R, &me, &sym, &bytes);
  if (!error.ok()) return error;
  CombineArgs<T> a = in;
  a.first_rank = me;
  const int64_t H = a.hidden, rows = static_cast<int64_t>(R) * a.num_tokens;
  const bool em = a.expert_major;
  // What peers read: the rows (or the per-row partial sums), their weights, src_row.
  Carver c(sym + kSignalBytes);
  T* y = c.take<T>(em ? 0 : a.capacity * H);
  float* weights = c.take<float>(!em && a.weights ? a.capacity : 0);
  int32_t* src_row = c.take<int32_t>(rows);
  T* partial = c.take<T>(em ? rows * H : 0);
  if (kSignalBytes + c.used() > bytes) return too_small(op, kSignalBytes + c.used(), bytes);

  cudaError_t s = barrier(sym, me, R, op, stream);
  if (s == cudaSuccess && !em) s = copy(y, in.y, a.capacity * H * int64_t{sizeof(T)}, stream);
  if (s == cudaSuccess && !em && a.weights) s = copy(weights, in.weights, int64_t{4} * a.capacity, stream);
  if (s == cudaSuccess) s = copy(src_row, in.src_row, int64_t{4} * rows, stream);
  a.src_row = src_row;
  if (!em) {
    a.y = y;
    a.weights = a.weights ? weights : nullptr;
  } else {
    a.partial = partial;  // reduce_entries reads the local y, row_entries and weights
    if (s == cudaSuccess) s = per_warp(CombineReduceEntries<T>{a}, me, 1, rows, stream);
  }
  if (s == cudaSuccess) s = barrier(sym, me, R, op, stream);
  if (s == cudaSuccess) s = per_warp(CombineToken<T, Peers>{a}, me, 1, a.num_tokens, stream);
  return launched(op, s);
}

template PeerError peer_combine<float>(const CombineArgs<float>&, cudaStream_t);
template PeerError peer_combine<Bf16>(const CombineArgs<Bf16>&, cudaStream_t);
template PeerError peer_combine<F16>(const CombineArgs<F16>&, cudaStream_t);

namespace {

// The preconditions and the low-latency regions of one low-latency call.
PeerError open_ll(int op, int R, int T, int K, int E, int H, bool fp8, int* me, char** sym,
                  LowLatencyRegions* r) {
  size_t bytes;
  PeerError error = prepare(op, R, me, sym, &bytes);
  if (!error.ok()) return error;
  *r = ll_regions(*sym, bytes, R, T, K, E, H, fp8);
  if (r->bytes + kSignalBytes > bytes) return too_small(op, r->bytes + kSignalBytes, bytes);
  return PeerError{};
}

}  // namespace

PeerError peer_ll_dispatch_send(const LowLatencyArgs& out, cudaStream_t stream) {
  constexpr int op = 2;
  const int R = out.num_ranks;
  int me;
  char* sym;
  LowLatencyRegions r;
  PeerError error = open_ll(op, R, out.num_tokens, out.top_k, out.num_experts, out.hidden,
                            out.use_fp8, &me, &sym, &r);
  if (!error.ok()) return error;
  LowLatencyArgs a = out;
  a.first_rank = me;
  a.counts = r.counts;
  a.recv_x = r.recv_x;
  a.recv_scales = r.recv_scales;
  a.src_row = r.src_row;
  cudaError_t s = barrier(sym, me, R, op, stream);
  if (s == cudaSuccess) s = per_warp(LowLatencyCount<Peers>{a}, me, 1, a.num_experts + 1, stream);
  if (s == cudaSuccess) s = barrier(sym, me, R, op, stream);  // every rank's counts are here
  if (s == cudaSuccess) s = per_warp(LowLatencySend<Peers>{a}, me, 1, a.num_tokens, stream);
  return launched(op, s);
}

PeerError peer_ll_dispatch_recv(const LowLatencyArgs& out, cudaStream_t stream) {
  constexpr int op = 3;
  const int R = out.num_ranks;
  int me;
  char* sym;
  LowLatencyRegions r;
  PeerError error = open_ll(op, R, out.num_tokens, out.top_k, out.num_experts, out.hidden,
                            out.use_fp8, &me, &sym, &r);
  if (!error.ok()) return error;
  LowLatencyArgs a = out;
  a.first_rank = me;
  a.counts = r.counts;
  a.recv_x = r.recv_x;
  a.recv_scales = r.recv_scales;
  const int64_t slots = a.experts_per_rank() * a.slots();
  const int64_t scale_bytes = a.use_fp8 ? slots * (a.hidden / kFp8Block) * 4 : 0;
  cudaError_t s = barrier(sym, me, R, op, stream);  // every message has arrived
  if (s == cudaSuccess) s = per_warp(LowLatencyFinish<Peers>{a}, me, 1, slots, stream);
  if (s == cudaSuccess) s = copy(out.recv_x, r.recv_x, slots * a.row_bytes(), stream);
  if (s == cudaSuccess) s = copy(out.recv_scales, r.recv_scales, scale_bytes, stream);
  if (s == cudaSuccess) {
    s = copy(out.src_row, r.src_row, int64_t{4} * R * a.num_tokens * a.top_k, stream);
  }
  return launched(op, s);
}

namespace {

// Both halves of low-latency combine: the send pushes rows into the homes' staging slots
// (after the homes are done with them), the receive sums them (after they all arrived).
PeerError peer_ll_combine(int op, const LowLatencyCombineArgs& in, cudaStream_t stream) {
  const int R = in.num_ranks;
  int me;
  char* sym;
  LowLatencyRegions r;
  PeerError error = open_ll(op, R, in.num_tokens, in.top_k, in.num_experts, in.hidden, false,
                            &me, &sym, &r);
  if (!error.ok()) return error;
  LowLatencyCombineArgs a = in;
  a.first_rank = me;
  a.staging = r.staging;
  cudaError_t s = barrier(sym, me, R, op, stream);
  if (s == cudaSuccess && op == 4) {
    s = per_warp(LowLatencyCombineSend<Peers>{a}, me, 1, int64_t{R} * a.num_tokens, stream);
  } else if (s == cudaSuccess) {
    s = per_warp(LowLatencyCombineToken{a}, me, 1, a.num_tokens, stream);
  }
  return launched(op, s);
}

}  // namespace

PeerError peer_ll_combine_send(const LowLatencyCombineArgs& in, cudaStream_t stream) {
  return peer_ll_combine(4, in, stream);
}

PeerError peer_ll_combine_recv(const LowLatencyCombineArgs& in, cudaStream_t stream) {
  return peer_ll_combine(5, in, stream);
}

}  // namespace jax_ep::cuda
