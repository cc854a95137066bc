// The exchange between ranks that each hold one rank (V = 1), written once for every peer
// platform: the GPUs through NVSHMEM (cuda/peer_exchange.cu) and the CPU devices of one
// process through host memory (cuda/host_peers.cc). The phases are the bodies of
// cuda/exchange.h; this file adds what the ranks must agree on: the carving of the symmetric
// buffer, and the order of the launches and how each meets the peers (Meet; the finish phases
// copy what XLA owns out of the symmetric buffer).
//
// Symmetric buffer: the same size and layout on every rank, and each rank's buffer reachable
// by the others through the platform's Peers view. Layout, fixed by jax_ep.initialize():
//   [0, 4 KiB)                        signals (one uint64 per peer: its arrivals, Meet)
//   [4 KiB, low_latency_offset)       normal-mode regions (dispatch, combine)
//   [low_latency_offset, bytes)       low-latency regions, two halves (`buffer` 0 and 1)
// so that no normal-mode call, however large, reaches a split low-latency dispatch or combine
// in flight, and two low-latency exchanges on different halves can be in flight at once. The
// carve_* functions below are the one description of the regions: the ops carve with them,
// and buffer_region_bytes sizes a configuration with them (jax_ep.runtime.buffer_regions).
//
// A Platform P provides:
//   using Peers; Peers peers() const;        the view that turns a symmetric address into a
//                                             peer's copy of it (a store view, cuda/exchange.h)
//   static constexpr bool kPutPeers;          whether it also has a put view; if so:
//     bool puts() const;                      whether this group reaches its peers by puts
//     PutPeers put_peers() const;             the put view
//     int ranks_per_node() const;             with puts, the ranks of a node (consecutive),
//                                             which peers() reaches; 0: one node
//   int rank() const;                         this rank
//   char* symmetric() const; size_t bytes() const;   this rank's symmetric buffer
//   size_t low_latency_offset() const;        where its low-latency regions start
//   void per_warp(phase, items, meet[, tail])   one launch for this rank
//                                             (cuda/phases.cuh), meeting the peers as `meet` says
//   PeerError result(int op);                 the first failure of the launches, if any
// Launches after a failure do nothing, so the ops below read as straight sequences.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include "cuda/combine_stream.h"
#include "cuda/dispatch_rows.h"
#include "cuda/dispatch_stream.h"
#include "cuda/phase_functors.h"

namespace jax_ep {

struct PeerError {
  std::string message;
  bool ok() const { return message.empty(); }
};

constexpr size_t kSignalBytes = 4096;
constexpr int kMaxPeers = static_cast<int>(kSignalBytes / sizeof(uint64_t));
constexpr size_t kAlign = 256;

enum PeerOp { kPeerDispatch, kPeerCombine, kPeerLlDispatchSend, kPeerLlDispatchRecv,
              kPeerLlCombineSend, kPeerLlCombineRecv, kPeerDispatchRows };
inline const char* const kPeerOpNames[] = {
    "jax_ep_dispatch", "jax_ep_combine", "jax_ep_ll_dispatch_send",
    "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv",
    "jax_ep_dispatch_rows"};

// X(Args) for each argument struct the ops take (explicit instantiations of the entry points).
#define JAX_EP_FOR_EACH_OP_ARGS(X)                                                         \
  X(DispatchArgs) X(CombineArgs<float>) X(CombineArgs<Bf16>) X(CombineArgs<F16>) X(LowLatencyArgs) \
  X(LowLatencyCombineArgs) X(RowsArgs)

// What a wait waits for, and so how long it may wait. A wait for the peers' earlier ops, or
// for their first launch of this op, may wait for peers that have not started it yet (a
// process still compiling, or busy with other work): bounded by the start timeout,
// $JAX_EP_START_TIMEOUT_S (default 600 s). A later wait of the op waits for peers that all
// started it: bounded by the op timeout, $JAX_EP_TIMEOUT_S (default 60 s). So a slow start
// never poisons the group, and a peer that stops inside an op is still found within the op
// timeout.
enum class Wait { kStart, kInOp };

// How a launch meets the peers: a barrier split in two and fused into the launches. A launch
// that arrives tells every peer, once all its blocks are done, that this rank finished one
// more such launch; its writes, to peers too, are visible to them from then on. A wait lasts
// until every peer has arrived as often as this rank: at the start of a launch (`before`, in
// every block before its items: the peers' earlier launches are done), or after the launch's
// own arrival (`after`, in the block that finishes last, before the tail: every peer's part of
// this launch is done). Every rank runs the same ops, so the counts agree.
//
// A low-latency op names its region (`region`, RegionRecord). Its `before` wait may wait for
// less (`region_wait`): until every peer arrived as often as this rank had when the region's
// last op arrived (the peers are done with the region, not necessarily with an op on the
// other one). Its arriving launch records the region's last use and, by `flight`, whether an
// exchange of `flight_kind` is now in flight on it. The first launch of a send
// (`opens_send`) refuses it, before it writes anything, when the region still holds an
// exchange of its kind that was not received: a failure of the rank (status 5), which every
// rank of a group running the same program finds by itself.
//
// Everything a launch meets with is fixed when the op is issued (attributes and buffer
// addresses): what changes from call to call (the arrival counts, the regions' records) lives
// where the launches run and only they change it, so a recorded launch replayed (a CUDA
// graph) meets the peers as a freshly issued one does.
constexpr int8_t kFlightSend = 1, kFlightReceive = -1;
constexpr int kFlightDispatch = 0, kFlightCombine = 1;

struct Meet {
  std::optional<Wait> before;
  bool arrive = false;
  std::optional<Wait> after;
  int region = -1;  // the low-latency region of the op (0 or 1); -1: none
  bool region_wait = false;
  int8_t flight = 0;  // kFlightSend, kFlightReceive or 0 (nothing in flight changes)
  int flight_kind = kFlightDispatch;
  bool opens_send = false;  // the first launch of a send on `region` (refused when busy)
  int waits() const { return before.has_value() + after.has_value(); }
};

// What a rank's launches keep about its low-latency regions, where they run (device memory
// on a GPU): for each region, this rank's arrivals when its last op arrived, and whether a
// dispatch or a combine was sent on it and not yet received (its data still in the region).
// Reset by a new jax_ep.initialize().
struct RegionRecord {
  uint64_t last_use[2];
  uint32_t in_flight[2][2];  // [region][kFlightDispatch or kFlightCombine]
};

// The arrival (the `arrivals`-th) of a launch of a low-latency op on `region`: records the
// region's last use and what is in flight on it. False when the op sends on a region that
// still holds an exchange of its kind (its first launch refused it already, Meet::opens_send).
JAX_EP_HOST_DEVICE bool record_arrival(RegionRecord* record, int region, int8_t flight,
                                       int kind, uint64_t arrivals) {
  record->last_use[region] = arrivals;
  uint32_t& busy = record->in_flight[region][kind];
  const bool refused = flight == kFlightSend && busy != 0;
  if (flight != 0) busy = flight == kFlightSend && !refused;
  return !refused;
}

// A rank that fails (a wait gave up, a send refused: the GPU's status word, the host peers'
// RankStatus) sets its signal at every peer to its arrivals so far with this bit, and leaves
// it so: its later launches do nothing and arrive no more. A peer's wait satisfied by the
// arrivals from before the failure goes on (those launches did their work); one that needs a
// later arrival stops at once (peer_failed) instead of waiting out a timeout. So a failure
// anywhere reaches the whole group within a poll, and no rank goes on with rows that a failed
// peer never sent.
constexpr uint64_t kRankFailed = uint64_t{1} << 63;

// Why a wait of this rank stopped when peer `peer`'s signal carried kRankFailed.
inline std::string peer_failed(int peer) {
  return "stopped because EP peer " + std::to_string(peer) + " failed in an earlier exchange "
         "(its own error names the cause); the EP group is unusable, call jax_ep.finalize() "
         "and jax_ep.initialize() again (on GPUs, restart the processes if a peer timed out)";
}

struct Timeouts {
  uint64_t start_ns = 600ull * 1000 * 1000 * 1000;
  uint64_t in_op_ns = 60ull * 1000 * 1000 * 1000;
  uint64_t of(Wait wait) const { return wait == Wait::kStart ? start_ns : in_op_ns; }
};

// The timeouts of the environment, in positive seconds (jax_ep.initialize() refuses other values
// before this reads them; unset: the defaults).
inline Timeouts timeouts_from_env() {
  Timeouts t;
  auto read = [](const char* name, uint64_t* ns) {
    const char* text = std::getenv(name);
    const double seconds = text ? std::atof(text) : 0.0;
    if (seconds > 0) *ns = static_cast<uint64_t>(seconds * 1e9);
  };
  read("JAX_EP_START_TIMEOUT_S", &t.start_ns);
  read("JAX_EP_TIMEOUT_S", &t.in_op_ns);
  return t;
}

// "60 s", "0.2 s".
inline std::string seconds_text(uint64_t ns) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g s", static_cast<double>(ns) / 1e9);
  return text;
}

// "timed out after 60 s waiting for peer 3 inside it ($JAX_EP_TIMEOUT_S)".
inline std::string timed_out(int peer, Wait wait, const Timeouts& timeouts) {
  return "timed out after " + seconds_text(timeouts.of(wait)) + " waiting for peer " +
         std::to_string(peer) +
         (wait == Wait::kStart ? " to start it ($JAX_EP_START_TIMEOUT_S)"
                               : " inside it ($JAX_EP_TIMEOUT_S)") +
         " (did every rank run the same ops?)";
}

// "timed out after 60 s on channel 1 waiting for peer 3 to drain its ring (...)": a ring
// wait of a streaming launch (cuda/channels.h) that gave up; `have` and `want` are the
// counters: the ring's head and the slots sent (kSpace), or the slots consumed and the
// ring's tail (kData).
inline std::string ring_timed_out(RingWaitKind kind, int peer, int channel, uint64_t have,
                                  uint64_t want, const Timeouts& timeouts) {
  const std::string where = "timed out after " + seconds_text(timeouts.in_op_ns) +
                            " on channel " + std::to_string(channel) + " waiting for peer " +
                            std::to_string(peer);
  if (kind == RingWaitKind::kSpace) {
    return where + " to drain its ring (it consumed " + std::to_string(have) + " of the " +
           std::to_string(want) + " slots sent; $JAX_EP_TIMEOUT_S; did every rank run the "
           "same ops?)";
  }
  const bool closed = (want & kRingClosed) != 0;
  return where + " to fill its ring (" + std::to_string(have) + " slots consumed, tail " +
         std::to_string(want & ~kRingClosed) + (closed ? ", closed" : ", not closed") +
         "; $JAX_EP_TIMEOUT_S; did every rank run the same ops?)";
}

// The error of every call after a barrier of `timed_out_op` gave up waiting for `peer`.
inline PeerError after_timeout(int op, int timed_out_op, int peer, Wait wait,
                               const Timeouts& timeouts, const char* restart) {
  return PeerError{std::string(kPeerOpNames[op]) + ": an earlier call of " +
                   kPeerOpNames[timed_out_op] + " on this rank " +
                   timed_out(peer, wait, timeouts) + "; the EP group is unusable, " + restart};
}

inline size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Where the low-latency regions start in a buffer of `bytes` whose last `low_latency_bytes`
// hold them.
inline size_t low_latency_offset(size_t bytes, size_t low_latency_bytes) {
  return (bytes - low_latency_bytes) / kAlign * kAlign;
}

// Why a buffer of `bytes` cannot be laid out with `low_latency_bytes` of low-latency regions,
// or empty when it can.
inline std::string check_layout(size_t bytes, size_t low_latency_bytes) {
  if (low_latency_bytes <= bytes && low_latency_offset(bytes, low_latency_bytes) >= kSignalBytes) {
    return "";
  }
  return "a buffer of " + std::to_string(bytes) + " bytes cannot hold " +
         std::to_string(kSignalBytes) + " bytes of barrier signals and " +
         std::to_string(low_latency_bytes) + " bytes of low-latency regions";
}

// Sizes from user settings saturate at kTooLarge instead of wrapping: a configuration too
// large for any buffer sizes as too large (jax_ep.runtime refuses it by name), never as a
// small wrapped one. 2^60 bytes is past any machine's memory, and a few of them still add up
// within an int64.
constexpr int64_t kTooLarge = int64_t{1} << 60;

// The product of `factors` (each >= 0), or kTooLarge where it would pass kTooLarge.
inline int64_t size_product(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (const int64_t n : factors) {
    if (n < 0 || __builtin_mul_overflow(out, n, &out) || out > kTooLarge) return kTooLarge;
  }
  return out;
}

// Consecutive, aligned pieces of a region. A null base sizes the pieces without a buffer; a
// piece of kTooLarge bytes or more makes used() kTooLarge (fits() then refuses the carving).
class Carver {
 public:
  explicit Carver(char* base) : base_(reinterpret_cast<uintptr_t>(base)) {}
  template <typename T>
  T* take(int64_t count) {
    used_ = align_up(used_);
    T* out = reinterpret_cast<T*>(base_ + used_);
    used_ = std::min<size_t>(used_ + size_product({count, sizeof(T)}), kTooLarge);
    return out;
  }
  size_t used() const { return align_up(used_); }

 private:
  uintptr_t base_;
  size_t used_ = 0;
};

// A call's sizes in jax_ep.runtime.BufferConfig's fields, which the message of a call that
// does not fit names: a BufferConfig at least this large reserves what the call uses.
struct CallSizes {
  int num_ranks, num_tokens, top_k, num_experts;
  int64_t capacity;  // 0: none to name (the low-latency ops)
  bool expert_major, low_latency;
  int64_t row_bytes;  // hidden x dtype_bytes (low latency: the hidden size's bf16 row)

  std::string fields() const {
    auto field = [](const char* name, int64_t value) {
      return std::string(name) + "=" + std::to_string(value) + ", ";
    };
    std::string s = field("num_ranks", num_ranks) +
                    field(low_latency ? "low_latency_tokens" : "num_tokens", num_tokens);
    if (top_k > 0) s += field("top_k", top_k);
    if (num_experts > 0) s += field("num_experts", num_experts);
    if (capacity > 0) s += field("capacity", capacity);
    if (expert_major) s += "expert_major=True, ";
    return s + "hidden x dtype_bytes >= " + std::to_string(row_bytes);
  }
};

// An error unless `used` bytes of the named region fit in the `reserved` ones; it names the
// sizes of the call (`call`) a configuration must hold.
inline PeerError fits(int op, const char* region, size_t used, size_t reserved,
                      const CallSizes& call) {
  if (used <= reserved) return PeerError{};
  return PeerError{std::string(kPeerOpNames[op]) + ": needs " + std::to_string(used) +
                   " bytes of " + region + " region in the symmetric buffer, but "
                   "jax_ep.initialize() reserved " + std::to_string(reserved) +
                   "; initialize with a jax_ep.runtime.BufferConfig at least this call's "
                   "sizes (" + call.fields() + ")"};
}

// The rings of an op (g's shape set): the counters, this rank's own state, the receive rings
// and, over puts, the send rings.
inline void carve_rings(Carver& c, bool puts, Rings* g) {
  const int64_t rings = static_cast<int64_t>(g->channels) * g->links;
  g->tail = c.take<uint64_t>(rings);
  g->head = c.take<uint64_t>(rings);
  g->state = c.take<int64_t>(Rings::kStateWords * rings);
  const int64_t ring_bytes = size_product({rings, g->ring_slots(), g->slot_bytes});
  g->recv = c.take<char>(ring_bytes);
  g->send = c.take<char>(puts ? ring_bytes : 0);
}

// Dispatch: what peers write into this rank. Streamed (a->rings.channels > 0, rank-major):
// the counts and the rings (node-aware: the node rings over the node's stores, and the relay
// rings). In phases: the counts, the received rows and metadata
// (not src_row, which the finish finds and writes into XLA's result) and,
// over puts, the send area the puts read from (this rank's rows and scales); node-aware
// (a->ranks_per_node set), the relay's slots and this rank's staged targets too.
inline size_t carve_dispatch(char* base, bool puts, DispatchArgs* a) {
  const int R = a->num_ranks, cap = a->capacity, K = a->top_k, rows = a->rows();
  const bool em = a->expert_major;
  Carver c(base);
  // Channels (cuda/channels.h, cuda/dispatch_stream.h): rank-major, the counts and rings only.
  Rings& g = a->rings;
  if (em) g.channels = 0;  // not streamed yet
  if (g.channels > 0) {
    const bool aware = a->nodes() > 1;
    a->packed = false;
    g.links = node_links(*a);
    g.slot_bytes = a->ring_slot();
    a->relays = g;
    a->relays.links = relay_links(*a);
    a->relays.slot_bytes = a->relay_slot();
    a->counts = c.take<int32_t>(static_cast<int64_t>(R) * a->num_counters());
    carve_rings(c, puts && !aware, &g);
    if (aware) carve_rings(c, true, &a->relays);
    return c.used();
  }
  // Over puts, rank-major rows travel in packed slots (row, scales and metadata together).
  a->packed = puts && !em;
  const int64_t stride = a->row_stride(), S = a->packed ? 0 : a->scale_cols;
  const int cols = a->packed ? 0 : a->idx_cols();
  a->counts = c.take<int32_t>(static_cast<int64_t>(R) * a->num_counters());
  a->recv_x = c.take<char>(size_product({cap, stride}));
  a->recv_scales = c.take<float>(cap * S);
  a->recv_idx = c.take<int32_t>(static_cast<int64_t>(cap) * cols);
  a->recv_weights = c.take<float>(static_cast<int64_t>(cap) * cols);
  a->recv_src = c.take<int32_t>(a->packed ? 0 : rows);
  a->entry_row = c.take<int32_t>(em ? cap : 0);
  a->entry_choice = c.take<int32_t>(em ? cap : 0);
  a->row_entries = c.take<int32_t>(em ? static_cast<int64_t>(rows) * K : 0);
  if (puts) {
    a->send_x = c.take<char>(size_product({a->num_tokens, stride}));
    a->send_scales = c.take<float>(a->num_tokens * S);
  }
  if (puts && a->nodes() > 1) {  // node-aware: the relay's slots and the staged targets
    const int64_t slots = static_cast<int64_t>(R) * a->num_tokens, pairs = 2 * a->targets();
    a->relay_x = c.take<char>(size_product({slots, stride}));
    a->relay_scales = c.take<float>(size_product({slots, S}));
    a->relay_targets = c.take<int32_t>(size_product({slots, pairs}));
    a->send_targets = c.take<int32_t>(size_product({a->nodes(), a->num_tokens, pairs}));
  }
  return c.used();
}

// Combine: what peers read from this rank (src_row and the rows that carry data: rank-major
// the rows of y with their weights, expert-major the partial sums; over puts, this rank's puts
// read them) and, over puts, what the receivers return.
template <typename T>
struct CombineRegions {
  typename CombineArgs<T>::Staged staged{};
  T* partial = nullptr;
  typename CombineArgs<T>::Returned returned{};
};

// Streamed (a->rings.channels > 0, rank-major: the caller says), the rings only.
template <typename T>
size_t carve_combine(char* base, CombineArgs<T>* a, bool puts, CombineRegions<T>* r) {
  const int64_t H = a->hidden, rows = static_cast<int64_t>(a->num_ranks) * a->num_tokens;
  const bool em = a->expert_major;
  Carver c(base);
  if (a->rings.channels > 0) {
    Rings& g = a->rings;
    g.links = a->num_ranks;
    g.slot_bytes = combine_slot_bytes(*a);
    carve_rings(c, puts, &g);
    return c.used();
  }
  r->staged.y = c.take<T>(em ? 0 : size_product({a->capacity, H}));
  r->staged.weights = c.take<float>(!em && a->weights ? a->capacity : 0);
  r->staged.src_row = c.take<int32_t>(rows);
  r->partial = c.take<T>(em ? size_product({rows, H}) : 0);
  if (puts) {
    r->returned.row = c.take<int32_t>(rows);
    r->returned.weights = c.take<float>(!em && a->weights ? rows : 0);
    r->returned.rows = c.take<T>(size_product({rows, H}));
  }
  return c.used();
}

// Low-latency dispatch and combine (both halves of each reach them).
// With puts, also the send areas the puts read from (a put's source must lie in the symmetric
// buffer): each token's row and scales (dispatch), the rows returned to each source (combine).
struct LowLatencyRegions {
  int32_t* counts;
  char* recv_x;
  float* recv_scales;
  int32_t* src_row;
  Bf16* staging;
  char* send_x = nullptr;
  float* send_scales = nullptr;
  Bf16* send_rows = nullptr;
};

inline size_t carve_low_latency(char* base, int R, int T, int K, int E, int H, int wire,
                                bool puts, LowLatencyRegions* r) {
  const int64_t slots = static_cast<int64_t>(E / R) * R * T;
  const int64_t row_bytes = wire_data_bytes(wire, H), words = wire_scale_words(wire, H);
  Carver c(base);
  r->counts = c.take<int32_t>(static_cast<int64_t>(R) * E);
  r->recv_x = c.take<char>(size_product({slots, row_bytes}));
  r->recv_scales = c.take<float>(size_product({slots, words}));
  r->src_row = c.take<int32_t>(size_product({R, T, K}));
  r->staging = c.take<Bf16>(size_product({T, K, H}));
  if (puts) {
    r->send_x = c.take<char>(size_product({T, row_bytes}));
    r->send_scales = c.take<float>(size_product({T, words}));
    r->send_rows = c.take<Bf16>(size_product({R, T, K, H}));
  }
  return c.used();
}

// Ranks per node of a group of num_ranks split into nodes of n (0: unsplit): n where the split
// applies (over puts, more than one node), else 0 (one node).
inline int node_split(bool puts, int n, int num_ranks) {
  return puts && n > 0 && n < num_ranks ? n : 0;
}

// The regions a configuration needs: its largest normal-mode call (dispatch with FP8 scales
// and combine with weights, rank-major and, with expert_major, expert-major; capacity 0 is
// the ops' default; with rings, the dispatch streamed where it streams) and its low-latency
// calls (FP8 or not) with ll_tokens tokens, over puts
// (with their send areas; node-aware with ranks_per_node, 0: one node) or not.
struct RegionBytes {
  size_t signals, normal, low_latency;
  size_t dispatch = 0, combine = 0;  // the largest of each op, which `normal` holds
};

inline RegionBytes buffer_region_bytes(int R, int T, int K, int E, int H, int dtype_bytes,
                                       int64_t capacity, bool expert_major, int ll_tokens,
                                       bool puts, int ranks_per_node = 0,
                                       const Rings& rings = {}) {
  // The ops count rows, entries and slots in int: a configuration past that cannot run.
  constexpr int64_t kMaxCount = std::numeric_limits<int>::max();
  if (size_product({R, T, K}) > kMaxCount || capacity > kMaxCount ||
      size_product({E, ll_tokens}) > kMaxCount || size_product({R, ll_tokens, K}) > kMaxCount) {
    const size_t too = kTooLarge;
    return RegionBytes{kSignalBytes, too, ll_tokens > 0 ? too : 0, too, too};
  }
  size_t dispatch = 0, combine = 0;
  for (const bool em : {false, true}) {
    if (em && !expert_major) continue;
    const int64_t full = em ? static_cast<int64_t>(R) * T * std::min(K, E / R)
                            : static_cast<int64_t>(R) * T;
    DispatchArgs d{};
    d.num_ranks = R, d.num_tokens = T, d.top_k = K, d.num_experts = E;
    d.capacity = static_cast<int>(capacity > 0 ? capacity : full);
    d.expert_major = em;
    d.row_bytes = static_cast<int64_t>(H) * dtype_bytes;
    d.scale_cols = H / kFp8Block;
    d.ranks_per_node = node_split(puts, ranks_per_node, R);
    d.rings = rings;
    CombineArgs<char> c{};
    c.num_ranks = R, c.num_tokens = T, c.top_k = K;
    c.hidden = H * dtype_bytes;  // rows of dtype_bytes-wide elements, counted in bytes
    c.capacity = d.capacity;
    c.expert_major = em;
    c.weights = reinterpret_cast<const float*>(kAlign);  // any non-null: with weights
    if (!em) c.rings = rings;
    CombineRegions<char> regions;
    dispatch = std::max(dispatch, carve_dispatch(nullptr, puts, &d));
    combine = std::max(combine, carve_combine(nullptr, &c, puts, &regions));
  }
  size_t low_latency = 0;
  if (ll_tokens > 0) {
    LowLatencyRegions r;
    for (int wire = 0; wire < kNumWires; ++wire) {
      low_latency =
          std::max(low_latency, carve_low_latency(nullptr, R, ll_tokens, K, E, H, wire, puts, &r));
    }
  }
  return RegionBytes{kSignalBytes, std::max(dispatch, combine), 2 * low_latency,  // two halves
                     dispatch, combine};
}

// Whether the platform reaches its peers by puts.
template <typename Platform>
bool uses_puts(const Platform& p) {
  if constexpr (Platform::kPutPeers) {
    return p.puts();
  } else {
    return false;
  }
}

// Node-aware: ranks per node when the platform reaches its peers by puts and splits them into
// nodes (its store view reaches the ranks of this rank's node), else 0 (one node).
template <typename Platform>
int ranks_per_node(const Platform& p, int num_ranks) {
  if constexpr (Platform::kPutPeers) {
    return node_split(p.puts(), p.ranks_per_node(), num_ranks);
  } else {
    return 0;
  }
}

// Warps per role per channel of a streaming launch (cuda/channels.h): the rings' own, or the
// platform's default for the op.
template <typename Platform>
int stream_warps(const Platform& p, const Rings& g, bool combine) {
  return g.warps > 0 ? g.warps : p.channel_warps(combine);
}

// f(peers) with the view the platform reaches its peers with.
template <typename Platform, typename F>
PeerError with_peers(Platform& p, const F& f) {
  if constexpr (Platform::kPutPeers) {
    if (p.puts()) return f(p.put_peers());
  }
  return f(p.peers());
}

// run_op(platform, op, args): op `op` (PeerOp) for the platform's rank, one overload per
// argument struct.

template <typename Platform>
PeerError run_op(Platform& p, int op, const DispatchArgs& out) {
  DispatchArgs a = out;
  a.first_rank = p.rank();
  a.out = out.results();  // the finish phase copies them out of the symmetric buffer
  a.ranks_per_node = ranks_per_node(p, a.num_ranks);
  const size_t used = carve_dispatch(p.symmetric() + kSignalBytes, uses_puts(p), &a);
  PeerError error = fits(op, "normal-mode", used, p.low_latency_offset() - kSignalBytes,
                         {a.num_ranks, a.num_tokens, a.top_k, a.num_experts, a.capacity,
                          a.expert_major, false, a.row_bytes});
  if (!error.ok()) return error;
  return with_peers(p, [&](const auto& peers) {
    using Peers = std::decay_t<decltype(peers)>;
    if (a.rings.channels > 0) {
      // Streamed: the count (its tail also zeroes this rank's ring counters before the peers
      // may write them), then senders, node-aware forwarders, and receivers at once,
      // receivers writing XLA's results (node-aware, the node's rings over its store view,
      // the relays' over puts; its arrival completes its puts and signals, heads included,
      // before the peers' next op zeroes their counters); the finish completes the results
      // from this rank's own arrays, and its arrival frees this rank's buffer.
      p.per_warp(DispatchCount{a}, a.num_chunks, Meet{Wait::kStart, true, Wait::kStart},
                 DispatchTail<Peers>{a, a.first_rank, 1, peers});
      const int senders = dispatch_channel_warps(a, stream_warps(p, a.rings, false));
      const int receivers = senders;
      // kCast: the senders cast to a.wire, every format in one kernel (not one per format:
      // this is the longest kernel to compile).
      const auto stream = [&](auto cast) {
        if (a.nodes() == 1) {
          p.per_unit(
              DispatchStream<Peers, Peers, cast.value>{a, peers, peers, senders, receivers},
              Meet{{}, true, {}});
        } else if constexpr (Peers::kPuts) {  // node-aware: the node's stores, puts to relays
          using NodePeers = typename Platform::Peers;
          p.per_unit(DispatchStream<NodePeers, Peers, cast.value>{a, p.peers(), peers, senders,
                                                                  receivers},
                     Meet{{}, true, {}});
        }
      };
      with_bool(a.wire != kWireBf16, stream);
      with_bool(a.dequantize, [&](auto dequantize) {
        p.per_warp(DispatchFinish<OwnArrays, dequantize.value>{landed(a), {}}, a.finish_items(),
                   Meet{{}, true, {}});
      });
      return p.result(op);
    }
    // The count's tail publishes the totals into the peers' buffers (the count starts once
    // the peers are done with the last op's data) and, once every rank's are here, computes
    // this rank's bases. Over puts, the rows go into the send area (cast there, with a wire
    // format), and the metadata to the receivers, before the send.
    p.per_warp(DispatchCount{a}, a.num_chunks, Meet{Wait::kStart, true, Wait::kStart},
               DispatchTail<Peers>{a, a.first_rank, 1, peers});
    if constexpr (Peers::kPuts) {
      with_wire(a.wire, [&](auto wire) {
        p.per_warp(DispatchStage<Peers, wire.value>{a, peers}, a.num_tokens, Meet{});
      });
      p.per_warp(DispatchSend<Peers>{a, peers}, a.num_tokens, Meet{{}, true, {}});
    } else {
      with_wire(a.wire, [&](auto wire) {
        p.per_warp(DispatchSend<Peers, wire.value>{a, peers}, a.num_tokens, Meet{{}, true, {}});
      });
    }
    if (a.nodes() > 1) {
      // Node-aware: once every token has reached its relays, they store them into the
      // receivers of their nodes.
      p.per_warp(DispatchRelay<typename Platform::Peers>{a, p.peers()},
                 int64_t{a.num_ranks} * a.num_tokens, Meet{Wait::kInOp, true, {}});
    }
    // The finish, once every row has arrived; its arrival frees this rank's buffer.
    with_bool(a.dequantize, [&](auto dequantize) {
      p.per_warp(DispatchFinish<Peers, dequantize.value>{a, peers}, a.finish_items(),
                 Meet{Wait::kInOp, true, {}});
    });
    return p.result(op);
  });
}

// Combine. With a store view, the stage writes this rank's buffer once the peers are done
// reading the last op's data, and the sums read the peers' buffers once every rank's rows are
// in place. Over puts, the stage only waits (it writes what this rank's puts read), the
// receivers return the rows (expert-major, the partial sums) to the homes' buffers, and the
// sums read this rank's own.
template <typename Platform, typename T>
PeerError run_op(Platform& p, int op, const CombineArgs<T>& in) {
  CombineArgs<T> a = in;
  a.first_rank = p.rank();
  const int64_t rows = static_cast<int64_t>(a.num_ranks) * a.num_tokens;
  const bool em = a.expert_major, puts = uses_puts(p);
  if (em) a.rings.channels = 0;  // not streamed yet
  CombineRegions<T> r;
  const size_t used = carve_combine(p.symmetric() + kSignalBytes, &a, puts, &r);
  PeerError error = fits(op, "normal-mode", used, p.low_latency_offset() - kSignalBytes,
                         {a.num_ranks, a.num_tokens, a.top_k, 0, a.capacity, em, false,
                          int64_t{a.hidden} * int64_t{sizeof(T)}});
  if (!error.ok()) return error;
  // kCast: the stages cast the rows they stage to a.wire, the sums dequantize them.
  return with_cast<T>(a.wire, [&](auto cast) {
    constexpr bool kCast = decltype(cast)::value;
    if (a.rings.channels > 0) {
      // Streamed: the ring counters zeroed once the peers are done with the last op (and
      // before they write them), then senders and receivers at once; its arrival frees the
      // buffer.
      return with_peers(p, [&](const auto& peers) {
        using Peers = std::decay_t<decltype(peers)>;
        const RingsZero zero{a.rings};
        p.per_warp(zero, zero.items(), Meet{Wait::kStart, true, Wait::kStart});
        const int senders = role_warps(stream_warps(p, a.rings, true), a.num_ranks);
        p.per_unit(CombineStream<T, Peers, kCast>{a, peers, senders}, Meet{{}, true, {}});
        return p.result(op);
      });
    }
    // Cast, the weights go into the cast: none are staged.
    a.staged = {r.staged.y, a.weights && !kCast ? r.staged.weights : nullptr, r.staged.src_row};
    a.partial = em ? r.partial : nullptr;
    a.returned = r.returned;
    const Meet stage_meet{Wait::kStart, !puts, {}};
    if (em) {
      p.per_warp(CombinePartial<T, kCast>{a}, rows, stage_meet);  // local y, entries, weights
    } else {
      p.per_warp(CombineStage<T, kCast>{a}, rows, stage_meet);
      a.y = a.staged.y;
      a.weights = a.staged.weights;
    }
    a.src_row = a.staged.src_row;
    return with_peers(p, [&](const auto& peers) {
      using Peers = std::decay_t<decltype(peers)>;
      if constexpr (Peers::kPuts) {
        p.per_warp(CombineReturn<T, Peers>{a, peers}, rows, Meet{{}, true, {}});
      }
      p.per_warp(CombineToken<T, Peers, kCast>{a, peers}, a.num_tokens,
                 Meet{Peers::kPuts ? Wait::kInOp : Wait::kStart, true, {}});
      return p.result(op);
    });
  });
}

// Rows along a dispatch's routing (cuda/dispatch_rows.h): each rank stages its rows in the
// normal-mode region (once the peers are done with their last op there), then every receiver
// pulls its rows from the sources' stages (once every stage is written) and arrives, which
// tells the sources their stages are free. Loads only: refused over puts.
inline void carve_stage(Carver& c, RowsArgs* a) {
  a->stage = c.take<char>(int64_t{a->num_tokens} * a->row_bytes);
}

// Whether the stage of T rows of `row_bytes` fits the normal-mode region of a buffer of
// `bytes` whose last `low_latency_bytes` hold the low-latency regions: run_op's own check,
// asked by the host before it chooses this op (jax_ep/_exchange_ffi.py, rows_by_loads).
inline bool rows_stage_fits(size_t bytes, size_t low_latency_bytes, int num_tokens,
                            int64_t row_bytes) {
  RowsArgs a{};
  a.num_tokens = num_tokens;
  a.row_bytes = row_bytes;
  Carver c(nullptr);
  carve_stage(c, &a);
  return c.used() <= low_latency_offset(bytes, low_latency_bytes) - kSignalBytes;
}

template <typename Platform>
PeerError run_op(Platform& p, int op, const RowsArgs& in) {
  if (uses_puts(p)) {
    return PeerError{std::string(kPeerOpNames[op]) + ": reads its peers with loads, which "
                     "peers reached by puts do not offer (a bug in jax_ep: it dispatches again "
                     "there)"};
  }
  RowsArgs a = in;
  a.first_rank = p.rank();
  Carver c(p.symmetric() + kSignalBytes);
  carve_stage(c, &a);
  PeerError error = fits(op, "normal-mode", c.used(), p.low_latency_offset() - kSignalBytes,
                         {a.num_ranks, a.num_tokens, 0, 0, a.capacity, a.expert_major, false,
                          a.row_bytes});
  if (!error.ok()) return error;
  p.per_warp(RowsStage{a}, a.num_tokens, Meet{Wait::kStart, true, {}});
  p.per_warp(RowsPull<typename Platform::Peers>{a, p.peers()}, a.capacity,
             Meet{Wait::kInOp, true, {}});
  return p.result(op);
}

// The low-latency regions of one call in half `buffer` of the low-latency part, or why they
// do not fit.
template <typename Platform>
PeerError open_ll(Platform& p, int op, int R, int T, int K, int E, int H, int wire, int buffer,
                  LowLatencyRegions* r) {
  const size_t half = (p.bytes() - p.low_latency_offset()) / 2 / kAlign * kAlign;
  char* base = p.symmetric() + p.low_latency_offset() + buffer * half;
  const size_t used = carve_low_latency(base, R, T, K, E, H, wire, uses_puts(p), r);
  return fits(op, "low-latency", used, half, {R, T, K, E, 0, false, true, int64_t{H} * 2});
}

// The error of a send on a region whose last exchange of the same kind was not received
// (record_arrival): it overwrote that exchange's data before its receive read them.
inline std::string in_flight_error(int op, int buffer) {
  const char* receive = op == kPeerLlDispatchSend ? "low_latency_dispatch_recv"
                                                  : "low_latency_combine_recv";
  return std::string(kPeerOpNames[op]) + ": low-latency buffer " + std::to_string(buffer) +
         " still holds an exchange that was sent and not yet received; call " + receive +
         " on it before sending another on buffer " + std::to_string(buffer) +
         ", or send this one on buffer " + std::to_string(1 - buffer) +
         " (two exchanges in flight need both buffers)";
}

// Both halves of low-latency dispatch: the send counts, then writes each message into its
// per-source slot on the expert's rank (once the peers are done with the last call that used
// the same low-latency region, so a send need not wait for a call on the other one); over
// puts, each token's row goes into the send area first (LowLatencyStage). The receive (after
// every message arrived) copies the counted rows out to their compact slots and writes the
// counts.
template <typename Platform>
PeerError run_op(Platform& p, int op, const LowLatencyArgs& out) {
  LowLatencyRegions r;
  PeerError error = open_ll(p, op, out.num_ranks, out.num_tokens, out.top_k, out.num_experts,
                            out.hidden, out.wire, out.buffer, &r);
  if (!error.ok()) return error;
  LowLatencyArgs a = out;
  a.first_rank = p.rank();
  a.per_source_slots = true;
  a.counts = r.counts;
  a.recv_x = r.recv_x;
  a.recv_scales = r.recv_scales;
  a.src_row = r.src_row;
  a.send_x = r.send_x;
  a.send_scales = r.send_scales;
  if (op != kPeerLlDispatchSend) {
    // The finish copies the counted rows and src_row out of the symmetric buffer.
    a.out_x = out.recv_x;
    a.out_scales = out.recv_scales;
    a.out_src_row = out.src_row;
  }
  // What first publishes to the peers waits for them to be done with the last op on the
  // region; the op's last launch arrives, recording the send or the receive.
  const Meet first{Wait::kStart, false, {}, a.buffer, true, 0, kFlightDispatch, true};
  Meet last{Wait::kStart, true, {}, a.buffer, true, kFlightSend, kFlightDispatch};
  return with_peers(p, [&](const auto& peers) {
    using Peers = std::decay_t<decltype(peers)>;
    if (op == kPeerLlDispatchSend) {
      // The count numbers this rank's messages (or, at small sizes, the send does); the send
      // needs no other rank's counts.
      const bool counted = !a.counts_in_send();
      if (counted) {
        p.per_warp(LowLatencyCount{a}, a.num_chunks, first,
                   LowLatencyTotals<Peers>{a, a.first_rank, 1, peers});
        last.before.reset();
      } else {
        last.opens_send = true;
      }
      if constexpr (Peers::kPuts) {
        with_ll_stage(a, [&](const auto& stage) { p.per_warp(stage, stage.items(), Meet{}); });
      }
      with_ll_send(a, peers, [&](const auto& send) {
        p.per_warp(send, send.items(), last, LowLatencySendTail<Peers>{a, peers});
      });
    } else {
      // Once every message has arrived (the peers sent it in their send).
      last.region_wait = false;
      last.flight = kFlightReceive;
      p.per_warp(LowLatencyFinish<Peers>{a, peers}, ll_finish_items(a), last);
    }
    return p.result(op);
  });
}

// Both halves of low-latency combine: the send pushes rows into the homes' staging slots
// (once the homes are done with the last call that used the region; over puts, from the send
// area, LowLatencyCombineStage), the receive sums them (after they all arrived).
template <typename Platform>
PeerError run_op(Platform& p, int op, const LowLatencyCombineArgs& in) {
  LowLatencyRegions r;
  PeerError error = open_ll(p, op, in.num_ranks, in.num_tokens, in.top_k, in.num_experts,
                            in.hidden, kWireBf16, in.buffer, &r);
  if (!error.ok()) return error;
  LowLatencyCombineArgs a = in;
  a.first_rank = p.rank();
  a.staging = r.staging;
  a.send_rows = r.send_rows;
  const bool send = op == kPeerLlCombineSend;
  return with_peers(p, [&](const auto& peers) {
    using Peers = std::decay_t<decltype(peers)>;
    const int64_t sources = int64_t{a.num_ranks} * a.num_tokens;
    if (send) {
      if constexpr (Peers::kPuts) p.per_warp(LowLatencyCombineStage{a}, sources, Meet{});
      p.per_warp(LowLatencyCombineSend<Peers>{a, peers}, sources,
                 Meet{Wait::kStart, true, {}, a.buffer, true, kFlightSend, kFlightCombine, true});
    } else {
      const LowLatencyCombineToken sums{a};
      p.per_warp(sums, sums.items(),
                 Meet{Wait::kStart, true, {}, a.buffer, false, kFlightReceive, kFlightCombine});
    }
    return p.result(op);
  });
}

}  // namespace jax_ep
