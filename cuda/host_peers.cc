// Host peers (cuda/host_peers.h): groups of host buffers and the CPU platform of
// cuda/peer_ops.h.
#include "cuda/host_peers.h"

#include <sys/mman.h>

#include <atomic>
#include <cstdio>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

namespace jax_ep::host {
namespace {

using Clock = std::chrono::steady_clock;
using Signal = std::atomic<uint64_t>;

// What made a rank's group unusable, as a GPU keeps it in its status word: `failed` set
// once (with release, after `error`), never cleared until jax_ep.finalize(). Written under
// the platform's failure mutex; `error` read after `failed` is seen.
struct RankStatus {
  std::atomic<bool> failed{false};
  std::string error;  // what every later call reports: "an earlier call of ..."
};

// Per-rank state that only the rank's own launches touch, one exchange at a time (`busy`): what
// a GPU keeps in device memory.
struct RankState {
  uint64_t epoch = 0;  // launches of this rank that arrived (Meet)
  RegionRecord regions{};  // the two low-latency regions (cuda/peer_ops.h)
  RankStatus status;
  std::atomic<bool> busy{false};  // an exchange of this rank is running
};

// R symmetric buffers in anonymous memory (zero until written, pages on first touch), for
// the group of devices `key` (cuda/ep_group.h; {-R}: the group of R ranks without a table).
class Group {
 public:
  Group(std::vector<int64_t> key, int num_ranks, size_t bytes, size_t low_latency_offset,
        bool puts, int ranks_per_node, const Timeouts& timeouts)
      : key_(std::move(key)),
        bytes_(bytes),
        low_latency_offset_(low_latency_offset),
        puts_(puts),
        ranks_per_node_(ranks_per_node),
        timeouts_(timeouts),
        regions_(num_ranks),
        ranks_(num_ranks) {
    for (char*& region : regions_) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) throw std::bad_alloc();
      region = static_cast<char*>(p);
      for (int q = 0; q < kMaxPeers; ++q) new (region + q * sizeof(Signal)) Signal(0);
    }
  }
  ~Group() {
    for (char* region : regions_) munmap(region, bytes_);
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const std::vector<int64_t>& key() const { return key_; }
  int num_ranks() const { return static_cast<int>(regions_.size()); }
  size_t bytes() const { return bytes_; }
  size_t low_latency_offset() const { return low_latency_offset_; }
  bool puts() const { return puts_; }
  int ranks_per_node() const { return ranks_per_node_; }
  const Timeouts& timeouts() const { return timeouts_; }
  char* const* regions() const { return regions_.data(); }
  RankState& rank(int r) { return ranks_[r]; }
  // The signal that rank `from` sets in rank `owner`'s buffer.
  Signal& signal(int owner, int from) {
    return *reinterpret_cast<Signal*>(regions_[owner] + from * sizeof(Signal));
  }

 private:
  std::vector<int64_t> key_;
  size_t bytes_, low_latency_offset_;
  bool puts_;
  int ranks_per_node_;
  Timeouts timeouts_;
  std::vector<char*> regions_;
  std::vector<RankState> ranks_;
};

// The groups, created on first use and kept until finalize, in a list that an op searches
// without the mutex: a lock taken by every rank on every op would order the ranks' ops as a
// barrier does, and hide a missing barrier from ThreadSanitizer.
struct Registry {
  struct Node {
    std::unique_ptr<Group> group;
    Node* next;
  };
  std::mutex mutex;  // initialize, finalize, creating a group
  size_t bytes = 0;  // 0: not initialized
  std::atomic<int> generation{0};  // counts initializations (recordings hold their groups)
  size_t low_latency_offset = 0;
  bool puts = false;
  int ranks_per_node = 0;
  Timeouts timeouts;
  std::atomic<Node*> groups{nullptr};

  static Group* find(Node* node, const std::vector<int64_t>& key) {
    for (; node != nullptr; node = node->next) {
      if (node->group->key() == key) return node->group.get();
    }
    return nullptr;
  }
  // The group of `key` with `num_ranks` ranks, created on first use; nullptr when not
  // initialized.
  Group* group(const std::vector<int64_t>& key, int num_ranks) {
    if (Group* g = find(groups.load(std::memory_order_acquire), key)) return g;
    std::lock_guard<std::mutex> lock(mutex);
    Node* head = groups.load(std::memory_order_acquire);
    if (Group* g = find(head, key)) return g;
    if (bytes == 0) return nullptr;
    auto* node = new Node{std::make_unique<Group>(key, num_ranks, bytes, low_latency_offset,
                                                  puts, ranks_per_node, timeouts),
                          head};
    groups.store(node, std::memory_order_release);
    return node->group.get();
  }
  // Frees every group (under the mutex).
  void clear() {
    Node* node = groups.exchange(nullptr, std::memory_order_acq_rel);
    while (node != nullptr) {
      Node* next = node->next;
      delete node;
      node = next;
    }
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

// Peers in host memory: the same offset in rank `rank`'s buffer. Node-aware, the ranks of this
// rank's node only, [node_first, node_end): reaching another aborts, as between the GPUs of
// two nodes nvshmem_ptr has no address.
struct HostPeers {
  static constexpr bool kPuts = false;
  char* const* regions;
  int me;
  int node_first = 0, node_end = kMaxPeers;
  template <typename T>
  T* at(T* base, int64_t /*stride*/, int rank) const {
    if (rank < node_first || rank >= node_end) {
      std::fprintf(stderr, "jax_ep: host peers, rank %d: a store into rank %d of another node "
                           "(a bug in jax_ep)\n", me, rank);
      std::abort();
    }
    const uintptr_t offset =
        reinterpret_cast<uintptr_t>(base) - reinterpret_cast<uintptr_t>(regions[me]);
    return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(regions[rank]) + offset);
  }
};

// Peers in host memory reached by puts only (cuda/exchange.h, put views), as over a network:
// a put copies from this rank's buffer into the same offset of a peer's, and no phase gets a
// pointer into a peer's buffer. What a put view forbids is checked: a put's source outside
// this rank's buffer (RDMA could not read it), and reading another rank's copy.
struct HostPutPeers {
  static constexpr bool kPuts = true;
  char* const* regions;
  int me;
  size_t bytes;

  template <typename T>
  void put(T* dst, int rank, const T* src, int64_t count, int lane, int lanes) const {
    const uintptr_t from = reinterpret_cast<uintptr_t>(src);
    const uintptr_t own = reinterpret_cast<uintptr_t>(regions[me]);
    if (from < own || from + count > own + bytes) misuse("a put's source outside the buffer");
    if (lane == 0) meter_message();  // one put, which every lane of the warp calls
    copy_row(peer(dst, rank), src, count, lane, lanes);
  }
  template <typename T>
  void put_value(T* dst, int rank, T value) const {
    meter_message();
    *peer(dst, rank) = value;
  }
  // Adds `delta` to the counter `slot` in rank's buffer (NVSHMEM's signal add), after this
  // rank's earlier puts there (which are done: a put copies at once here).
  void signal_add(uint64_t* slot, int rank, uint64_t delta, bool /*after_puts*/) const {
    meter_message();
    __atomic_fetch_add(peer(slot, rank), delta, __ATOMIC_RELEASE);
  }
  // A put, then `delta` added to the counter, as one message (NVSHMEM's put with signal).
  void put_signal_add(char* dst, int rank, const char* src, int64_t bytes, uint64_t* slot,
                      uint64_t delta, int lane, int lanes) const {
    const uintptr_t from = reinterpret_cast<uintptr_t>(src);
    const uintptr_t own = reinterpret_cast<uintptr_t>(regions[me]);
    if (from < own || from + bytes > own + this->bytes) misuse("a put's source outside the buffer");
    copy_row(peer(dst, rank), src, bytes, lane, lanes);
    if (lane == 0) {  // the last lane on the CPU (cuda/host_launch.h): after every lane's copy
      meter_message();
      __atomic_fetch_add(peer(slot, rank), delta, __ATOMIC_RELEASE);
    }
  }
  template <typename T>
  T* own(T* base, int rank) const {
    if (rank != me) misuse("a read of another rank's buffer");
    return base;
  }

 private:
  template <typename T>
  T* peer(T* base, int rank) const {
    return HostPeers{regions, me}.at(base, 0, rank);
  }
  [[noreturn]] void misuse(const char* what) const {
    std::fprintf(stderr, "jax_ep: host put peers, rank %d: %s (a bug in jax_ep)\n", me, what);
    std::abort();
  }
};

class HostPlatform;

}  // namespace

// The launches of a recorded call, each with its arguments as the op issued it: what a CUDA
// graph holds of a kernel sequence.
class Recording {
 public:
  void add(std::function<void(HostPlatform&)> launch) { launches_.push_back(std::move(launch)); }
  void bind(Group* group, int rank, int op, const HostGrid& grid) {
    group_ = group, rank_ = rank, op_ = op, grid_ = grid;
    generation_ = registry().generation.load(std::memory_order_relaxed);
  }
  // Whether its group still exists (no jax_ep.finalize() since it was recorded).
  bool current() const {
    return generation_ == registry().generation.load(std::memory_order_relaxed);
  }
  PeerError replay() const;

 private:
  std::vector<std::function<void(HostPlatform&)>> launches_;
  Group* group_ = nullptr;
  int rank_ = 0, op_ = 0, generation_ = 0;
  HostGrid grid_;
};

namespace {

// The CPU platform of cuda/peer_ops.h: launches on this thread (or the grid's threads), meeting
// the peers as in the file comment.
class HostPlatform {
 public:
  using Peers = HostPeers;
  using PutPeers = HostPutPeers;
  static constexpr bool kPutPeers = true;

  // `recording`: the launches go into it instead of running (record()).
  explicit HostPlatform(const HostGrid& grid, Recording* recording = nullptr)
      : grid_(grid), recording_(recording) {}

  PeerError open(int op, int num_ranks, int rank, const GroupTable& groups) {
    const std::string name = kPeerOpNames[op];
    if (num_ranks > kMaxPeers) {
      return PeerError{name + ": at most " + std::to_string(kMaxPeers) + " ranks are supported"};
    }
    if (rank < 0 || rank >= num_ranks) {
      return PeerError{name + ": EP rank " + std::to_string(rank) + " is outside [0, " +
                       std::to_string(num_ranks) + ")"};
    }
    std::vector<int64_t> key{-num_ranks};  // no table: one group of num_ranks ranks
    if (groups.size > 0) {
      int found = 0;
      const std::string error = find_group(groups, num_ranks, rank, &key, &found);
      if (!error.empty()) return PeerError{name + ": " + error};
    }
    Group* group = registry().group(key, num_ranks);
    if (group == nullptr) {
      return PeerError{name + ": the exchange between devices needs jax_ep.initialize() first "
                              "(on CPU it sets up host buffers standing in for NVSHMEM's)"};
    }
    return claim(group, rank, op);
  }
  // Runs the exchange as rank `rank` of `group`, the rank's one exchange at a time.
  PeerError claim(Group* group, int rank, int op) {
    const std::string name = kPeerOpNames[op];
    group_ = group;
    me_ = rank;
    op_ = op;
    RankState& state = group_->rank(me_);
    if (state.busy.exchange(true, std::memory_order_acquire)) {
      group_ = nullptr;  // the running exchange keeps the rank
      return PeerError{name + ": rank " + std::to_string(rank) + " of this EP group is already "
                       "running another exchange. The exchanges of a program run one at a "
                       "time, in one order on every rank (jax_ep orders them with a token); "
                       "two at once would share the rank's buffer and flags"};
    }
    if (state.status.failed.load(std::memory_order_acquire)) {
      return PeerError{name + ": " + state.status.error};
    }
    return PeerError{};
  }
  Group* group() const { return group_; }
  // Ends the exchange open() began: the rank may run the next one.
  void close() {
    if (group_ != nullptr) group_->rank(me_).busy.store(false, std::memory_order_release);
  }

  Peers peers() const {
    const int node = jax_ep::ranks_per_node(*this, group_->num_ranks());
    if (node == 0) return Peers{group_->regions(), me_};
    return Peers{group_->regions(), me_, me_ / node * node, (me_ / node + 1) * node};
  }
  bool puts() const { return group_->puts(); }
  int ranks_per_node() const { return group_->ranks_per_node(); }
  PutPeers put_peers() const { return PutPeers{group_->regions(), me_, group_->bytes()}; }
  int rank() const { return me_; }
  char* symmetric() const { return group_->regions()[me_]; }
  size_t bytes() const { return group_->bytes(); }
  size_t low_latency_offset() const { return group_->low_latency_offset(); }
  // One launch of this rank, meeting the peers as `meet` says (cuda/peer_ops.h) through the
  // flags of the GPU's Meet (cuda/peer_exchange.cu), run by the units of host_per_warp.
  template <typename Phase, typename Tail = NoTail>
  void per_warp(const Phase& phase, int64_t items, const Meet& meet, const Tail& tail = {}) {
    if (recording_ != nullptr) {
      recording_->add([=](HostPlatform& p) { p.per_warp(phase, items, meet, tail); });
      return;
    }
    if (!error_.ok()) return;
    for (int i = 0; i < meet.waits(); ++i) meter_barrier();
    host_per_warp(phase, me_, 1, items, grid_, tail, Flags{this, meet});
  }
  // A streaming launch of this rank (cuda/channels.h), meeting the peers as per_warp does.
  template <typename Body>
  void per_unit(const Body& body, const Meet& meet) {
    if (recording_ != nullptr) {
      recording_->add([=](HostPlatform& p) { p.per_unit(body, meet); });
      return;
    }
    if (!error_.ok()) return;
    if (body.units() > kMaxHostUnits) {  // every rank refuses the same launch
      stop("a streaming launch of " + std::to_string(body.units()) + " warps at once, more "
           "than the " + std::to_string(kMaxHostUnits) + " threads the host peers give one "
           "launch (channels x warps per channel)", "; initialize with fewer channels "
           "(Channels.channels, $JAX_EP_CHANNELS) or give the op a smaller num_sms");
      return;
    }
    for (int i = 0; i < meet.waits(); ++i) meter_barrier();
    host_per_unit(body, me_, 1, body.units(), grid_, Flags{this, meet});
  }
  // Warps per role per channel of a streaming launch, unless the rings name theirs: the grid's
  // warps (several on a GPU-shaped grid, so that the split of a channel's rings runs too).
  int channel_warps(bool /*combine*/) const { return grid_.warps; }
  PeerError result(int /*op*/) const { return error_; }

 private:
  // The Meet of one launch, for host_per_warp (cuda/host_launch.h).
  struct Flags {
    HostPlatform* p;
    Meet meet;
    bool waits_first() const { return meet.before.has_value(); }
    bool has_last() const { return meet.arrive || meet.after; }
    void first() const {
      const RankState& own = p->group_->rank(p->me_);
      if (meet.opens_send && own.regions.in_flight[meet.region][meet.flight_kind] != 0) {
        p->refuse_send(meet.region);
      }
      if (!meet.before || p->rank_failed()) return;
      p->wait_for_peers(*meet.before,
                        meet.region_wait ? own.regions.last_use[meet.region] : own.epoch);
    }
    void done() const {}  // a host put is complete when it returns
    // This call's failure, or the rank's from an earlier call (its status word, which the
    // GPU's launches read too): the launches after it do nothing.
    bool failed() const { return p->failed_.load(std::memory_order_acquire) || p->rank_failed(); }
    void last() const {
      if (meet.arrive) p->arrive(meet);
      if (meet.after) p->wait_for_peers(*meet.after, p->group_->rank(p->me_).epoch);
    }
    // What a streaming body's waits need (cuda/dispatch_stream.h, Watch).
    uint64_t now() const {
      return static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
              .count());
    }
    uint64_t limit() const { return p->group_->timeouts().in_op_ns; }
    // Between the idle polls of a ring wait: a peer that failed stops the wait at once.
    void pause() const {
      p->check_peers();
      std::this_thread::yield();
    }
    void give_up(RingWaitKind kind, int peer, int channel, uint64_t have, uint64_t want) const {
      p->give_up(ring_timed_out(kind, peer, channel, have, want, p->group_->timeouts()));
    }
  };

  // Whether this rank failed, in this call or an earlier one (its status word).
  bool rank_failed() const {
    return group_->rank(me_).status.failed.load(std::memory_order_acquire);
  }

  // Records the first failure of this rank's op, `why` (what this call reports; `earlier`,
  // what the rank's later calls report after "an earlier call of "), in the rank's status
  // word, and tells every peer through its arrival signal (kRankFailed): their waits on this
  // rank give up at once instead of waiting out a timeout.
  void fail(const std::string& why, const std::string& earlier) {
    std::lock_guard<std::mutex> lock(failure_);
    if (!failed_.load(std::memory_order_relaxed)) {
      error_ = PeerError{why};
      failed_.store(true, std::memory_order_release);
    }
    poison(earlier);
  }
  // Records `earlier` as the rank's failure unless it has one (the first stays), and sets
  // its signal at every peer to its arrivals so far with kRankFailed, where it stays (arrive).
  // Under failure_; no launch of the rank arrives meanwhile (a launch arrives after all its
  // units are done).
  void poison(const std::string& earlier) {
    RankState& own = group_->rank(me_);
    if (own.status.failed.load(std::memory_order_relaxed)) return;
    own.status.error = "an earlier call of " + earlier;
    own.status.failed.store(true, std::memory_order_release);
    for (int p = 0; p < group_->num_ranks(); ++p) {
      group_->signal(p, me_).store(own.epoch | kRankFailed, std::memory_order_release);
    }
  }
  // fail() for a wait of this op that stopped (`why`), `fix` told to the later calls.
  void stop(const std::string& why, const char* fix = "") {
    const std::string name = kPeerOpNames[op_];
    fail(name + ": " + why, name + " on this rank " + why + fix);
  }
  // A peer's arrival signal carries kRankFailed: this rank stops too.
  void fail_by_peer(int peer) { stop(peer_failed(peer)); }
  // fail_by_peer for the first peer whose arrival signal carries kRankFailed, if any.
  void check_peers() {
    for (int p = 0; p < group_->num_ranks(); ++p) {
      if (p != me_ && (group_->signal(me_, p).load(std::memory_order_acquire) & kRankFailed)) {
        fail_by_peer(p);
        return;
      }
    }
  }
  // A wait that gave up: `why` says how (a timeout).
  void give_up(const std::string& why) {
    stop(why, "; the EP group is unusable, call jax_ep.finalize() and jax_ep.initialize() again");
  }

  // A send on a region in flight, refused as on a GPU (Meet::opens_send): the rank's status
  // word records it (this call returns; the rank's next call reports it), and its signals
  // carry kRankFailed, so that every peer's next wait on this rank gives up too.
  void refuse_send(int region) {
    std::lock_guard<std::mutex> lock(failure_);
    poison(in_flight_error(op_, region) + "; the EP group is unusable, call jax_ep.finalize() "
           "and jax_ep.initialize() again");
  }

  // Tells every peer that this rank finished one more launch (after its writes), and records
  // the arrival of a low-latency op in its region's record. Once the rank failed, its
  // signals keep the count and the bit poison() set: its later launches did nothing.
  void arrive(const Meet& meet) {
    RankState& own = group_->rank(me_);
    const uint64_t arrivals = own.epoch + 1;
    if (meet.region >= 0 &&
        !record_arrival(&own.regions, meet.region, meet.flight, meet.flight_kind, arrivals)) {
      refuse_send(meet.region);
    }
    own.epoch = arrivals;
    if (rank_failed()) return;
    for (int p = 0; p < group_->num_ranks(); ++p) {
      group_->signal(p, me_).store(arrivals, std::memory_order_release);
    }
  }

  // Until every peer arrived `target` times, bounded by the timeout of `wait`. Called by
  // several units of a launch at once: the first to give up records why.
  void wait_for_peers(Wait wait, uint64_t target) {
    const uint64_t timeout_ns = group_->timeouts().of(wait);
    const Clock::time_point start = Clock::now();
    for (int p = 0; p < group_->num_ranks(); ++p) {
      const Signal& arrived = group_->signal(me_, p);
      for (int spin = 0;; ++spin) {
        const uint64_t seen = arrived.load(std::memory_order_acquire);
        // Arrivals from before a peer failed count; a peer that failed first never comes.
        if ((seen & ~kRankFailed) >= target) break;
        if ((seen & kRankFailed) != 0 && p != me_) {
          fail_by_peer(p);
          return;
        }
        if (failed_.load(std::memory_order_acquire) || rank_failed()) return;
        if (spin < 64) {
          std::this_thread::yield();
          continue;
        }
        const auto waited =
            std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start);
        if (static_cast<uint64_t>(waited.count()) > timeout_ns) {
          give_up(timed_out(p, wait, group_->timeouts()));
          return;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }

  HostGrid grid_;
  Recording* recording_;
  Group* group_ = nullptr;
  int me_ = 0;
  int op_ = 0;
  PeerError error_;
  std::mutex failure_;
  std::atomic<bool> failed_{false};
};

}  // namespace

std::string initialize(size_t bytes_per_rank, size_t low_latency_bytes, bool puts,
                       int ranks_per_node) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  if (reg.bytes != 0) return "host peers are already initialized";
  const std::string layout = check_layout(bytes_per_rank, low_latency_bytes);
  if (!layout.empty()) return layout;
  reg.timeouts = timeouts_from_env();
  reg.generation.fetch_add(1, std::memory_order_relaxed);
  reg.bytes = bytes_per_rank;
  reg.low_latency_offset = low_latency_offset(bytes_per_rank, low_latency_bytes);
  reg.puts = puts;
  reg.ranks_per_node = ranks_per_node;
  return "";
}

void finalize() {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  reg.clear();
  reg.bytes = 0;
}

size_t buffer_bytes() {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  return reg.bytes;
}

template <typename Args>
PeerError run(int op, const Args& args, int rank, const HostGrid& grid,
              const GroupTable& groups) {
  HostPlatform platform(grid);
  PeerError error = platform.open(op, args.num_ranks, rank, groups);
  if (error.ok()) error = run_op(platform, op, args);
  platform.close();
  return error;
}

template <typename Args>
PeerError record(int op, const Args& args, int rank, const HostGrid& grid,
                 const GroupTable& groups, std::shared_ptr<const Recording>* out) {
  auto recording = std::make_shared<Recording>();
  HostPlatform platform(grid, recording.get());
  PeerError error = platform.open(op, args.num_ranks, rank, groups);
  if (error.ok()) error = run_op(platform, op, args);
  if (error.ok()) recording->bind(platform.group(), rank, op, grid);
  platform.close();
  if (error.ok()) *out = std::move(recording);
  return error;
}

PeerError Recording::replay() const {
  if (!current()) {
    return PeerError{std::string(kPeerOpNames[op_]) + ": this call was recorded before "
                     "jax_ep.finalize(); record it again"};
  }
  HostPlatform platform(grid_);
  PeerError error = platform.claim(group_, rank_, op_);
  if (error.ok()) {
    for (const auto& launch : launches_) launch(platform);
    error = platform.result(op_);
  }
  platform.close();
  return error;
}

PeerError replay(const Recording& recording) { return recording.replay(); }
bool current(const Recording& recording) { return recording.current(); }

#define JAX_EP_INSTANTIATE(Args)                                                          \
  template PeerError run<Args>(int, const Args&, int, const HostGrid&, const GroupTable&); \
  template PeerError record<Args>(int, const Args&, int, const HostGrid&, const GroupTable&, \
                                  std::shared_ptr<const Recording>*);
JAX_EP_FOR_EACH_OP_ARGS(JAX_EP_INSTANTIATE)
#undef JAX_EP_INSTANTIATE

}  // namespace jax_ep::host
