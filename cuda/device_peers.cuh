// What the GPU platforms of cuda/peer_ops.h share: the per-GPU state of the exchange between
// devices and the Meet inside the kernels. Two platforms use it: NVSHMEM, one GPU per process
// (cuda/peer_exchange.cu), and CUDA peer access, the GPUs of one process
// (cuda/local_exchange.cu). They differ in how a kernel reaches a peer (a Net: its signal and
// whether puts need completing) and in how the group's peers are found; the flags, their
// counts and the bounded waits are these.
//
// Safety: every wait is bounded (cuda/peer_ops.h, Wait: by the start timeout where peers may
// not have started the op, else by the op timeout). A wait that lasts longer for a peer
// records (op, peer) in a status word in host memory and gives up; every later call of any op
// on this GPU reports it as an error, until a new jax_ep.initialize(). A failure is the
// group's: the failed rank's signals stay at its arrivals before the failure, with
// kRankFailed (cuda/peer_ops.h), and a peer's wait for a later arrival stops at once (status
// 6), so no rank waits out a timeout for a failed peer or goes on with rows it never sent.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cuda/ep_group.h"
#include "cuda/kernels.h"
#include "cuda/peer_ops.h"
#include "cuda/phases.cuh"
#include "cuda/setup.cuh"

namespace jax_ep::cuda {

// What went wrong in a wait. In mapped host memory.
struct PeerStatus {
  // 0 ok; 1 or 3: a wait gave up waiting for `peer` inside the op (1) or to start it (3);
  // 2: rank mismatch (EP axis index `peer`); 4: a ring wait gave up (cuda/channels.h:
  // `channel`, `kind` a RingWaitKind, `have` and `want` its counters); 5: a low-latency send
  // on region `peer` that still held an exchange in flight (record_arrival); 6: a wait
  // stopped because `peer` failed (its signal carried kRankFailed); 7: a launch of a CUDA
  // graph recorded for an earlier symmetric buffer (before jax_ep.finalize()) was replayed,
  // and did nothing. Every code is the group's failure: set once (the first wins), kept
  // until a new symmetric buffer.
  int code;
  int op;
  int peer;
  int channel = 0;
  int kind = 0;
  uint64_t have = 0, want = 0;
};

// What this GPU's launches count and record, in device memory, changed by them alone (so a
// replayed CUDA graph finds what the launches before it left, cuda/peer_ops.h, Meet).
struct DeviceCounters {
  uint64_t epoch;         // launches of this rank that arrived
  RegionRecord regions;   // the two low-latency regions
  uint64_t generation;    // the symmetric buffer they count for (PeerState::generation)
  int32_t failed;         // the status word's code, the copy the launches read (0: none)
  uint64_t failed_at;     // epoch when this rank failed: its signals' count from then on
};

// One GPU's state of the exchange between devices, for one symmetric buffer (`generation`).
// The host part is fixed once the GPU joined its group: a call issues the same launches
// whatever came before it.
struct PeerState {
  PeerStatus* status = nullptr;         // host pointer (mapped)
  PeerStatus* device_status = nullptr;  // the same memory, as the device sees it
  DeviceCounters* counters = nullptr;   // device memory
  Timeouts timeouts;
  int generation = 0;                   // the symmetric buffer the state above belongs to
  // This GPU's EP group, fixed by the first exchange after initialize (empty: none yet).
  std::vector<int64_t> group;  // its devices, in EP rank order
  int group_rank = 0;          // this GPU's EP rank in it
  int group_nodes = 0;         // its ranks per node (cuda/ep_group.h; 0: one node)
  void* peers = nullptr;       // device memory: how to reach each rank (the platform's table)
};

// What a launch recorded into a CUDA graph for an earlier symmetric buffer does when it is
// replayed: nothing (code 7). Its addresses are the freed buffer's and group table's.
inline const char* const kStaleReplay =
    "replayed from a CUDA graph (an XLA command buffer) recorded before jax_ep.finalize(): "
    "its launches hold the freed buffer's addresses and did nothing. jax_ep.finalize() clears "
    "JAX's caches, so a jitted program compiles and records again; a program compiled ahead "
    "of time (.lower().compile()) must be compiled again after jax_ep.initialize()";

// The error of an earlier call that failed on the device, if any (the device wrote it into
// st.status).
inline PeerError earlier_error(int op, PeerState& st) {
  const std::string name = kPeerOpNames[op];
  const volatile PeerStatus* report = st.status;  // written by the device
  if (report->code == 1 || report->code == 3) {
    return after_timeout(op, report->op, report->peer,
                         report->code == 3 ? Wait::kStart : Wait::kInOp, st.timeouts,
                         "restart the processes");
  }
  if (report->code == 4) {
    return PeerError{name + ": an earlier call of " + kPeerOpNames[report->op] + " " +
                     ring_timed_out(static_cast<RingWaitKind>(report->kind), report->peer,
                                    report->channel, report->have, report->want,
                                    st.timeouts) +
                     "; the EP group is unusable, restart the processes"};
  }
  if (report->code == 5) {
    return PeerError{name + ": an earlier call of " + in_flight_error(report->op, report->peer) +
                     "; the EP group is unusable, call jax_ep.finalize() and "
                     "jax_ep.initialize() again"};
  }
  if (report->code == 6) {
    return PeerError{name + ": an earlier call of " + kPeerOpNames[report->op] +
                     " on this rank " + peer_failed(report->peer)};
  }
  if (report->code == 7) {
    return PeerError{name + ": an earlier call of " + kPeerOpNames[report->op] + " was " +
                     kStaleReplay + "; the EP group is unusable, call jax_ep.finalize() and "
                     "jax_ep.initialize() again"};
  }
  if (report->code == 2) {
    return PeerError{name + ": an earlier call of " + kPeerOpNames[report->op] +
                     " ran with EP axis index " + std::to_string(report->peer) +
                     " on the GPU of EP rank " + std::to_string(st.group_rank) +
                     " of its group " + devices_text(st.group) +
                     " (a program traced for another mesh); the EP group is unusable, "
                     "restart the processes"};
  }
  return PeerError{};
}

// Readies `st` (on the current GPU) for a call of `op` on the symmetric buffer of
// `generation`: allocated once, reset when the buffer is new (its signals are zero, so the
// arrivals count from zero again, an old failure no longer applies and the group is chosen
// again), and the error of an earlier call that failed on the device, if any.
// Issued by a handler XLA may be capturing into a CUDA graph: the setup is a Setup, never
// part of the graph, and once done a call has no host work but reading the status word.
inline PeerError ready_state(int op, int generation, PeerState& st) {
  const std::string name = kPeerOpNames[op];
  if (st.status != nullptr && st.generation == generation) return earlier_error(op, st);
  Setup setup;
  if (st.status == nullptr) {
    void* host = nullptr;
    if (cudaHostAlloc(&host, sizeof(PeerStatus), cudaHostAllocMapped) != cudaSuccess ||
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&st.device_status), host, 0) !=
            cudaSuccess ||
        cudaMalloc(&st.counters, sizeof(DeviceCounters)) != cudaSuccess) {
      return PeerError{name + ": cannot allocate the peers' state"};
    }
    st.status = static_cast<PeerStatus*>(host);
    st.timeouts = timeouts_from_env();
  }
  if (st.generation != generation) {
    const uint64_t current = static_cast<uint64_t>(generation);
    if (setup.zero(st.counters, sizeof(DeviceCounters)) != cudaSuccess ||
        setup.copy_to_device(&st.counters->generation, &current, sizeof(current)) !=
            cudaSuccess ||
        setup.finish() != cudaSuccess) {
      return PeerError{name + ": cannot reset the peers' state"};
    }
    *st.status = PeerStatus{0, 0, 0};
    cudaFree(st.peers);
    st.peers = nullptr;
    st.group.clear();
    st.generation = generation;
  }
  return earlier_error(op, st);
}

// The group of a call with num_ranks ranks: `row` (its devices, EP rank order) and this GPU's
// `rank` from the program's `groups` (whose `device` is this GPU's id), or every one of
// `all_devices` in order without a table; fails when a table does not fit, or when this GPU
// already joined another group (the flags count the launches of one group).
inline PeerError group_of_call(int op, int num_ranks, const GroupTable& groups,
                               const std::vector<int64_t>& all_devices, int own_index,
                               const PeerState& st, std::vector<int64_t>* row, int* rank) {
  const std::string name = kPeerOpNames[op];
  if (groups.size > 0) {
    // The EP axis index lives on the device: the launches compare it (DeviceMeet::check_rank).
    const std::string error = find_group(groups, num_ranks, kUncheckedRank, row, rank);
    if (!error.empty()) return PeerError{name + ": " + error};
  } else if (static_cast<int>(all_devices.size()) != num_ranks) {
    return PeerError{name + ": the EP axis has " + std::to_string(num_ranks) + " ranks but " +
                     std::to_string(all_devices.size()) + " GPUs were initialized; without a "
                     "concrete mesh (jax.set_mesh) the EP axis must span every GPU of "
                     "jax_ep.initialize()"};
  } else {
    *row = all_devices;
    *rank = own_index;
  }
  if (st.group.empty() || *row == st.group) return PeerError{};
  return PeerError{name + ": this GPU exchanges in the EP group of devices " +
                   devices_text(st.group) + " since its first exchange after "
                   "jax_ep.initialize(); a program in the group " + devices_text(*row) +
                   " needs jax_ep.finalize() and jax_ep.initialize() first (the flags count "
                   "the launches of one group)"};
}

// A table of `count` values in device memory (the current GPU's), replacing `*table`.
// Once per group (a Setup, as ready_state's).
template <typename T>
cudaError_t upload_table(const std::vector<T>& values, void** table) {
  Setup setup;
  cudaFree(*table);
  *table = nullptr;
  cudaError_t status = cudaMalloc(table, values.size() * sizeof(T));
  if (status != cudaSuccess) return status;
  setup.copy_to_device(*table, values.data(), values.size() * sizeof(T));
  return setup.finish();
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Records a failure of this rank (a PeerStatus code and its details) for the handlers (the
// host's status word) and the launches (the counters' device copy), unless one is recorded
// already: the first stays. Plain stores (two threads failing at once both record a fine
// failure). Returns whether this one was recorded.
__device__ inline bool record_failure(PeerStatus* status, DeviceCounters* counters, int code,
                                      int op, int peer, int channel = 0, int kind = 0,
                                      uint64_t have = 0, uint64_t want = 0) {
  volatile PeerStatus* out = status;
  volatile int32_t* copy = &counters->failed;
  if (*copy != 0 || out->code != 0) return false;
  out->op = op;
  out->peer = peer;
  out->channel = channel;
  out->kind = kind;
  out->have = have;
  out->want = want;
  __threadfence_system();
  out->code = code;
  counters->failed_at = counters->epoch;
  *copy = code;
  return true;
}

// A Meet (cuda/peer_ops.h) on the GPU, for per_warp_kernel (cuda/phases.cuh). signals[p] in
// this rank's symmetric buffer counts the launches of EP rank p that arrived; the counters'
// `epoch` those of this rank. `Net` reaches the peers: `signal(slot, value, rank)` sets `slot`
// (an address in this rank's buffer) in rank's buffer after this rank's earlier writes,
// `quiet()` completes the puts this PE issued before it (NVSHMEM's per-PE quiet).
//
// A failure (a PeerStatus code) is recorded in the host's status word, for the handlers, and
// in the counters' device copy (`failed`), which the launches read: a rank that failed does
// nothing in its later launches but count their arrivals, its signals staying as report()
// set them.
template <typename Net>
struct DeviceMeet {
  uint64_t* signals;
  DeviceCounters* counters;
  uint64_t generation;  // the symmetric buffer this launch was issued for
  Net net;
  int me, n, op;  // this EP rank, the group's ranks
  const int32_t* axis_index;
  PeerStatus* status;
  uint64_t before_ns = 0, after_ns = 0;  // bounds of the waits; 0: no wait
  int before_code = 0, after_code = 0;   // PeerStatus codes of their timeouts
  int region = -1;  // Meet::region, region_wait, flight, flight_kind and opens_send
  bool region_wait = false;
  int8_t flight = 0;
  int flight_kind = 0;
  bool opens_send = false;
  bool arrive = false;
  bool quiet = false;  // an arriving launch over puts: done() completes the block's puts

  __host__ __device__ bool waits_first() const { return before_ns != 0; }
  __host__ __device__ bool has_last() const { return arrive || after_ns != 0; }

  // Every thread of the block, before its items: whether the block goes on is decided once
  // for the whole block (failed()).
  __device__ void first() const {
    if (stale()) {  // a graph recorded before jax_ep.finalize(): touch nothing of its buffer
      if (blockIdx.x == 0 && threadIdx.x == 0) report_stale();
      gave_up() = true;
      return;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) check_rank();
    // A send on a region whose last exchange of its kind was not received yet is refused
    // before it writes anything; every rank of a group running the same program refuses it.
    const bool refused = opens_send && counters->regions.in_flight[region][flight_kind] != 0;
    if (refused && blockIdx.x == 0 && threadIdx.x == 0) report(5, region);
    bool stop = __syncthreads_or(refused || failure() != 0) != 0;
    if (!stop && before_ns != 0) stop = !wait_for_peers(before_ns, before_code, region_wait);
    gave_up() = stop;  // every thread stores the block's one answer
  }
  // Whether this block stopped (this rank failed, or a wait gave up): the peers' data may not
  // be there, and the op fails anyway. After first().
  __device__ bool failed() const { return gave_up(); }
  __device__ static bool& gave_up() {
    __shared__ bool flag;
    return flag;
  }
  // Every thread after its items. NVSHMEM specifies nvshmem_quiet per PE (it completes every
  // put the GPU issued before it), so one thread per block quiets, once the block's threads
  // have issued theirs: with IBGDA each quiet polls every queue pair, so never one per thread.
  __device__ void done() const {
    if (!quiet || stale()) return;
    __syncthreads();
    if (threadIdx.x == 0) net.quiet();
  }
  __device__ void last() const {
    if (stale()) return;
    if (arrive) tell_peers();
    if (after_ns != 0) wait_for_peers(after_ns, after_code, false);
  }

  // The op's EP axis index must be this GPU's EP rank in its group.
  __device__ void check_rank() const {
    const int32_t index = *axis_index;
    if (index != me) report(2, index);
  }

  // This rank's failure code (0: none), from the device copy.
  __device__ int failure() const {
    return *static_cast<const volatile int32_t*>(&counters->failed);
  }
  // Whether this launch was issued for an earlier symmetric buffer (a replayed CUDA graph
  // recorded before jax_ep.finalize()).
  __device__ bool stale() const {
    return *static_cast<const volatile uint64_t*>(&counters->generation) != generation;
  }
  // Code 7, without telling the peers (the signals' address is the freed buffer's).
  __device__ void report_stale() const { record_failure(status, counters, 7, op, 0); }

  // Records what went wrong (record_failure) and, for the first failure, tells every peer:
  // this rank's signal becomes its arrivals so far with kRankFailed, and stays so.
  __device__ void report(int code, int peer) const {
    if (!record_failure(status, counters, code, op, peer)) return;
    for (int p = 0; p < n; ++p) net.signal(signals + me, counters->failed_at | kRankFailed, p);
  }

  // Every thread of the block: this rank's writes (every block's, is_last_block) are visible,
  // then each thread p < n sets this rank's signal in EP rank p. A low-latency op's arrival
  // also records its region's use. Once this rank failed, its signal is its arrivals from
  // before the failure with kRankFailed (record_failure's failed_at): report() set it already,
  // but a failure a streaming body's Watch recorded (it has no way to the peers) reaches them
  // here. Every other block is done when the last one arrives: no failure is recorded while
  // this runs.
  __device__ void tell_peers() const {
    __shared__ uint64_t value;
    if (threadIdx.x == 0) {
      const uint64_t arrivals = counters->epoch + 1;
      if (region >= 0 &&
          !record_arrival(&counters->regions, region, flight, flight_kind, arrivals)) {
        report(5, region);
      }
      counters->epoch = arrivals;
      value = failure() != 0 ? counters->failed_at | kRankFailed : arrivals;
    }
    if (threadIdx.x == 0) net.quiet();  // the tail's puts (done() quieted the items')
    __threadfence_system();
    __syncthreads();
    for (int p = threadIdx.x; p < n; p += blockDim.x) net.signal(signals + me, value, p);
  }

  // Every thread of the block: until each peer arrived as often as this rank (`at_region`:
  // as this rank had when the region's last op arrived), thread p watching peer p, bounded by
  // `timeout_ns`; then the peers' writes are visible to the block. A peer that failed before it
  // arrived (its signal carries kRankFailed) stops the wait at once (code 6), as does a
  // failure of this rank. Returns, in every thread, whether every peer arrived.
  __device__ bool wait_for_peers(uint64_t timeout_ns, int timeout_code, bool at_region) const {
    __syncthreads();  // the block's reads of the epoch come after tell_peers' write
    const uint64_t target = at_region ? counters->regions.last_use[region] : counters->epoch;
    int gave_up = 0;
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
      volatile uint64_t* arrived = signals + p;
      const uint64_t start = global_ns();
      for (;;) {
        const uint64_t seen = *arrived;
        // Arrivals from before a peer failed count; a peer that failed first never comes.
        if ((seen & ~kRankFailed) >= target) break;
        if ((seen & kRankFailed) != 0) {
          if (p != me) report(6, p);
          gave_up = 1;
          break;
        }
        if (failure() != 0) {
          gave_up = 1;
          break;
        }
        if (global_ns() - start > timeout_ns) {
          report(timeout_code, p);
          gave_up = 1;
          break;
        }
        __nanosleep(200);
      }
    }
    __threadfence_system();
    return __syncthreads_or(gave_up) == 0;
  }
};

// What the waits of a streaming body need (cuda/dispatch_stream.h, Watch): a ring wait that
// gives up records where (code 4), and every unit stops at its next wait; so does a peer
// whose arrival signal carries kRankFailed (code 6). The launch's arrival then tells the
// peers (DeviceMeet::tell_peers). Called by a warp's leader (Patience).
struct DeviceWatch {
  PeerStatus* status;
  DeviceCounters* counters;
  uint64_t limit_ns;
  int op;
  const uint64_t* signals;  // this rank's: each peer's arrivals
  int n, me;
  __host__ __device__ bool failed() const {
#if defined(__CUDA_ARCH__)
    if (*static_cast<const volatile int32_t*>(&counters->failed) != 0) return true;
    for (int p = 0; p < n; ++p) {
      if (p != me && (static_cast<const volatile uint64_t*>(signals)[p] & kRankFailed) != 0) {
        record_failure(status, counters, 6, op, p);
        return true;
      }
    }
#endif
    return false;
  }
  __host__ __device__ uint64_t now() const {
#if defined(__CUDA_ARCH__)
    return global_ns();
#else
    return 0;
#endif
  }
  __host__ __device__ uint64_t limit() const { return limit_ns; }
  __host__ __device__ void pause() const {
#if defined(__CUDA_ARCH__)
    __nanosleep(100);
#endif
  }
  __host__ __device__ void give_up(RingWaitKind kind, int peer, int channel, uint64_t have,
                                   uint64_t want) const {
#if defined(__CUDA_ARCH__)
    record_failure(status, counters, 4, op, peer, channel, static_cast<int>(kind), have, want);
#else
    (void)kind, (void)peer, (void)channel, (void)have, (void)want;
#endif
  }
};

// The DeviceMeet of a launch of this GPU's rank that meets the peers as `meet` says.
template <typename Net>
DeviceMeet<Net> device_meet(const Meet& meet, const Net& net, bool puts, uint64_t* signals,
                            int op, const int32_t* axis_index, const PeerState& st) {
  DeviceMeet<Net> m{signals,
                    st.counters,
                    static_cast<uint64_t>(st.generation),
                    net,
                    st.group_rank,
                    static_cast<int>(st.group.size()),
                    op,
                    axis_index,
                    st.device_status};
  auto bound = [&](const std::optional<Wait>& wait, uint64_t* ns, int* code) {
    if (!wait) return;
    *ns = std::max<uint64_t>(st.timeouts.of(*wait), 1);
    *code = *wait == Wait::kStart ? 3 : 1;
  };
  bound(meet.before, &m.before_ns, &m.before_code);
  bound(meet.after, &m.after_ns, &m.after_code);
  m.region = meet.region;
  m.region_wait = meet.region_wait;
  m.flight = meet.flight;
  m.flight_kind = meet.flight_kind;
  m.opens_send = meet.opens_send;
  m.arrive = meet.arrive;
  m.quiet = meet.arrive && puts;
  return m;
}

// One launch of `phase` for EP rank `st.group_rank` on `stream`, meeting the peers through
// `net` as `meet` says (cuda/peer_ops.h). `puts`: the launch's
// puts need completing before it arrives.
template <typename Net, typename Phase, typename Tail>
cudaError_t launch_meeting(const Phase& phase, int64_t items, const Meet& meet,
                           const Tail& tail, const Net& net, bool puts, uint64_t* signals,
                           int op, const int32_t* axis_index, int num_sms,
                           cudaStream_t stream, PeerState& st) {
  const DeviceMeet<Net> m = device_meet(meet, net, puts, signals, op, axis_index, st);
  return per_warp(phase, st.group_rank, 1, items, stream, num_sms, tail, m);
}

// One streaming launch of `body` (cuda/channels.h) for EP rank `st.group_rank`, meeting the
// peers as launch_meeting does.
template <typename Net, typename Body>
cudaError_t launch_units(const Body& body, const Meet& meet, const Net& net, bool puts,
                         uint64_t* signals, int op, const int32_t* axis_index,
                         cudaStream_t stream, PeerState& st) {
  const DeviceMeet<Net> m = device_meet(meet, net, puts, signals, op, axis_index, st);
  const DeviceWatch watch{st.device_status, st.counters,
                          std::max<uint64_t>(st.timeouts.in_op_ns, 1), op, signals,
                          static_cast<int>(st.group.size()), st.group_rank};
  return per_unit(body, st.group_rank, 1, body.units(), stream, m, watch);
}

}  // namespace jax_ep::cuda
