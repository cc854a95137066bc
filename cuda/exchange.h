// Bodies of the dispatch and combine kernels, written once for host and device.
//
// Each op is a short sequence of *phases*; a phase is a function of (rank, item) with no
// dependency between items, so any grid can run it, and the next phase starts only after the
// previous one finished on every rank (a kernel boundary on one GPU, a loop on the CPU). The
// CUDA kernels (cuda/exchange.cu) run the items in parallel, the CPU handlers
// (ffi/exchange_cpu.cc) in a loop, so CI checks the exact kernel logic bit for bit against the
// NumPy reference without a GPU. Items move rows with `copy_row(dst, src, bytes, lane, lanes)`:
// a warp on the GPU (32 lanes); on the CPU one lane, or 32 emulated ones (cuda/host_launch.h).
//
// Peers. Every buffer that one rank writes for another is reached through a `Peers` view of
// one of two kinds. A store view (kPuts false) hands out pointers: `peers.at(base, stride,
// rank)` is rank's copy of the buffer; with virtual ranks (all R ranks of the group inside one
// call, inputs and outputs stacked [R, ...]) that is base + rank * stride. A put view (kPuts
// true: peers reached over the network, NVSHMEM's puts) hands out no pointer to a peer: it
// copies from this rank's symmetric buffer into a peer's copy of a buffer (`put`, `put_value`),
// and a phase reads only this rank's own copy (`own`). The bodies write a value to a peer
// through store_to, a row with a put or stores as the view's kind says, and read received
// data through own_copy. Normal combine, which reads the peers' copies with a store view, has
// the receivers return the rows with a put view (combine_return). Every write has exactly one
// writer and every output element that the contract defines is written once, so no buffer
// needs clearing and results do not depend on scheduling. Rows past a count carry no data
// and are not written (docs/contract.md, "Padding").
//
// Ordering rules (docs/contract.md): rank-major rows are ordered by source rank, then token;
// expert-major entries by local expert, then rank-major row, then choice; low-latency slots of
// an expert by source rank, then token. Positions come from counts that every rank publishes
// in a first phase (`counts`, [R][R + E]: tokens of source s for each destination rank, then
// valid choices of s for each expert) and from per-token offsets computed in the same phase.
#pragma once

#include <cstdint>

#include "cuda/channels.h"
#include "cuda/meter.h"
#include "cuda/numerics.h"
#include "cuda/routing.h"
#include "cuda/wire.h"

namespace jax_ep {

// Virtual ranks: rank r's copy of a stacked buffer.
struct VirtualPeers {
  static constexpr bool kPuts = false;
  template <typename T>
  JAX_EP_HOST_DEVICE T* at(T* base, int64_t stride, int rank) const {
    return base + stride * rank;
  }
};

// Rank's copy of the array at `base`, written element by element: through the copy's address,
// found once, with a store view; with put_value with a put view.
template <typename Peers, typename T>
struct PeerArray {
  const Peers& peers;
  T* base;  // the copy's address (store view), or this rank's address of the array (puts)
  int rank;
  JAX_EP_HOST_DEVICE void set(int64_t i, T value) const {
    if constexpr (Peers::kPuts) {
      peers.put_value(base + i, rank, value);
    } else {
      base[i] = value;
    }
  }
};

template <typename Peers, typename T>
JAX_EP_HOST_DEVICE PeerArray<Peers, T> peer_array(const Peers& peers, T* base, int64_t stride,
                                                  int rank) {
  if constexpr (Peers::kPuts) {
    return {peers, base, rank};
  } else {
    return {peers, peers.at(base, stride, rank), rank};
  }
}

// Writes `value` to element i of rank's copy of the buffer at `base`.
template <typename Peers, typename T>
JAX_EP_HOST_DEVICE void store_to(const Peers& peers, T* base, int64_t stride, int rank, int64_t i,
                                 T value) {
  peer_array(peers, base, stride, rank).set(i, value);
}

// Rank's copy of the buffer at `base`, where rank is the one whose phase reads it (the
// receiver: this rank between devices).
template <typename Peers, typename T>
JAX_EP_HOST_DEVICE T* own_copy(const Peers& peers, T* base, int64_t stride, int rank) {
  if constexpr (Peers::kPuts) {
    return peers.own(base, rank);
  } else {
    return peers.at(base, stride, rank);
  }
}

// The unit of the row copies: 16 bytes, one vector load or store per lane.
struct alignas(16) Word {
  uint32_t v[4];
};

// Words each lane loads before it stores any: the loads of a copy that are in flight at once.
constexpr int kWordsInFlight = 4;

// Warps per block of the phase kernels (cuda/phases.cuh): the number of shared fan tables.
constexpr int kBlockWarps = 8;

// Calls f(i, u) for the indices i of the words [first, first + lanes * kWordsInFlight) of a
// copy that lane `lane` moves (those below `words`), u = 0, 1, ... in each lane's order.
template <typename F>
JAX_EP_HOST_DEVICE void each_word(int first, int words, int lane, int lanes, const F& f) {
  JAX_EP_UNROLL for (int u = 0; u < kWordsInFlight; ++u) {
    const int i = first + u * lanes + lane;
    if (i < words) f(i, u);
  }
}

// Copies `bytes` from src to dst with `lanes` cooperating lanes: 16-byte words when both
// pointers and the size allow, each lane loading kWordsInFlight of them before storing any,
// else single bytes.
JAX_EP_HOST_DEVICE void copy_row(void* dst, const void* src, int64_t bytes, int lane, int lanes) {
  if (lane == 0) meter_rows(bytes, bytes);
  const bool aligned = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         static_cast<uintptr_t>(bytes)) &
                        15u) == 0;
  if (aligned) {
    Word* d = static_cast<Word*>(dst);
    const Word* s = static_cast<const Word*>(src);
    const int words = static_cast<int>(bytes / 16);  // a row holds fewer than 2^31 words
    for (int first = 0; first < words; first += lanes * kWordsInFlight) {
      Word w[kWordsInFlight];
      each_word(first, words, lane, lanes, [&](int i, int u) { w[u] = s[i]; });
      each_word(first, words, lane, lanes, [&](int i, int u) { d[i] = w[u]; });
    }
  } else {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    for (int64_t i = lane; i < bytes; i += lanes) d[i] = s[i];
  }
}

// The OR of the first n addresses of `ptrs` (their common alignment), reading them with
// indices known at compile time (Terms keeps its rows in registers on the GPU).
template <typename P, int N>
JAX_EP_HOST_DEVICE uintptr_t address_bits(P* const (&ptrs)[N], int n) {
  uintptr_t bits = 0;
  JAX_EP_UNROLL for (int j = 0; j < N; ++j) {
    if (j < n) bits |= reinterpret_cast<uintptr_t>(ptrs[j]);
  }
  return bits;
}

// Makes the warp's writes to its fan tables visible to all its lanes, and orders its reads
// before later writes (nothing to do on the CPU, where each lane has its own fans).
JAX_EP_HOST_DEVICE void fan_sync() {
#if defined(__CUDA_ARCH__)
  __syncwarp();
#endif
}

// Where one source row goes: up to kFanOut destinations, written from one read of the row
// (fan_out_row). On the GPU the destinations sit in a table of the warp in shared memory
// (`table` 0 or 1: two fans can be filled at once), written by lane 0 and read by every lane
// after fan_sync, so that a copy holds only its data in registers, not 8 addresses; on the
// CPU each lane's Fan holds them.
constexpr int kFanOut = 8;
template <typename T>
class Fan {
 public:
  JAX_EP_HOST_DEVICE explicit Fan(int table) {
#if defined(__CUDA_ARCH__)
    __shared__ void* tables[kBlockWarps][2][kFanOut];
    to_ = reinterpret_cast<T**>(tables[threadIdx.x / 32][table]);
#else
    (void)table;
#endif
  }
  JAX_EP_HOST_DEVICE int size() const { return n_; }
  JAX_EP_HOST_DEVICE bool full() const { return n_ == kFanOut; }
  JAX_EP_HOST_DEVICE void add(T* p) {
#if defined(__CUDA_ARCH__)
    if (threadIdx.x % 32 == 0) to_[n_] = p;
#else
    to_[n_] = p;
#endif
    ++n_;
  }
  // Destination j < size(), after fan_sync.
  JAX_EP_HOST_DEVICE T* operator[](int j) const { return to_[j]; }
  // The OR of the destinations' addresses, after fan_sync.
  JAX_EP_HOST_DEVICE uintptr_t address_bits() const {
    uintptr_t bits = 0;
    for (int j = 0; j < n_; ++j) bits |= reinterpret_cast<uintptr_t>(to_[j]);
    return bits;
  }
  JAX_EP_HOST_DEVICE void clear() { n_ = 0; }

 private:
#if defined(__CUDA_ARCH__)
  T** to_;
#else
  T* to_[kFanOut];
#endif
  int n_ = 0;
};

// Copies `bytes` from src to every destination of the fan, reading src once, and empties the
// fan. Like copy_row: 16-byte words when every pointer and the size allow (kWordsInFlight
// loads per lane, then their stores to each destination), else bytes. Every lane of the warp
// calls it with the same fan.
JAX_EP_HOST_DEVICE void fan_out_row(Fan<char>& fan, const void* src, int64_t bytes, int lane,
                                    int lanes) {
  const int n = fan.size();
  if (n == 0) return;
  fan_sync();
  if (lane == 0) meter_rows(bytes, n * bytes);
  const uintptr_t bits =
      reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes) | fan.address_bits();
  if ((bits & 15u) == 0) {
    const Word* s = static_cast<const Word*>(src);
    const int words = static_cast<int>(bytes / 16);  // a row holds fewer than 2^31 words
    for (int first = 0; first < words; first += lanes * kWordsInFlight) {
      Word w[kWordsInFlight];
      each_word(first, words, lane, lanes, [&](int i, int u) { w[u] = s[i]; });
      JAX_EP_NO_UNROLL for (int j = 0; j < n; ++j) {
        Word* d = reinterpret_cast<Word*>(fan[j]);
        each_word(first, words, lane, lanes, [&](int i, int u) { d[i] = w[u]; });
      }
    }
  } else {
    const char* s = static_cast<const char*>(src);
    for (int64_t i = lane; i < bytes; i += lanes) {
      const char c = s[i];
      for (int j = 0; j < n; ++j) fan[j][i] = c;
    }
  }
  fan_sync();  // every lane read the table before it is filled again
  fan.clear();
}

JAX_EP_HOST_DEVICE void zero_row(void* dst, int64_t bytes, int lane, int lanes) {
  if (lane == 0) meter_rows(0, bytes);
  char* d = static_cast<char*>(dst);
  if (((reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes)) & 15u) == 0) {
    Word* w = reinterpret_cast<Word*>(d);
    for (int64_t i = lane; i < bytes / 16; i += lanes) w[i] = Word{{0, 0, 0, 0}};
  } else {
    for (int64_t i = lane; i < bytes; i += lanes) d[i] = 0;
  }
}

// Numbering by counter in one pass: a warp walks a run of entries `lanes` at a time (a round),
// and each lane's entry gets the number of entries of its counter before it in the run (those
// of earlier rounds, then of lower lanes), so every counter's entries are numbered in order
// and counted at once. The counts so far sit in a table of the warp: in shared memory on the
// GPU, where lanes of one counter learn of each other by __match_any_sync and the lowest one
// adds them; on the CPU, where lanes run one after another, each lane keeps its own table and
// adds every lane's entry itself (its counter depends on the entry only): the same counts.
// The table holds counters [lo, lo + kTallyCounters); a walk with more counters repeats per
// window of them.
constexpr int kTallyCounters = 1024;
class Tally {
 public:
  JAX_EP_HOST_DEVICE Tally(int lo, int lane, int lanes) : lo_(lo) {
#if defined(__CUDA_ARCH__)
    __shared__ int32_t tables[kBlockWarps][kTallyCounters];
    run_ = tables[threadIdx.x / 32];
    __syncwarp();  // every lane is done with the table's last use
    for (int i = lane; i < kTallyCounters; i += lanes) run_[i] = 0;
    __syncwarp();
#else
    (void)lane, (void)lanes;
    for (int32_t& n : run_) n = 0;
#endif
  }

  // One round: `mine` is the counter of this lane's entry (-1: none), counter_of(j) that of
  // lane j's (read on the CPU only). Every lane calls it; returns the number of mine's entries
  // before this lane's (meaningless when mine is outside the window) and counts the round.
  template <typename CounterOf>
  JAX_EP_HOST_DEVICE int32_t number(int mine, int lane, int lanes, const CounterOf& counter_of) {
    const int c = slot(mine);
#if defined(__CUDA_ARCH__)
    (void)lanes, (void)counter_of;
    const unsigned same = __match_any_sync(0xffffffffu, c);
    const int before = __popc(same & ((1u << lane) - 1u));
    const int32_t number = c >= 0 ? run_[c] + before : 0;
    __syncwarp();  // every lane read its count before the lowest lane of each counter adds
    if (c >= 0 && before == 0) run_[c] += __popc(same);
    __syncwarp();
    return number;
#else
    int32_t number = c >= 0 ? run_[c] : 0;
    for (int j = 0; j < lanes; ++j) {
      const int theirs = j == lane ? c : slot(counter_of(j));
      if (theirs < 0) continue;
      number += j < lane && theirs == c;
      ++run_[theirs];
    }
    return number;
#endif
  }

  // Whether counter c is in the window.
  JAX_EP_HOST_DEVICE bool holds(int c) const { return slot(c) >= 0; }
  // The entries of counter c (in the window) counted so far.
  JAX_EP_HOST_DEVICE int32_t operator[](int c) const { return run_[c - lo_]; }

 private:
  JAX_EP_HOST_DEVICE int slot(int c) const {
    return c >= lo_ && c < lo_ + kTallyCounters ? c - lo_ : -1;
  }
  int lo_;
#if defined(__CUDA_ARCH__)
  int32_t* run_;
#else
  int32_t run_[kTallyCounters];
#endif
};

// The counts of the ops (dispatch_count, ll_count) go by chunks of a source's routing, one
// item each: 2^count_chunk_shift whole tokens, 257 to 512 entries (at most 16 rounds of a
// warp) unless a token alone has more. A power of two, so that the sends find a token's chunk
// with a shift. The count's tail then turns each counter's per-chunk counts into the counts
// of the chunks before each (scan_chunks): where the numbering of each chunk starts.
constexpr int kCountEntriesLog = 9;
JAX_EP_HOST_DEVICE int count_chunk_shift(int top_k) {
#if defined(__CUDA_ARCH__)
  const int log_k = 32 - __clz(top_k - 1);  // ceil(log2(top_k))
#else
  const int log_k = top_k > 1 ? 32 - __builtin_clz(static_cast<unsigned>(top_k - 1)) : 0;
#endif
  return log_k < kCountEntriesLog ? kCountEntriesLog - log_k : 0;
}
JAX_EP_HOST_DEVICE int count_chunks(int num_tokens, int top_k) {
  const int shift = count_chunk_shift(top_k);
  return (num_tokens + (1 << shift) - 1) >> shift;
}

// Chunk g (2^shift tokens) of a source's routing `raw` (T tokens of K ids, E experts): writes
// its clean routing (invalid ids replaced by -1) and numbers its entries by their counters in
// one pass: kWays counters per entry, counter(i, w) for way w (-1: none) among n counters. Calls
// numbered(i, w, c, number) for each entry i with a counter c (its rank among c's entries of
// the chunk, in order), and writes the chunk's count of each counter to counts.
template <int kWays, typename Counter, typename Numbered>
JAX_EP_HOST_DEVICE void count_chunk(const int32_t* raw, int32_t* clean, int g, int shift, int T,
                                    int K, int E, int n, int32_t* counts, const Counter& counter,
                                    const Numbered& numbered, int lane, int lanes) {
  const int64_t first = (static_cast<int64_t>(g) << shift) * K;
  const int64_t last = first + (int64_t{1} << shift) * K;
  const int64_t end = last < static_cast<int64_t>(T) * K ? last : static_cast<int64_t>(T) * K;
  for (int64_t i = first + lane; i < end; i += lanes) {
    clean[i] = is_choice(raw[i], E) ? raw[i] : -1;
  }
  for (int lo = 0; lo < n; lo += kTallyCounters) {
    Tally tally(lo, lane, lanes);
    for (int64_t base = first; base < end; base += lanes) {  // the same rounds in every lane
      JAX_EP_UNROLL for (int w = 0; w < kWays; ++w) {
        auto counter_of = [&](int j) { return base + j < end ? counter(base + j, w) : -1; };
        const int c = counter_of(lane);
        const int32_t number = tally.number(c, lane, lanes, counter_of);
        if (tally.holds(c)) numbered(base + lane, w, c, number);
      }
    }
    for (int c = lo + lane; c < n && c < lo + kTallyCounters; c += lanes) counts[c] = tally[c];
  }
}

// One counter's counts of `chunks` chunks, `stride` apart (column[g * stride]), replaced by
// the counts of the chunks before each; returns their total. One thread, 8 loads in flight.
JAX_EP_HOST_DEVICE int32_t scan_chunks(int32_t* column, int chunks, int64_t stride) {
  constexpr int kBatch = 8;
  int32_t total = 0;
  for (int g = 0; g < chunks; g += kBatch) {
    int32_t v[kBatch];
    JAX_EP_UNROLL for (int u = 0; u < kBatch; ++u) {
      v[u] = g + u < chunks ? column[(g + u) * stride] : 0;
    }
    JAX_EP_UNROLL for (int u = 0; u < kBatch; ++u) {
      if (g + u < chunks) column[(g + u) * stride] = total;
      total += v[u];
    }
  }
  return total;
}

// The count's tail for counter c of one source, before the launch meets the peers (`table`:
// the source's chunk counts, n counters a chunk, the last one its invalid ids): scan_chunks,
// then the total into `counts` (the source's row of them in this rank's copy, which
// publish_totals sends to the peers) or, for the last counter, *num_invalid.
JAX_EP_HOST_DEVICE void count_total(int32_t* table, int chunks, int n, int c, int32_t* counts,
                                    int32_t* num_invalid) {
  const int32_t total = scan_chunks(table + c, chunks, n);
  if (c == n - 1) {
    *num_invalid = total;
  } else {
    counts[c] = total;
  }
}

// Then a source's row of `n` totals (`counts`, in this rank's copy) into rank d's copy: one
// put with a put view, stores with a store view; nothing where d's copy is this one (this
// rank, or the copy that virtual ranks share).
template <typename Peers>
JAX_EP_HOST_DEVICE void publish_totals(const Peers& peers, int32_t* counts, int n, int d,
                                       int me, int lane, int lanes) {
  if constexpr (Peers::kPuts) {
    if (d != me) peers.put(counts, d, counts, int64_t{n} * 4, lane, lanes);
  } else {
    int32_t* to = peers.at(counts, 0, d);
    if (to == counts) return;
    for (int i = lane; i < n; i += lanes) to[i] = counts[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Normal dispatch

struct DispatchArgs {
  int num_ranks;    // R
  int num_tokens;   // T per rank
  int top_k;        // K
  int num_experts;  // E
  int capacity;     // rows (rank-major) or entries (expert-major) per receiver
  bool expert_major;
  int64_t row_bytes;   // bytes of one token row of x
  int64_t scale_cols;  // float32 scales per row (0 without FP8)

  // Inputs, stacked per source rank: [R, T, ...].
  const char* x;
  const float* scales;
  const int32_t* topk_idx;
  const float* topk_weights;

  // Per-source results and workspace: [R, ...].
  int32_t* clean_idx;     // [R, T, K] routing with invalid ids replaced by -1
  int32_t* num_invalid;   // [R]
  int32_t* counts;        // [R, R + E] (see the header comment); every rank has a copy (Peers)
  // [R, chunks, R + E + 1]: per chunk of a source's tokens (count_chunks), its entries of
  // each counter (those of `counts`, then the invalid ids); after the count, the entries of
  // the chunks before it.
  int32_t* chunk_counts;
  int chunk_shift, num_chunks;  // count_chunk_shift(K), count_chunks(T, K) (set when carved)
  int32_t* token_offset;  // [R, T, R] rank of token t among its chunk's tokens that go to d
  int32_t* entry_offset;  // [R, T, K] rank of entry (t, k) among its chunk's for its expert
  int32_t* row_base;      // [R, R]: first rank-major row of source s on rank d
  int32_t* source_base;   // [R, R]: receiver d's first rank-major row of each source s
  int32_t* entry_base;    // [R, E]: first entry position of source s for expert e (expert-major)
  // Put views: this rank's rows and scales, copied into its symmetric buffer (dispatch_stage)
  // for the send's puts to read, [T, row_bytes] and [T, scale_cols].
  char* send_x = nullptr;
  float* send_scales = nullptr;
  // Put views, rank-major: each row travels with its metadata in one message, its slot
  // (packed_slot): the row, its scales, then its source s*T + t and the token's K ids and K
  // weights as the source holds them (the receiver keeps those of its experts). recv_x holds
  // [capacity] slots and send_x [T] (relay_x [R*T] node-aware); recv_scales, recv_idx,
  // recv_weights, recv_src and send_scales, relay_scales are not used.
  bool packed = false;
  // Node-aware (put views, the ranks split into nodes of ranks_per_node; 0: one node): a
  // token crosses to another node once, to its relay there (relay_of), which stores it into
  // the receivers of its node. The relay's slot s*T + t holds source s's token t: the row, its
  // scales and its targets there, targets() (receiver, row) pairs up to one with receiver -1.
  // send_targets, [nodes, T, targets(), 2], are this rank's, staged for the puts.
  int ranks_per_node = 0;
  char* relay_x = nullptr;           // [R*T, row_bytes]
  float* relay_scales = nullptr;     // [R*T, scale_cols]
  int32_t* relay_targets = nullptr;  // [R*T, targets(), 2]
  int32_t* send_targets = nullptr;
  // Channels (cuda/channels.h, between devices, rank-major): the rows stream through rings
  // of ring slots (ring_slot()), within a node (one node: between every pair of ranks); the
  // receivers write XLA's results. Node-aware, from each source to its relays through the
  // relay rings (relay_slot(): with the token's targets in the relay's node), which the
  // relays forward into the rings of their node (dispatch_stream.h).
  Rings rings;
  Rings relays;

  // Per-receiver results, reached through Peers: [R, ...].
  char* recv_x;               // [R, capacity, row_bytes]
  float* recv_scales;         // [R, capacity, scale_cols]
  int32_t* recv_idx;          // [R, capacity, K] (rank-major) or [R, capacity]
  float* recv_weights;        // same shape as recv_idx
  int32_t* recv_src;          // [R, rows]; rows = capacity (rank-major) or R*T (expert-major)
  int32_t* src_row;           // [R, R*T] (written by the finish, never through Peers)
  int32_t* entry_row;         // [R, capacity] (expert-major)
  int32_t* entry_choice;      // [R, capacity] (expert-major)
  int32_t* row_entries;       // [R, R*T, K] (expert-major)
  int32_t* num_received;      // [R] rows (entries) kept
  int32_t* tokens_per_expert; // [R, E/R]
  int32_t* num_dropped;       // [R]
  int32_t* num_needed;        // [R] rows (entries) needed before the capacity cut

  // XLA's results when the per-receiver arrays above are in the symmetric buffer (between
  // devices: the finish phase copies what the contract defines into them, [1, ...]). All
  // null with virtual ranks, where the arrays above are the results.
  struct Results {
    char* x;
    float* scales;
    int32_t* idx;
    float* weights;
    int32_t *src, *src_row, *entry_row, *entry_choice, *row_entries;
  } out{};
  // The per-receiver arrays above, as Results.
  Results results() const {
    return {recv_x, recv_scales, recv_idx, recv_weights, recv_src, src_row, entry_row,
            entry_choice, row_entries};
  }
  // Rows past the count are unspecified (docs/contract.md, "Padding") unless this is set:
  // then they are zero (the backward of combine delivers cotangents, which must be defined).
  bool zero_padding = false;

  // Rank whose data sits at index 0 of the per-rank arrays that are not reached through Peers
  // (inputs, workspace, summaries): 0 with virtual ranks (all ranks here), this rank's own
  // number between GPUs (one rank here).
  int first_rank = 0;
  JAX_EP_HOST_DEVICE int64_t local(int rank) const { return rank - first_rank; }

  JAX_EP_HOST_DEVICE int experts_per_rank() const { return num_experts / num_ranks; }
  JAX_EP_HOST_DEVICE int num_counters() const { return num_ranks + num_experts; }
  // Source s's counts of the chunks before the chunk of token t (after the count).
  JAX_EP_HOST_DEVICE const int32_t* chunks_before(int s, int t) const {
    return chunk_counts + (local(s) * num_chunks + (t >> chunk_shift)) * (num_counters() + 1);
  }
  // Rank-major rows of a receiver: capped at the capacity unless entries are what is capped.
  JAX_EP_HOST_DEVICE int rows() const {
    return expert_major ? num_ranks * num_tokens : capacity;
  }
  JAX_EP_HOST_DEVICE int idx_cols() const { return expert_major ? 1 : top_k; }
  // Items of the finish phase per receiver: its rows, entries and tokens of the group.
  JAX_EP_HOST_DEVICE int finish_items() const {
    const int tokens = num_ranks * num_tokens, El = experts_per_rank();
    const int most = capacity > tokens ? capacity : tokens;
    return most > El ? most : El;
  }
  JAX_EP_HOST_DEVICE const int32_t* route(int s, int t) const {
    return clean_idx + (local(s) * num_tokens + t) * top_k;
  }
  // Node-aware: nodes of ranks_per_node consecutive ranks (the last one may be smaller).
  JAX_EP_HOST_DEVICE int nodes() const {
    return ranks_per_node > 0 ? (num_ranks + ranks_per_node - 1) / ranks_per_node : 1;
  }
  JAX_EP_HOST_DEVICE int node_of(int rank) const {
    return ranks_per_node > 0 ? rank / ranks_per_node : 0;
  }
  // Ranks of a full node (one node: all), a rank's index in its node, the ranks of node m.
  JAX_EP_HOST_DEVICE int node_ranks() const {
    return ranks_per_node > 0 ? ranks_per_node : num_ranks;
  }
  JAX_EP_HOST_DEVICE int in_node(int rank) const { return rank % node_ranks(); }
  JAX_EP_HOST_DEVICE int node_size(int m) const {
    const int left = num_ranks - m * node_ranks();
    return left < node_ranks() ? left : node_ranks();
  }
  // The rank of node m that relays source s's tokens: the one with s's index in its node
  // (wrapped around a smaller last node).
  JAX_EP_HOST_DEVICE int relay_of(int s, int m) const {
    return m * node_ranks() + in_node(s) % node_size(m);
  }
  // (receiver, row) pairs of a relay slot: at most one per choice, K.
  JAX_EP_HOST_DEVICE int targets() const { return top_k; }
  // Bytes of a packed slot: the row, its scales, its metadata, rounded up to 16.
  JAX_EP_HOST_DEVICE int64_t packed_slot() const {
    return (row_bytes + 4 * (scale_cols + 1 + 2 * int64_t{top_k}) + 15) / 16 * 16;
  }
  // Bytes of a ring slot: the row, its scales, its source, its row on the receiver, the
  // token's K ids and K weights, rounded up to 16 (dispatch_stream.h).
  JAX_EP_HOST_DEVICE int64_t ring_slot() const {
    return (row_bytes + 4 * (scale_cols + 2 + 2 * int64_t{top_k}) + 15) / 16 * 16;
  }
  // Bytes of a relay ring's slot: a ring slot's and the targets() (receiver, row) pairs in
  // the relay's node, rounded up to 16.
  JAX_EP_HOST_DEVICE int64_t relay_slot() const {
    return (row_bytes + 4 * (scale_cols + 2 + 2 * int64_t{top_k} + 2 * targets()) + 15) / 16 * 16;
  }
  // Bytes from one row to the next in the receive, send and relay areas.
  JAX_EP_HOST_DEVICE int64_t row_stride() const { return packed ? packed_slot() : row_bytes; }
};

// The metadata of a packed slot (after its row and scales).
struct PackedMeta {
  int32_t* src;    // s*T + t
  int32_t* ids;    // [K], the source's clean ids
  float* weights;  // [K]
};
// Whether the rows reach this view packed: only a put view receives them so (a store view's
// code then holds no packed path).
template <typename Peers>
JAX_EP_HOST_DEVICE bool arrives_packed(const DispatchArgs& a) {
  return Peers::kPuts && a.packed;
}
JAX_EP_HOST_DEVICE PackedMeta packed_meta(const DispatchArgs& a, char* slot) {
  int32_t* src = reinterpret_cast<int32_t*>(slot + a.row_bytes) + a.scale_cols;
  return {src, src + 1, reinterpret_cast<float*>(src + 1 + a.top_k)};
}
// The metadata of packed slot `row` that arrived at receiver d (this rank between devices).
template <typename Peers>
JAX_EP_HOST_DEVICE PackedMeta received_meta(const DispatchArgs& a, const Peers& peers, int d,
                                            int64_t row) {
  char* slots = own_copy(peers, a.recv_x, a.capacity * a.packed_slot(), d);
  return packed_meta(a, slots + row * a.packed_slot());
}

// The dispatch's workspace, one int32 array: the counts, then the arrays of the V ranks of
// this call that are not reached through Peers (chunk_counts to entry_base). Returns its
// length; with `work`, points a's arrays into it. a's shape fields must be set; sets its
// chunk fields.
inline int64_t carve_dispatch_workspace(DispatchArgs* a, int64_t V, int32_t* work = nullptr) {
  const int64_t R = a->num_ranks, T = a->num_tokens, K = a->top_k, E = a->num_experts;
  a->chunk_shift = count_chunk_shift(a->top_k);
  a->num_chunks = count_chunks(a->num_tokens, a->top_k);
  int32_t** parts[] = {&a->counts,   &a->chunk_counts, &a->token_offset, &a->entry_offset,
                       &a->row_base, &a->source_base,  &a->entry_base};
  const int64_t sizes[] = {R * (R + E), V * a->num_chunks * (R + E + 1), V * T * R, V * T * K,
                           V * R,       V * R,                           V * E};
  int64_t used = 0;
  for (int i = 0; i < 7; ++i) {
    if (work != nullptr) *parts[i] = work + used;
    used += sizes[i];
  }
  return used;
}

// Phase 1, items (s, g): source s's chunk g of tokens (count_chunk). Counters: c < R, the
// chunk's tokens going to rank c, each at its first choice on c (token_offset); c < R + E,
// entries of expert c - R (entry_offset); c == R + E, invalid ids.
JAX_EP_HOST_DEVICE void dispatch_count(const DispatchArgs& a, int s, int g, int lane,
                                       int lanes) {
  const int T = a.num_tokens, K = a.top_k, R = a.num_ranks, E = a.num_experts;
  const int El = a.experts_per_rank(), n = a.num_counters() + 1;
  const int64_t here = a.local(s) * T * K;
  const int32_t* raw = a.topk_idx + here;
  count_chunk<2>(
      raw, a.clean_idx + here, g, a.chunk_shift, T, K, E, n,
      a.chunk_counts + (a.local(s) * a.num_chunks + g) * n,
      [&](int64_t i, int way) {
        const int32_t e = raw[i];
        if (way == 0) return is_choice(e, E) ? R + e : is_invalid(e, E) ? R + E : -1;
        const int k = static_cast<int>(i % K);
        return first_choice_on_rank(raw + (i - k), k, E, El) ? e / El : -1;
      },
      [&](int64_t i, int way, int c, int32_t number) {
        if (way == 1) {
          a.token_offset[(here + i) / K * R + c] = number;
        } else if (c < R + E) {
          a.entry_offset[here + i] = number;
        }
      },
      lane, lanes);
}

// The count phase's tail (run once every source's counts are here), items c in [0, R + E):
// where the sources [first, first + ranks) start writing for counter c. c < R: their first
// rank-major row on rank c and, when c is one of them, where every source starts on c (for
// its finish's src_row). c >= R (expert-major only): their first entry position for expert
// e = c - R on e's rank (entries of lower local experts of that rank first, then those of e
// from lower source ranks).
JAX_EP_HOST_DEVICE void dispatch_bases(const DispatchArgs& a, int first, int ranks, int c) {
  const int R = a.num_ranks, n = a.num_counters();
  if (c >= R && !a.expert_major) return;
  auto count = [&](int q, int counter) { return a.counts[static_cast<int64_t>(q) * n + counter]; };
  int32_t base = 0;
  if (c >= R) {
    const int e = c - R, El = a.experts_per_rank();
    for (int f = e - e % El; f < e; ++f) {
      for (int q = 0; q < R; ++q) base += count(q, R + f);
    }
  }
  const bool receiver_here = c < R && c >= first && c < first + ranks;
  for (int q = 0; q < (receiver_here ? R : first + ranks); ++q) {
    if (receiver_here) a.source_base[a.local(c) * R + q] = base;
    if (q >= first && q < first + ranks) {
      if (c < R) {
        a.row_base[a.local(q) * R + c] = base;
      } else {
        a.entry_base[a.local(q) * a.num_experts + c - R] = base;
      }
    }
    base += count(q, c);
  }
}

// Where token t of source s (`ids`: its routing) lands on receiver d, rank-major: its row
// there (before the capacity cut), or -1.
JAX_EP_HOST_DEVICE int32_t rank_major_row(const DispatchArgs& a, const int32_t* ids, int s,
                                          int t, int d) {
  bool goes = false;
  JAX_EP_NO_UNROLL for (int k = 0; k < a.top_k; ++k) {  // unrolled, it holds more registers
    goes |= choice_rank(ids[k], a.num_experts, a.experts_per_rank()) == d;
  }
  if (!goes) return -1;
  const int64_t here = a.local(s) * a.num_tokens + t;  // the token's index in this rank's inputs
  return a.row_base[a.local(s) * a.num_ranks + d] + a.chunks_before(s, t)[d] +
         a.token_offset[here * a.num_ranks + d];
}

// Expert-major: the position of the token's choice k among its expert's rank's entries (before
// the capacity cut). ids[k] must be a choice.
JAX_EP_HOST_DEVICE int32_t entry_position(const DispatchArgs& a, const int32_t* ids, int s,
                                          int t, int k) {
  const int64_t here = a.local(s) * a.num_tokens + t;
  return a.entry_base[a.local(s) * a.num_experts + ids[k]] +
         a.chunks_before(s, t)[a.num_ranks + ids[k]] + a.entry_offset[here * a.top_k + k];
}

// The candidates of a token's rows: the receivers (rank-major) or its choices (expert-major);
// candidate c's receiver, and the row (entry) it keeps there, or -1 (not sent, or cut by the
// capacity).
JAX_EP_HOST_DEVICE int dispatch_candidates(const DispatchArgs& a) {
  return a.expert_major ? a.top_k : a.num_ranks;
}
JAX_EP_HOST_DEVICE int dispatch_receiver(const DispatchArgs& a, const int32_t* ids, int c) {
  return a.expert_major ? ids[c] / a.experts_per_rank() : c;
}
JAX_EP_HOST_DEVICE int32_t dispatch_row_at(const DispatchArgs& a, const int32_t* ids, int s,
                                           int t, int c, int d) {
  int32_t at = -1;
  if (!a.expert_major) {
    at = rank_major_row(a, ids, s, t, d);
  } else if (ids[c] >= 0) {
    at = entry_position(a, ids, s, t, c);
  }
  return at < a.capacity ? at : -1;
}

// Copies a token's `bytes` at `src` to each row (entry) it keeps on a receiver, at
// base + row * bytes of that receiver's copy (`per_rank` bytes apart with virtual ranks),
// reading src once per kFanOut destinations. The candidates are the receivers (rank-major) or
// the token's choices (expert-major).
// A put view puts src (in this rank's symmetric buffer, dispatch_stage) to each instead.
template <typename Peers>
JAX_EP_HOST_DEVICE void dispatch_fan_out(const DispatchArgs& a, const Peers& peers,
                                         const int32_t* ids, int s, int t, char* base,
                                         const char* src, int64_t bytes, int lane, int lanes) {
  const int cap = a.capacity;
  const int candidates = dispatch_candidates(a);
  auto receiver = [&](int c) { return dispatch_receiver(a, ids, c); };
  auto row_at = [&](int c, int d) { return dispatch_row_at(a, ids, s, t, c, d); };
  if constexpr (Peers::kPuts) {
    // Node-aware: the receivers of this node; a relay serves the others (dispatch_relay).
    const int node = a.node_of(s);
    for (int c = 0; c < candidates; ++c) {
      const int d = receiver(c);
      if (a.node_of(d) != node) continue;
      const int32_t at = row_at(c, d);
      if (at >= 0) peers.put(base + at * bytes, d, src, bytes, lane, lanes);
    }
  } else {
    const int64_t per_rank = cap * bytes;
    Fan<char> fan(0);
    for (int c = 0; c < candidates;) {
      for (; c < candidates && !fan.full(); ++c) {
        const int d = receiver(c);
        const int32_t at = row_at(c, d);
        if (at >= 0) fan.add(peers.at(base, per_rank, d) + at * bytes);
      }
      fan_out_row(fan, src, bytes, lane, lanes);
    }
  }
}

// Phase 2's metadata of token t of source s (`ids` as above, `here` its index in this rank's
// inputs) for receiver d, where it has a row there: the row's source and, rank-major, its ids
// and weights; expert-major, -1 in the row's entries past the token's choices on d. (The
// receiver finds src_row from the sources, dispatch_src_row: no value per token and receiver
// crosses.)
template <typename Peers>
JAX_EP_HOST_DEVICE void dispatch_send_row(const DispatchArgs& a, const Peers& peers,
                                          const int32_t* ids, int64_t here, int s, int t,
                                          int d) {
  const int T = a.num_tokens, K = a.top_k, E = a.num_experts;
  const int El = a.experts_per_rank(), cap = a.capacity, rows = a.rows();
  const int32_t row = rank_major_row(a, ids, s, t, d);
  const int64_t src = static_cast<int64_t>(s) * T + t;
  // Rank-major rows are capped; expert-major rows always exist and their entries are capped.
  const bool has_row = a.expert_major ? row >= 0 : row >= 0 && row < cap;
  if (!has_row) return;
  store_to(peers, a.recv_src, static_cast<int64_t>(rows), d, row, static_cast<int32_t>(src));
  const int64_t first = static_cast<int64_t>(row) * K;  // the row's first of K
  if (a.expert_major) {
    int num_here = 0;
    for (int k = 0; k < K; ++k) num_here += choice_rank(ids[k], E, El) == d;
    const auto row_entries = peer_array(peers, a.row_entries, static_cast<int64_t>(rows) * K, d);
    for (int k = num_here; k < K; ++k) row_entries.set(first + k, -1);
    return;
  }
  const auto idx = peer_array(peers, a.recv_idx, static_cast<int64_t>(cap) * K, d);
  const auto w = peer_array(peers, a.recv_weights, static_cast<int64_t>(cap) * K, d);
  for (int k = 0; k < K; ++k) {
    const int32_t e = local_expert(ids[k], d, El);
    idx.set(first + k, e);
    w.set(first + k, e >= 0 ? a.topk_weights[here * K + k] : 0.0f);
  }
}

// Expert-major, phase 2's metadata of the token's choice k on its expert's rank: the entry's
// expert, weight, row and choice (when the capacity keeps it) and its place among the row's
// entries (sorted by expert, then choice: by position).
template <typename Peers>
JAX_EP_HOST_DEVICE void dispatch_send_entry(const DispatchArgs& a, const Peers& peers,
                                            const int32_t* ids, int64_t here, int s, int t,
                                            int k) {
  const int K = a.top_k, E = a.num_experts, El = a.experts_per_rank(), cap = a.capacity;
  const int32_t e = ids[k];
  if (!is_choice(e, E)) return;
  const int d = e / El;
  const int32_t row = rank_major_row(a, ids, s, t, d);
  const int32_t pos = entry_position(a, ids, s, t, k);
  const bool kept = pos < cap;
  if (kept) {
    store_to(peers, a.recv_idx, static_cast<int64_t>(cap), d, pos, e - d * El);
    store_to(peers, a.recv_weights, static_cast<int64_t>(cap), d, pos,
             a.topk_weights[here * K + k]);
    store_to(peers, a.entry_row, static_cast<int64_t>(cap), d, pos, row);
    store_to(peers, a.entry_choice, static_cast<int64_t>(cap), d, pos, k);
  }
  int rank = 0;
  for (int q = 0; q < K; ++q) {
    const int32_t f = ids[q];
    rank += choice_rank(f, E, El) == d && (f < e || (f == e && q < k));
  }
  store_to(peers, a.row_entries, static_cast<int64_t>(a.rows()) * K, d,
           static_cast<int64_t>(row) * K + rank, kept ? pos : -1);
}

// Phase 2's metadata of token t of source s in every receiver (the lanes share the receivers
// and, expert-major, the choices).
template <typename Peers>
JAX_EP_HOST_DEVICE void dispatch_send_metadata(const DispatchArgs& a, const Peers& peers, int s,
                                               int t, int lane, int lanes) {
  const int R = a.num_ranks;
  const int64_t here = a.local(s) * a.num_tokens + t;  // the token's index in this rank's inputs
  const int32_t* ids = a.route(s, t);
  const int cells = R + (a.expert_major ? a.top_k : 0);
  for (int c = lane; c < cells; c += lanes) {
    if (c < R) {
      dispatch_send_row(a, peers, ids, here, s, t, c);
    } else {
      dispatch_send_entry(a, peers, ids, here, s, t, c - R);
    }
  }
}

// Node-aware, in the send: token t of source s once to its relay in each other node (its
// targets always, the row and scales where it has one there).
template <typename Peers>
JAX_EP_HOST_DEVICE void dispatch_send_relays(const DispatchArgs& a, const Peers& peers, int s,
                                             int t, int lane, int lanes) {
  const int64_t here = a.local(s) * a.num_tokens + t;
  const int64_t slot = static_cast<int64_t>(s) * a.num_tokens + t;
  const int64_t pairs = 2 * a.targets(), S = a.scale_cols;
  for (int m = 0; m < a.nodes(); ++m) {
    if (m == a.node_of(s)) continue;
    const int relay = a.relay_of(s, m);
    const int32_t* targets =
        a.send_targets + (static_cast<int64_t>(m) * a.num_tokens + t) * pairs;
    peers.put(a.relay_targets + slot * pairs, relay, targets, pairs * 4, lane, lanes);
    if (targets[0] < 0) continue;  // no row of the token lives there
    const int64_t stride = a.row_stride();
    peers.put(a.relay_x + slot * stride, relay, a.send_x + here * stride, stride, lane, lanes);
    if (S > 0 && !a.packed) {
      peers.put(a.relay_scales + slot * S, relay, a.send_scales + here * S, S * 4, lane, lanes);
    }
  }
}

// Phase 2, items (s, t): source s writes token t into every receiver: its metadata (over
// puts, dispatch_stage has put it), and its row (and FP8 scales) to each row or entry it
// keeps, read once; node-aware, to the receivers of its node, and once to each other node's
// relay.
template <typename Peers>
JAX_EP_HOST_DEVICE void dispatch_send(const DispatchArgs& a, const Peers& peers, int s, int t,
                                      int lane, int lanes) {
  if constexpr (!Peers::kPuts) dispatch_send_metadata(a, peers, s, t, lane, lanes);
  const int64_t here = a.local(s) * a.num_tokens + t;
  const int32_t* ids = a.route(s, t);
  // A put's source is the copy in the symmetric buffer.
  const char* x = Peers::kPuts ? a.send_x : a.x;
  const float* scales = Peers::kPuts ? a.send_scales : a.scales;
  const bool packed = arrives_packed<Peers>(a);  // the slot: scales and metadata with the row
  const int64_t stride = packed ? a.packed_slot() : a.row_bytes;
  dispatch_fan_out(a, peers, ids, s, t, a.recv_x, x + here * stride, stride, lane, lanes);
  if (a.scale_cols > 0 && !packed) {
    dispatch_fan_out(a, peers, ids, s, t, reinterpret_cast<char*>(a.recv_scales),
                     reinterpret_cast<const char*>(scales + here * a.scale_cols),
                     a.scale_cols * 4, lane, lanes);
  }
  if constexpr (Peers::kPuts) {
    if (a.nodes() > 1) dispatch_send_relays(a, peers, s, t, lane, lanes);
  }
}

// Node-aware, in the stage: token t's targets in each other node (lanes share the nodes), for
// dispatch_send_relays to put.
JAX_EP_HOST_DEVICE void dispatch_stage_targets(const DispatchArgs& a, int s, int t, int lane,
                                               int lanes) {
  const int32_t* ids = a.route(s, t);
  const int P = a.targets();
  for (int m = lane; m < a.nodes(); m += lanes) {
    if (m == a.node_of(s)) continue;
    int32_t* pairs = a.send_targets + (static_cast<int64_t>(m) * a.num_tokens + t) * 2 * P;
    int n = 0;
    for (int c = 0; c < dispatch_candidates(a) && n < P; ++c) {
      const int d = dispatch_receiver(a, ids, c);
      if (a.node_of(d) != m) continue;
      const int32_t at = dispatch_row_at(a, ids, s, t, c, d);
      if (at < 0) continue;
      pairs[2 * n] = d;
      pairs[2 * n + 1] = at;
      ++n;
    }
    for (; n < P; ++n) pairs[2 * n] = pairs[2 * n + 1] = -1;
  }
}

// Node-aware, items (s, t) of the relay (this rank): source s's token t, if this rank relays
// it (s in another node, relay_of), from the slot into each target of this node, read once
// per kFanOut targets; a store view (the receivers are in this rank's node).
template <typename Peers>
JAX_EP_HOST_DEVICE void dispatch_relay(const DispatchArgs& a, const Peers& peers, int me,
                                       int64_t slot, int lane, int lanes) {
  const int s = static_cast<int>(slot / a.num_tokens), node = a.node_of(me);
  if (a.node_of(s) == node || a.relay_of(s, node) != me) return;
  const int P = a.targets();
  const int32_t* pairs = a.relay_targets + slot * 2 * P;
  const int64_t S = a.packed ? 0 : a.scale_cols, stride = a.row_stride();
  Fan<char> rows(0);
  Fan<char> scales(1);
  for (int n = 0; n < P && pairs[2 * n] >= 0;) {
    for (; n < P && pairs[2 * n] >= 0 && !rows.full(); ++n) {
      const int d = pairs[2 * n];
      const int64_t at = pairs[2 * n + 1];
      rows.add(peers.at(a.recv_x, a.capacity * stride, d) + at * stride);
      if (S > 0) {
        scales.add(reinterpret_cast<char*>(peers.at(a.recv_scales, a.capacity * S, d) + at * S));
      }
    }
    fan_out_row(rows, a.relay_x + slot * stride, stride, lane, lanes);
    if (S > 0) fan_out_row(scales, a.relay_scales + slot * S, S * 4, lane, lanes);
  }
}

// Put views, the stage before the send, items (s, t): token t's row and scales, copied into
// this rank's send area, where the send's puts read them (see ll_stage); rank-major, with its
// metadata into the same slot (packed), expert-major, its metadata put into the receivers
// (here, so that the NVSHMEM code of the small puts and that of the rows' puts do not share
// one kernel's registers).
template <typename Peers>
JAX_EP_HOST_DEVICE void dispatch_stage(const DispatchArgs& a, const Peers& peers, int s, int t,
                                       int lane, int lanes) {
  const int64_t here = a.local(s) * a.num_tokens + t, S = a.scale_cols, K = a.top_k;
  char* row = a.send_x + here * a.row_stride();
  copy_row(row, a.x + here * a.row_bytes, a.row_bytes, lane, lanes);
  float* scales = a.packed ? reinterpret_cast<float*>(row + a.row_bytes) : a.send_scales + here * S;
  if (S > 0) copy_row(scales, a.scales + here * S, S * 4, lane, lanes);
  if (a.packed) {
    const PackedMeta meta = packed_meta(a, row);
    const int32_t* ids = a.route(s, t);
    if (lane == 0) *meta.src = static_cast<int32_t>(static_cast<int64_t>(s) * a.num_tokens + t);
    for (int k = lane; k < K; k += lanes) {
      meta.ids[k] = ids[k];
      meta.weights[k] = a.topk_weights[here * K + k];
    }
  } else {
    dispatch_send_metadata(a, peers, s, t, lane, lanes);
  }
  if (a.nodes() > 1) dispatch_stage_targets(a, s, t, lane, lanes);
}

// Totals of receiver d from the published counts: rows (entries) needed.
JAX_EP_HOST_DEVICE int32_t dispatch_needed(const DispatchArgs& a, int d) {
  const int R = a.num_ranks, El = a.experts_per_rank(), n = a.num_counters();
  int32_t needed = 0;
  for (int q = 0; q < R; ++q) {
    if (a.expert_major) {
      for (int j = 0; j < El; ++j) needed += a.counts[static_cast<int64_t>(q) * n + R + d * El + j];
    } else {
      needed += a.counts[static_cast<int64_t>(q) * n + d];
    }
  }
  return needed;
}

// Receiver d's part of a per-receiver array `sent` ([R, n], reached through Peers): where the
// senders wrote, and where the result lands (`out`, XLA's [1, n] between devices; with virtual
// ranks, `sent` itself).
template <typename T>
struct Landing {
  const T* sent;
  T* to;
  bool moves;  // the two differ: what the contract defines must be copied
};
// Values [i*n, (i+1)*n) of l: copied when they move and `counted`, else `pad`.
template <typename T>
JAX_EP_HOST_DEVICE void land(const Landing<T>& l, int64_t i, int64_t n, bool counted, T pad) {
  for (int64_t k = i * n; k < (i + 1) * n; ++k) {
    if (!counted) {
      l.to[k] = pad;
    } else if (l.moves) {
      l.to[k] = l.sent[k];
    }
  }
}
template <typename T, typename Peers>
JAX_EP_HOST_DEVICE Landing<T> landing(const Peers& peers, T* sent, T* out, int64_t n, int d,
                                      int64_t local_d) {
  T* from = own_copy(peers, sent, n, d);
  return out ? Landing<T>{from, out + local_d * n, true} : Landing<T>{from, from, false};
}

// Receiver d's row of token t of source s, or -1: a search of the token among the rows that
// source s wrote into d (kept under the capacity, ordered by token), whose sources are final.
template <typename Peers>
JAX_EP_HOST_DEVICE int32_t dispatch_src_row(const DispatchArgs& a, const Peers& peers, int d,
                                            int s, int t) {
  const int R = a.num_ranks, rows = a.rows();
  const int32_t first = a.source_base[a.local(d) * R + s];
  int32_t end = first + a.counts[static_cast<int64_t>(s) * a.num_counters() + d];
  if (end > rows) end = rows;  // rank-major rows past the capacity were not written
  const int32_t want = s * a.num_tokens + t;
  auto source = [&](int32_t row) {
    if (arrives_packed<Peers>(a)) return *received_meta(a, peers, d, row).src;
    return own_copy(peers, a.recv_src, static_cast<int64_t>(rows), d)[row];
  };
  int32_t lo = first, hi = end;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (source(mid) < want) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < end && source(lo) == want ? lo : -1;
}

// Packed (over puts, rank-major), lane 0 of the finish's items i < capacity: receiver d's
// row i's metadata out of its slot into XLA's results (its source, and the ids and weights of
// d's experts, local; -1 and 0 for the others), -1 and 0 past the count.
template <typename Peers>
JAX_EP_HOST_DEVICE void dispatch_unpack(const DispatchArgs& a, const Peers& peers, int d, int i,
                                        int32_t kept) {
  const int K = a.top_k, El = a.experts_per_rank();
  const int64_t at = a.local(d) * a.capacity + i;
  int32_t* idx = a.out.idx + at * K;
  float* weights = a.out.weights + at * K;
  if (i >= kept) {
    JAX_EP_NO_UNROLL for (int k = 0; k < K; ++k) {
      idx[k] = -1;
      weights[k] = 0.0f;
    }
    a.out.src[at] = -1;
    return;
  }
  const PackedMeta meta = received_meta(a, peers, d, i);
  JAX_EP_NO_UNROLL for (int k = 0; k < K; ++k) {
    idx[k] = local_expert(meta.ids[k], d, El);
    weights[k] = idx[k] >= 0 ? meta.weights[k] : 0.0f;
  }
  a.out.src[at] = *meta.src;
}

// Phase 3, items (d, i) for i in [0, max(capacity, R*T, E/R)): receiver d's row i. Its data,
// ids, weights and sources are final (moved to XLA's results when they arrived in the
// symmetric buffer); rows past the count get -1 ids and zero weights and, with zero_padding,
// zero data; i < E/R writes the per-expert totals and i == 0 the scalar counts.
template <typename Peers>
JAX_EP_HOST_DEVICE void dispatch_finish(const DispatchArgs& a, const Peers& peers, int d, int i,
                                        int lane, int lanes) {
  const int R = a.num_ranks, K = a.top_k, El = a.experts_per_rank(), cap = a.capacity;
  const int rows = a.rows(), cols = a.idx_cols();
  const int64_t S = a.scale_cols, ld = a.local(d);
  const DispatchArgs::Results& o = a.out;
  const int32_t needed = dispatch_needed(a, d);
  const int32_t kept = needed < cap ? needed : cap;
  const bool packed = arrives_packed<Peers>(a);
  if (i < cap) {
    const auto x = landing(peers, a.recv_x, o.x, cap * a.row_bytes, d, ld);
    const auto scales = landing(peers, a.recv_scales, o.scales, cap * S, d, ld);
    if (i < kept && x.moves) {
      // Packed, the row and its scales are in slot i (x.sent: this rank's receive area).
      const char* from = x.sent + i * (packed ? a.packed_slot() : a.row_bytes);
      copy_row(x.to + i * a.row_bytes, from, a.row_bytes, lane, lanes);
      copy_row(scales.to + i * S,
               packed ? reinterpret_cast<const float*>(from + a.row_bytes) : scales.sent + i * S,
               S * 4, lane, lanes);
    }
    if (i >= kept && a.zero_padding) {
      zero_row(x.to + i * a.row_bytes, a.row_bytes, lane, lanes);
      zero_row(scales.to + i * S, S * 4, lane, lanes);
    }
  }
  if (lane != 0) return;
  if (i < cap && packed) dispatch_unpack(a, peers, d, i, kept);
  if (i < cap && !packed) {
    land(landing(peers, a.recv_idx, o.idx, int64_t{cap} * cols, d, ld), i, cols, i < kept, -1);
    land(landing(peers, a.recv_weights, o.weights, int64_t{cap} * cols, d, ld), i, cols,
         i < kept, 0.0f);
    if (a.expert_major) {
      land(landing(peers, a.entry_row, o.entry_row, cap, d, ld), i, 1, i < kept, -1);
      land(landing(peers, a.entry_choice, o.entry_choice, cap, d, ld), i, 1, i < kept, -1);
    }
  }
  // Rank-major rows that a source wrote.
  int32_t num_rows = kept;
  if (a.expert_major) {
    num_rows = 0;
    for (int q = 0; q < R; ++q) {
      num_rows += a.counts[static_cast<int64_t>(q) * a.num_counters() + d];
    }
  }
  if (i < rows && !packed) {
    land(landing(peers, a.recv_src, o.src, rows, d, ld), i, 1, i < num_rows, -1);
    if (a.expert_major) {
      land(landing(peers, a.row_entries, o.row_entries, int64_t{rows} * K, d, ld), i, K,
           i < num_rows, -1);
    }
  }
  if (i < int64_t{R} * a.num_tokens) {
    const int64_t tokens = int64_t{R} * a.num_tokens;
    int32_t* src_row = o.src_row ? o.src_row + ld * tokens : a.src_row + ld * tokens;
    src_row[i] = dispatch_src_row(a, peers, d, static_cast<int>(i / a.num_tokens),
                                  static_cast<int>(i % a.num_tokens));
  }
  if (i < El) {
    int32_t count = 0;
    if (a.expert_major) {  // entries of expert i kept under the capacity
      int32_t base = 0, total = 0;
      for (int q = 0; q < R; ++q) {
        const int32_t* row = a.counts + static_cast<int64_t>(q) * a.num_counters() + R + d * El;
        for (int j = 0; j < i; ++j) base += row[j];
        total += row[i];
      }
      const int32_t room = cap - base;
      count = room <= 0 ? 0 : (room < total ? room : total);
    } else if (kept == needed) {  // every row kept: all choices of expert i
      for (int q = 0; q < R; ++q) {
        count += a.counts[static_cast<int64_t>(q) * a.num_counters() + R + d * El + i];
      }
    } else if (packed) {  // choices of expert i in the kept rows' slots
      for (int64_t r = 0; r < kept; ++r) {
        const int32_t* ids = received_meta(a, peers, d, r).ids;
        for (int k = 0; k < K; ++k) count += local_expert(ids[k], d, El) == i;
      }
    } else {  // choices of expert i in the kept rows
      const int32_t* idx = own_copy(peers, a.recv_idx, static_cast<int64_t>(cap) * K, d);
      for (int64_t r = 0; r < static_cast<int64_t>(kept) * K; ++r) count += idx[r] == i;
    }
    a.tokens_per_expert[a.local(d) * El + i] = count;
  }
  if (i == 0) {
    a.num_received[a.local(d)] = kept;
    a.num_dropped[a.local(d)] = needed - kept;
    a.num_needed[a.local(d)] = needed;
  }
}

// ---------------------------------------------------------------------------------------------
// Ordered sums of rows (the combines)

// Rows of one ordered sum (sum_rows), kSumBatch at a time, with their weights when the sum is
// weighted and, in a grouped sum, their groups. Like Fan, filled and read with compile-time
// indices: registers on the GPU.
constexpr int kSumBatch = 4;
template <typename T>
struct Terms {
  const T* row[kSumBatch];
  float weight[kSumBatch];
  int group[kSumBatch];
  int n = 0;
  JAX_EP_HOST_DEVICE bool full() const { return n == kSumBatch; }
  JAX_EP_HOST_DEVICE void add(const T* r, float w, int g = 0) {
    JAX_EP_UNROLL for (int j = 0; j < kSumBatch; ++j) {
      if (j == n) {
        row[j] = r;
        weight[j] = w;
        group[j] = g;
      }
    }
    ++n;
  }
};

// N values of T moved as one load or store (16 bytes, or one value).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// The running sums of one pack of an ordered sum: the total and, in a grouped sum, the open
// group's partial sum.
template <int N, bool kGrouped>
struct PackSum {
  float total[N] = {};
  float part[N] = {};
  int group = -1;  // the open group's (none yet: closing it adds +0.0, which changes nothing)

  // The open group's sum, rounded to T, joins the total (docs/contract.md: expert-major
  // partial sums are cast to y's type).
  template <typename T>
  JAX_EP_HOST_DEVICE void close() {
    JAX_EP_UNROLL for (int q = 0; q < N; ++q) {
      total[q] = add_rn(total[q], to_float(from_float<T>(part[q])));
      part[q] = 0.0f;
    }
  }
};

// Adds the terms' packs i to the sums, in the terms' order: every load first, then each value
// times its weight (when weighted) and added, each step rounded to float32. Grouped, a term
// of another group than the open one closes it first.
template <typename T, int N, bool kGrouped>
JAX_EP_HOST_DEVICE void add_terms(const Terms<T>& t, int64_t i, bool weighted,
                                  PackSum<N, kGrouped>& sum) {
  Pack<T, N> p[kSumBatch];
  JAX_EP_UNROLL for (int j = 0; j < kSumBatch; ++j) {
    if (j < t.n) p[j] = reinterpret_cast<const Pack<T, N>*>(t.row[j])[i];
  }
  JAX_EP_UNROLL for (int j = 0; j < kSumBatch; ++j) {
    if (j >= t.n) continue;
    if constexpr (kGrouped) {
      if (t.group[j] != sum.group) {
        sum.template close<T>();
        sum.group = t.group[j];
      }
    }
    float* acc = kGrouped ? sum.part : sum.total;
    JAX_EP_UNROLL for (int q = 0; q < N; ++q) {
      const float v = to_float(p[j].v[q]);
      acc[q] = add_rn(acc[q], weighted ? mul_rn(v, t.weight[j]) : v);
    }
  }
}

// sum_rows with packs of N values: lane `lane` writes packs lane, lane + lanes, ...
template <typename T, int N, bool kGrouped, typename Collect>
JAX_EP_HOST_DEVICE void sum_rows_packed(T* out, int64_t packs, bool weighted, int end,
                                        const Collect& collect, int lane, int lanes) {
  // Not unrolled: kSumBatch loads per pack are in flight already.
  JAX_EP_NO_UNROLL for (int64_t i = lane; i < packs; i += lanes) {
    PackSum<N, kGrouped> sum;
    for (int from = 0; from < end;) {
      Terms<T> batch;
      from = collect(batch, from);
      add_terms(batch, i, weighted, sum);
    }
    if constexpr (kGrouped) sum.template close<T>();
    Pack<T, N> p;
    JAX_EP_UNROLL for (int q = 0; q < N; ++q) p.v[q] = from_float<T>(sum.total[q]);
    reinterpret_cast<Pack<T, N>*>(out)[i] = p;
  }
}

// out[0, H) = the ordered sum of some rows of H values, in float32 from 0, each row times its
// weight when weighted, every product and sum rounded, stored as T (the combine of
// docs/contract.md). The rows are the terms at positions [0, end) of the caller's sequence:
// collect(terms, from) adds those at from, from + 1, ... (positions that hold none are
// skipped) until the batch is full or `end` is reached, and returns the next position.
// Lane 0 meters the rows read and the one written. Packs are 16 bytes when out, every row
// and the row size allow, else single values. The terms are collected again for every pack,
// from ids that stay in L1: next to a 16-byte load per term that costs little, and holding
// every term's address for the whole row would double the registers (about 100 now).
// Grouped (kGrouped), each run of terms of one group is summed on its own from 0 and rounded
// to T before it joins the sum: the expert-major combine's partial sum per rank-major row.
template <bool kGrouped = false, typename T, typename Collect>
JAX_EP_HOST_DEVICE void sum_rows(T* out, int64_t H, bool weighted, int end,
                                 const Collect& collect, int lane, int lanes) {
  const int64_t row_bytes = H * static_cast<int64_t>(sizeof(T));
  uintptr_t bits = reinterpret_cast<uintptr_t>(out) | static_cast<uintptr_t>(row_bytes);
  int64_t terms = 0;
  for (int from = 0; from < end;) {
    Terms<T> batch;
    from = collect(batch, from);
    bits |= address_bits(batch.row, batch.n);
    terms += batch.n;
  }
  if (lane == 0) meter_rows(terms * row_bytes, row_bytes);
  constexpr int N = 16 / sizeof(T);
  if ((bits & 15u) == 0) {
    sum_rows_packed<T, N, kGrouped>(out, H / N, weighted, end, collect, lane, lanes);
  } else {
    sum_rows_packed<T, 1, kGrouped>(out, H, weighted, end, collect, lane, lanes);
  }
}

// ---------------------------------------------------------------------------------------------
// Normal combine

template <typename T>
struct CombineArgs {
  int num_ranks, num_tokens, top_k, hidden;
  int capacity;  // rows (rank-major) or entries (expert-major) of y per rank
  bool expert_major;
  const T* y;                 // [R, capacity, H]
  const float* weights;       // [R, capacity] or nullptr
  const int32_t* src_row;     // [R, R*T] (the handle's, per receiver)
  const int32_t* row_entries; // [R, R*T, K] (expert-major)
  T* out;                     // [R, T, H]
  // Between devices: where this rank stages what the homes read, in its symmetric buffer:
  // src_row and, rank-major, the rows of y that carry data and their weights. Null with
  // virtual ranks.
  struct Staged {
    T* y;             // [capacity, H] (rank-major)
    float* weights;   // [capacity] (rank-major, weighted)
    int32_t* src_row; // [R*T]
  } staged{};
  // Between devices, expert-major: each rank-major row's partial sum, in this rank's symmetric
  // buffer where the homes read it or this rank's puts return it ([R*T, H]). Null otherwise.
  T* partial = nullptr;
  // Over puts: what the receivers return to this rank, in its symmetric buffer (their puts
  // write it): for receiver d and token t, at d*T + t, the row d holds for t (-1: none), its
  // weight (rank-major, weighted) and its data (y's row, or the partial sum expert-major).
  struct Returned {
    int32_t* row;     // [R*T]
    float* weights;   // [R*T]
    T* rows;          // [R*T, H]
  } returned{};
  // Channels (cuda/channels.h, between devices, rank-major, one node): the rows return home
  // through rings (combine_stream.h).
  Rings rings;
  // Rank whose data sits at index 0 of the per-rank arrays that are not reached through Peers
  // (inputs, workspace, summaries): 0 with virtual ranks (all ranks here), this rank's own
  // number between GPUs (one rank here).
  int first_rank = 0;
  JAX_EP_HOST_DEVICE int64_t local(int rank) const { return rank - first_rank; }
};

// Between devices, expert-major, items (d, src) for src in [0, R*T): receiver d stages where
// token src sits and, if it has a row, the row's partial sum, where its home reads it: the
// row's entries in sorted order, each times its weight, in float32 from 0, stored in y's type.
// One row per token and receiver crosses to the home, not one per entry.
template <typename T>
JAX_EP_HOST_DEVICE void combine_partial(const CombineArgs<T>& a, int d, int64_t src, int lane,
                                        int lanes) {
  const int64_t rows = static_cast<int64_t>(a.num_ranks) * a.num_tokens, K = a.top_k;
  const int64_t H = a.hidden;
  const int32_t row = a.src_row[a.local(d) * rows + src];
  if (lane == 0) a.staged.src_row[src] = row;
  if (row < 0) return;
  const int32_t* entries = a.row_entries + (a.local(d) * rows + row) * K;
  const T* y = a.y + a.local(d) * a.capacity * H;
  const float* w = a.weights ? a.weights + a.local(d) * a.capacity : nullptr;
  sum_rows(a.partial + row * H, H, w != nullptr, a.top_k,
           [&](Terms<T>& terms, int k) {
             for (; k < K && !terms.full(); ++k) {
               const int32_t e = entries[k];
               if (e >= 0) terms.add(y + static_cast<int64_t>(e) * H, w ? w[e] : 0.0f);
             }
             return k;
           },
           lane, lanes);
}

// Between devices, rank-major, items (d, src) for src in [0, R*T): receiver d stages where
// token src sits in y and, if it does, its row of y and weight, where the token's home reads
// them. Only the rows that carry data leave y (docs/contract.md, "Padding").
template <typename T>
JAX_EP_HOST_DEVICE void combine_stage(const CombineArgs<T>& a, int d, int64_t src, int lane,
                                      int lanes) {
  const int64_t rows = static_cast<int64_t>(a.num_ranks) * a.num_tokens, H = a.hidden;
  const int32_t row = a.src_row[a.local(d) * rows + src];
  if (lane == 0) a.staged.src_row[src] = row;
  if (row < 0) return;
  const int64_t at = a.local(d) * a.capacity + row;
  copy_row(a.staged.y + row * H, a.y + at * H, H * static_cast<int64_t>(sizeof(T)), lane, lanes);
  if (lane == 0 && a.weights) a.staged.weights[row] = a.weights[at];
}

// Over puts, items (d, src) for src in [0, R*T): receiver d returns token src's row (staged y,
// or its partial sum expert-major) with its weight to slot d*T + t of the token's home s, or
// -1 there when it holds none (every slot written: no clearing). The rows are already in the
// symmetric buffer (combine_stage), where a put reads them.
template <typename T, typename Peers>
JAX_EP_HOST_DEVICE void combine_return(const CombineArgs<T>& a, const Peers& peers, int d,
                                       int64_t src, int lane, int lanes) {
  const int Tn = a.num_tokens;
  const int64_t rows = static_cast<int64_t>(a.num_ranks) * Tn, H = a.hidden;
  const int s = static_cast<int>(src / Tn);
  const int64_t slot = static_cast<int64_t>(d) * Tn + src % Tn;
  const int32_t row = a.src_row[a.local(d) * rows + src];
  if (lane == 0) store_to(peers, a.returned.row, 0, s, slot, row);
  if (row < 0) return;
  const T* from = (a.expert_major ? a.partial : a.y) + row * H;
  peers.put(a.returned.rows + slot * H, s, from, H * static_cast<int64_t>(sizeof(T)), lane,
            lanes);
  if (lane == 0 && !a.expert_major && a.weights) {
    store_to(peers, a.returned.weights, 0, s, slot, a.weights[row]);
  }
}

// Items (s, t): home rank s sums token t's rows over the receivers in rank order: rank-major,
// each receiver's row of y times its weight; between devices expert-major, each receiver's
// partial sum of the row (combine_partial); over puts, the rows the receivers returned here.
// Expert-major with virtual ranks: combine_token_entries.
template <typename T, typename Peers>
JAX_EP_HOST_DEVICE void combine_token(const CombineArgs<T>& a, const Peers& peers, int s, int t,
                                      int lane, int lanes) {
  const int R = a.num_ranks, Tn = a.num_tokens;
  const int64_t src = static_cast<int64_t>(s) * Tn + t, H = a.hidden;
  T* out = a.out + (a.local(s) * Tn + t) * H;
  if constexpr (Peers::kPuts) {
    const bool weighted = !a.expert_major && a.weights;
    sum_rows(out, H, weighted, R,
             [&](Terms<T>& terms, int d) {
               for (; d < R && !terms.full(); ++d) {
                 const int64_t slot = static_cast<int64_t>(d) * Tn + t;
                 if (a.returned.row[slot] < 0) continue;
                 terms.add(a.returned.rows + slot * H, weighted ? a.returned.weights[slot] : 0.0f);
               }
               return d;
             },
             lane, lanes);
  } else {
    const int64_t rows = static_cast<int64_t>(R) * Tn;
    const bool em = a.expert_major;
    const T* base = em ? a.partial : a.y;
    const int64_t rows_per_rank = em ? rows : a.capacity;
    const float* weights = em ? nullptr : a.weights;
    sum_rows(out, H, weights != nullptr, R,
             [&](Terms<T>& terms, int d) {
               for (; d < R && !terms.full(); ++d) {
                 const int32_t row = peers.at(a.src_row, rows, d)[src];
                 if (row < 0) continue;  // adding +0.0 would change nothing
                 terms.add(peers.at(base, rows_per_rank * H, d) + static_cast<int64_t>(row) * H,
                           weights ? peers.at(weights, rows_per_rank, d)[row] : 0.0f);
               }
               return d;
             },
             lane, lanes);
  }
}

// Expert-major with virtual ranks, items (s, t): home rank s sums token t over the receivers
// in rank order, each receiver's part the partial sum of its row's entries (rounded to y's
// type), read from the entries' rows of y where they are: no partial rows are written.
template <typename T, typename Peers>
JAX_EP_HOST_DEVICE void combine_token_entries(const CombineArgs<T>& a, const Peers& peers, int s,
                                              int t, int lane, int lanes) {
  const int R = a.num_ranks, Tn = a.num_tokens, K = a.top_k;
  const int64_t src = static_cast<int64_t>(s) * Tn + t, H = a.hidden;
  const int64_t rows = static_cast<int64_t>(R) * Tn;
  // Positions d*K + k: entry k of receiver d's row, in group d.
  sum_rows<true>(a.out + (a.local(s) * Tn + t) * H, H, a.weights != nullptr, R * K,
                 [&](Terms<T>& terms, int p) {
                   for (; p < R * K && !terms.full(); ++p) {
                     const int d = p / K;
                     const int32_t row = peers.at(a.src_row, rows, d)[src];
                     if (row < 0) {  // no group: it would add +0.0
                       p = (d + 1) * K - 1;
                       continue;
                     }
                     const int32_t e = peers.at(a.row_entries, rows * K, d)[row * K + p % K];
                     if (e < 0) continue;
                     terms.add(peers.at(a.y, a.capacity * H, d) + static_cast<int64_t>(e) * H,
                               a.weights ? peers.at(a.weights, a.capacity, d)[e] : 0.0f, d);
                   }
                   return p;
                 },
                 lane, lanes);
}

// ---------------------------------------------------------------------------------------------
// Low-latency dispatch and combine

// Low-latency rows are split into column segments, one warp each: at decode sizes a rank's
// tokens alone are too few warps to fill a GPU (T = 128: 128 warps, where an H100 wants 528),
// so a row is cut into segments of whole 128-channel blocks, enough that T tokens give
// kLlWarps warps per rank. ll_segment_cols: the columns of each segment but the last. An
// nvfp4 row is one segment: its global scale needs the whole row's amax.
constexpr int kLlWarps = 1024;
JAX_EP_HOST_DEVICE int ll_segment_cols(int num_tokens, int hidden, int wire = kWireBf16) {
  if (hidden % kFp8Block != 0 || num_tokens <= 0 || wire == kWireNvfp4) {
    return hidden > 0 ? hidden : 1;
  }
  const int blocks = hidden / kFp8Block;
  const int wanted = (kLlWarps + num_tokens - 1) / num_tokens;
  const int segments = wanted < blocks ? wanted : blocks;
  return (blocks + segments - 1) / segments * kFp8Block;
}
JAX_EP_HOST_DEVICE int ll_segments(int num_tokens, int hidden, int wire = kWireBf16) {
  const int cols = ll_segment_cols(num_tokens, hidden, wire);
  return (hidden + cols - 1) / cols;
}
// Items of a low-latency phase over rows: every segment of every token of a rank.
JAX_EP_HOST_DEVICE int64_t ll_row_items(int num_tokens, int hidden, int wire = kWireBf16) {
  return static_cast<int64_t>(num_tokens) * ll_segments(num_tokens, hidden, wire);
}

// The send numbers its own messages, with no count launch before it, when a source's slots
// need no other source's counts (between devices, per-source slots; or one rank) and its
// routing is short: each warp then counts the messages of the tokens before its own to each
// expert it sends to, at most kSendCountEntries entries, and kSendCountEntries / 32 rounds.
// Longer routings keep the count launch, whose chunks walk each entry once.
constexpr int64_t kSendCountEntries = 4096;
constexpr int kMaxTopK = 32;  // a token's choices in one table of the warp (ChoiceSlots)
JAX_EP_HOST_DEVICE bool ll_counts_in_send(bool own_slots, int num_tokens, int top_k) {
  return own_slots && top_k <= kMaxTopK &&
         static_cast<int64_t>(num_tokens) * top_k <= kSendCountEntries;
}

struct LowLatencyArgs {
  int num_ranks, num_tokens, top_k, num_experts, hidden;
  int wire;                  // the rows' wire format (cuda/wire.h)
  const Bf16* x;             // [R, T, H]
  const int32_t* topk_idx;   // [R, T, K]
  int32_t* clean_idx;        // [R, T, K]
  int32_t* num_invalid;      // [R]
  int32_t* counts;           // [R, E] messages of source s to expert e
  // [V, E/R] the receive's count (messages per local expert), written by the send when all
  // ranks are here (virtual ranks, or one rank): their receive has nothing else to do.
  int32_t* count;
  // [R, chunks, E + 1]: per chunk of a source's tokens (count_chunks), its messages to each
  // expert, then its invalid ids; after the count, those of the chunks before it.
  int32_t* chunk_counts;
  int chunk_shift, num_chunks;  // as DispatchArgs'
  int32_t* slot_offset;      // [R, T, K] rank of (t, k) among its chunk's messages to its expert
  void* recv_x;              // [R, E/R, R*T, data bytes of a row] (wire_data_bytes)
  float* recv_scales;        // [R, E/R, R*T, scale words of a row] (wire_scale_words)
  int32_t* src_row;          // [R(expert side), R(source), T, K]
  // Put views: the send area in this rank's symmetric buffer, [T, data bytes] and [T, scale
  // words], where ll_stage puts each token's row once for the send's puts to read.
  char* send_x = nullptr;
  float* send_scales = nullptr;
  // XLA's results when recv_x, recv_scales and src_row are in the symmetric buffer (between
  // devices: the receive copies the counted rows and src_row here); null with virtual ranks.
  void* out_x = nullptr;
  float* out_scales = nullptr;
  int32_t* out_src_row = nullptr;
  // Between devices: source s writes its messages to expert e at the slots s*T + offset, which
  // need no other rank's counts (no barrier between the count and the send); the receive
  // moves them to their compact slots. Off with virtual ranks: messages land in place.
  bool per_source_slots = false;
  int buffer = 0;  // between devices: which of the two low-latency regions (cuda/peer_ops.h)
  // Rank whose data sits at index 0 of the per-rank arrays that are not reached through Peers
  // (inputs, workspace, summaries): 0 with virtual ranks (all ranks here), this rank's own
  // number between GPUs (one rank here).
  int first_rank = 0;
  JAX_EP_HOST_DEVICE int64_t local(int rank) const { return rank - first_rank; }

  JAX_EP_HOST_DEVICE int experts_per_rank() const { return num_experts / num_ranks; }
  JAX_EP_HOST_DEVICE int64_t slots() const { return static_cast<int64_t>(num_ranks) * num_tokens; }
  JAX_EP_HOST_DEVICE int64_t row_bytes() const { return wire_data_bytes(wire, hidden); }
  JAX_EP_HOST_DEVICE int64_t scale_words() const { return wire_scale_words(wire, hidden); }
  JAX_EP_HOST_DEVICE bool counts_in_send() const {
    return ll_counts_in_send(per_source_slots || num_ranks == 1, num_tokens, top_k);
  }
  // Source s's messages of the chunks before the chunk of token t (after the count).
  JAX_EP_HOST_DEVICE const int32_t* chunks_before(int s, int t) const {
    return chunk_counts + (local(s) * num_chunks + (t >> chunk_shift)) * (num_experts + 1);
  }
};

// The low-latency send's workspace, one int32 array (as carve_dispatch_workspace): with the
// count launch, slot_offset and chunk_counts of the V ranks of this call; with every rank of
// the group here (V = R), the counts (between devices they lie in the symmetric buffer).
inline int64_t carve_ll_workspace(LowLatencyArgs* a, int64_t V, int32_t* work = nullptr) {
  const bool between = V == 1 && a->num_ranks > 1;
  const bool counted = !ll_counts_in_send(between || a->num_ranks == 1, a->num_tokens, a->top_k);
  a->chunk_shift = count_chunk_shift(a->top_k);
  a->num_chunks = counted ? count_chunks(a->num_tokens, a->top_k) : 0;
  const int64_t offsets = counted ? V * a->num_tokens * a->top_k : 0;
  const int64_t chunks = V * a->num_chunks * (a->num_experts + 1);
  if (work != nullptr) {
    a->slot_offset = work;
    a->chunk_counts = work + offsets;
    if (!between) a->counts = work + offsets + chunks;
  }
  return offsets + chunks + (between ? 0 : int64_t{a->num_ranks} * a->num_experts);
}

// True when choice k is the first choice of `ids` equal to ids[k] (duplicates send once).
JAX_EP_HOST_DEVICE bool first_occurrence(const int32_t* ids, int k) {
  for (int q = 0; q < k; ++q) {
    if (ids[q] == ids[k]) return false;
  }
  return true;
}

// Phase 1, items (s, g): source s's chunk g of tokens (count_chunk). Counters: c < E, the
// chunk's messages to expert c (a token's duplicate choices send once; slot_offset);
// c == E, invalid ids.
JAX_EP_HOST_DEVICE void ll_count(const LowLatencyArgs& a, int s, int g, int lane, int lanes) {
  const int T = a.num_tokens, K = a.top_k, E = a.num_experts;
  const int64_t here = a.local(s) * T * K;
  const int32_t* raw = a.topk_idx + here;
  count_chunk<1>(
      raw, a.clean_idx + here, g, a.chunk_shift, T, K, E, E + 1,
      a.chunk_counts + (a.local(s) * a.num_chunks + g) * (E + 1),
      [&](int64_t i, int) {
        const int32_t e = raw[i];
        const int k = static_cast<int>(i % K);
        if (is_invalid(e, E)) return E;
        return is_choice(e, E) && first_occurrence(raw + (i - k), k) ? e : -1;
      },
      [&](int64_t i, int, int c, int32_t number) {
        if (c < E) a.slot_offset[here + i] = number;
      },
      lane, lanes);
}

// The compact slot of source s's message to expert e numbered `offset`: after the messages of
// lower ranks (the contract's order).
JAX_EP_HOST_DEVICE int32_t ll_compact_slot(const LowLatencyArgs& a, int s, int e,
                                           int32_t offset) {
  for (int q = 0; q < s; ++q) offset += a.counts[static_cast<int64_t>(q) * a.num_experts + e];
  return offset;
}

// The slot the send writes that message to (see per_source_slots).
JAX_EP_HOST_DEVICE int32_t ll_slot(const LowLatencyArgs& a, int s, int e, int32_t offset) {
  return a.per_source_slots ? s * a.num_tokens + offset : ll_compact_slot(a, s, e, offset);
}

// The cast to a wire format (cuda/wire.h), in parts of 8 channels (16 bytes of bfloat16 in; 8
// bytes of e4m3, or 4 of e2m1, out): a block's parts (16, 4 or 2) share its amax.
constexpr int kCastChannels = 8;
struct alignas(8) CastWord {
  uint32_t v[2];
};

// The larger of amax and |v|; NaN once either is NaN (a NaN makes its block NaN).
JAX_EP_HOST_DEVICE float larger_abs(float amax, float v) {
  const float m = v < 0.0f ? -v : v;
  return m > amax || m != m ? m : amax;
}

// Channel i of a part held as a word of bfloat16 bits, as the format reads it (every format
// but e4m3 reads magnitudes below 2^-126 as zero).
template <int kWire>
JAX_EP_HOST_DEVICE float part_channel(const Word& part, int i) {
  const uint32_t pair = part.v[i / 2];
  const float v = to_float(Bf16{static_cast<uint16_t>(i % 2 ? pair >> 16 : pair & 0xffffu)});
  return kWire == kWireE4m3 ? v : flush_tiny(v);
}

// The 16-byte part `part` of the bfloat16 row x (zeros where invalid).
JAX_EP_HOST_DEVICE Word load_part(const Bf16* x, int part, bool valid, bool aligned) {
  const Bf16* channels = x + static_cast<int64_t>(part) * kCastChannels;
  Word v = {};
  if (valid && aligned) {
    v = *reinterpret_cast<const Word*>(channels);
  } else if (valid) {
    JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) {
      v.v[i / 2] |= static_cast<uint32_t>(channels[i].bits) << (i % 2 * 16);
    }
  }
  return v;
}

// The larger of amax and the magnitudes of a part's channels, as the format reads them.
template <int kWire>
JAX_EP_HOST_DEVICE float part_amax(float amax, const Word& part) {
  JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) {
    amax = larger_abs(amax, part_channel<kWire>(part, i));
  }
  return amax;
}

// The amax of the `group` consecutive parts (a power of two dividing 32, aligned) that hold
// lane's part: on the GPU from those lanes (shuffles), on the CPU (lanes run one after
// another) by reading the group's channels from x: the same maximum.
template <int kWire>
JAX_EP_HOST_DEVICE float group_amax(const Bf16* x, const Word& v, int part, int group,
                                    bool valid) {
  float amax = 0.0f;
#if defined(__CUDA_ARCH__)
  (void)x, (void)part, (void)valid;
  amax = part_amax<kWire>(amax, v);
  for (int offset = group / 2; offset > 0; offset /= 2) {
    amax = larger_abs(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
#else
  (void)v;
  const int first = part / group * group;
  for (int p = first; valid && p < first + group; ++p) {
    amax = part_amax<kWire>(amax, load_part(x, p, true, false));
  }
#endif
  return amax;
}

// nvfp4: the amax of the whole row of `parts` parts, in every lane.
JAX_EP_HOST_DEVICE float row_amax(const Bf16* x, int parts, bool aligned, int lane, int lanes) {
  float amax = 0.0f;
#if defined(__CUDA_ARCH__)
  for (int part = lane; part < parts; part += lanes) {
    amax = part_amax<kWireNvfp4>(amax, load_part(x, part, true, aligned));
  }
  JAX_EP_UNROLL for (int offset = 16; offset > 0; offset /= 2) {
    amax = larger_abs(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
#else
  (void)aligned, (void)lane, (void)lanes;
  for (int part = 0; part < parts; ++part) {
    amax = part_amax<kWireNvfp4>(amax, load_part(x, part, true, false));
  }
#endif
  return amax;
}

// Writes `channels` (whole blocks) of token row x, cast to the wire format kWire once, to
// every slot of the fans (and empties them): the data to `rows`, each block's scale to
// `scales` (the segment's first scale byte in each row's other bytes), and, where the segment
// ends the row, the row's `tail` bytes after its scales (nvfp4's global scale, then zero
// padding to a whole word). Lane `lane` casts the parts lane, lane + lanes, ...: one 16-byte
// load, and one store to each slot.
template <int kWire>
JAX_EP_HOST_DEVICE void ll_cast_rows(const Bf16* x, int64_t channels, Fan<char>& rows,
                                     Fan<char>& scales, int tail, int lane, int lanes) {
  const int n = rows.size();
  if (n == 0) return;
  fan_sync();
  const bool aligned = ((rows.address_bits() | reinterpret_cast<uintptr_t>(x)) & 15u) == 0;
  const int64_t H = channels;
  const int block = wire_block(kWire), group = block / kCastChannels;
  const int scale_bytes = wire_scale_bytes(kWire);
  if (lane == 0) {  // an nvfp4 row is read twice: its amax first
    meter_rows((kWire == kWireNvfp4 ? 4 : 2) * H,
               n * (wire_data_bytes(kWire, H) + H / block * scale_bytes + tail));
  }
  const int parts = static_cast<int>(H / kCastChannels);
  Nvfp4Row row{1.0f, 0.0f, true};
  if (kWire == kWireNvfp4) row = nvfp4_row(row_amax(x, parts, aligned, lane, lanes));
  for (int first = 0; first < parts; first += lanes) {  // the same trips in every lane
    const int part = first + lane;
    const bool valid = part < parts;
    const Word v = load_part(x, part, valid, aligned);
    const float amax = group_amax<kWire>(x, v, part, group, valid);
    if (!valid) continue;
    // The block's scale bytes (little-endian), and the part's bytes out.
    uint32_t scale = 0;
    CastWord word = {};
    if (kWire == kWireNvfp4) {
      const Nvfp4Block b = nvfp4_block(amax, row);
      scale = b.scale;
      JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) {
        word.v[0] |= nvfp4_element(part_channel<kWire>(v, i), b.inverse) << (4 * i);
      }
    } else {
      float inv = 0.0f;
      bool finite = true;
      if (kWire == kWireE4m3) {
        const float s = fp8_scale(amax);
        scale = float_bits(s);
        inv = reciprocal_rn(s);
      } else {
        scale = e8m0_scale(kWire, amax);
        finite = scale != kE8m0Nan;
        inv = e8m0_inverse(static_cast<uint8_t>(scale));
      }
      JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) {
        float e = mul_rn(part_channel<kWire>(v, i), inv);
        if (kWire == kWireMxfp8) e = e < -448.0f ? -448.0f : e > 448.0f ? 448.0f : e;
        const uint32_t code = finite ? to_e4m3(e) : kE4m3Nan;
        word.v[i / 4] |= code << (8 * (i % 4));
      }
    }
    const int out = kWire == kWireNvfp4 ? 4 : 8;  // bytes of a part
    const int64_t at = static_cast<int64_t>(part) * out;
    for (int j = 0; j < n; ++j) {
      if (aligned && out == 8) {
        *reinterpret_cast<CastWord*>(rows[j] + at) = word;
      } else if (aligned) {
        *reinterpret_cast<uint32_t*>(rows[j] + at) = word.v[0];
      } else {
        for (int b = 0; b < out; ++b) {
          rows[j][at + b] = static_cast<char>(word.v[b / 4] >> (8 * (b % 4)));
        }
      }
    }
    if (part % group == 0) {  // e4m3's float32 scales lie on whole words
      const int64_t s = static_cast<int64_t>(part / group) * scale_bytes;
      for (int j = 0; j < n; ++j) {
        if (scale_bytes == 4) {
          *reinterpret_cast<uint32_t*>(scales[j] + s) = scale;
        } else {
          scales[j][s] = static_cast<char>(scale);
        }
      }
    }
    if (part == parts - 1 && tail > 0) {  // the row's last bytes: nvfp4's global scale, zeros
      const int64_t s = static_cast<int64_t>(parts / group) * scale_bytes;
      const uint32_t g = kWire != kWireNvfp4 ? 0u : row.finite ? float_bits(row.g) : 0x7fc00000u;
      for (int j = 0; j < n; ++j) {
        for (int b = 0; b < tail; ++b) {
          scales[j][s + b] = static_cast<char>(b < 4 ? g >> (8 * b) : 0);
        }
      }
    }
  }
  fan_sync();  // every lane read the tables before they are filled again
  rows.clear();
  scales.clear();
}

// Columns [first, first + n) (a segment, ll_segment_cols) of a low-latency row in the wire
// format `wire`: where they start in a message's data bytes and in its other bytes, and how
// many bytes they take; the segment that ends the row also takes the row's tail (after the
// block scales: nvfp4's global scale and the padding to a whole word).
struct LlSegment {
  int first, n, wire, hidden;
  JAX_EP_HOST_DEVICE bool last() const { return first + n == hidden; }
  JAX_EP_HOST_DEVICE int64_t byte() const { return wire_data_bytes(wire, first); }
  JAX_EP_HOST_DEVICE int64_t bytes() const { return wire_data_bytes(wire, n); }
  JAX_EP_HOST_DEVICE int64_t scale_byte() const {
    return first / wire_block(wire) * wire_scale_bytes(wire);
  }
  JAX_EP_HOST_DEVICE int tail() const {
    if (!last()) return 0;
    return static_cast<int>(wire_scale_words(wire, hidden) * 4 -
                            hidden / wire_block(wire) * wire_scale_bytes(wire));
  }
  JAX_EP_HOST_DEVICE int64_t scale_bytes() const {
    return n / wire_block(wire) * wire_scale_bytes(wire) + tail();
  }
};
// Item t * segments + g of a low-latency phase over rows: its token t and segment g.
JAX_EP_HOST_DEVICE LlSegment ll_segment(int num_tokens, int hidden, int64_t item, int* t,
                                        int wire = kWireBf16) {
  const int cols = ll_segment_cols(num_tokens, hidden, wire);
  const int segments = (hidden + cols - 1) / cols;
  *t = static_cast<int>(item / segments);
  const int first = static_cast<int>(item % segments) * cols;
  return LlSegment{first, hidden - first < cols ? hidden - first : cols, wire, hidden};
}

// The slot offsets of a token's messages, one per choice k (-1: choice k sends nothing:
// masked, invalid, or a repeat of an earlier choice), in a table of the warp like Fan's: in
// shared memory on the GPU, written by lane 0 and read by every lane after fan_sync; each
// lane's own on the CPU.
class ChoiceSlots {
 public:
  JAX_EP_HOST_DEVICE ChoiceSlots() {
#if defined(__CUDA_ARCH__)
    __shared__ int32_t tables[kBlockWarps][kMaxTopK];
    at_ = tables[threadIdx.x / 32];
#endif
  }
  JAX_EP_HOST_DEVICE void set(int k, int32_t offset, int lane) {
#if defined(__CUDA_ARCH__)
    if (lane == 0) at_[k] = offset;
#else
    (void)lane;
    at_[k] = offset;
#endif
  }
  JAX_EP_HOST_DEVICE int32_t operator[](int k) const { return at_[k]; }

 private:
#if defined(__CUDA_ARCH__)
  int32_t* at_;
#else
  int32_t at_[kMaxTopK];
#endif
};

// The number of i in [0, n) for which counted(i) holds, in every lane: on the GPU the lanes
// split the walk and sum their counts; on the CPU, where lanes run one after another, each
// lane walks it all (the same number). Every lane of the warp calls it; n is at most
// kSendCountEntries.
template <typename Counted>
JAX_EP_HOST_DEVICE int32_t warp_count(int n, int lane, int lanes, const Counted& counted) {
  int32_t number = 0;
#if defined(__CUDA_ARCH__)
  for (int i = lane; i < n; i += lanes) number += counted(i) ? 1 : 0;
  JAX_EP_UNROLL for (int offset = 16; offset > 0; offset /= 2) {
    number += __shfl_xor_sync(0xffffffffu, number, offset);
  }
#else
  (void)lane, (void)lanes;
  for (int i = 0; i < n; ++i) number += counted(i) ? 1 : 0;
#endif
  return number;
}

// Source s's messages to expert e among its first n routing entries (a token's repeated
// choices send once), when the send numbers its messages itself (counts_in_send).
JAX_EP_HOST_DEVICE int32_t ll_messages_before(const LowLatencyArgs& a, int s, int32_t e, int n,
                                              int lane, int lanes) {
  const int K = a.top_k;
  const int32_t* raw = a.topk_idx + a.local(s) * a.num_tokens * K;
  return warp_count(n, lane, lanes, [&](int i) {
    return raw[i] == e && first_occurrence(raw + (i - i % K), i % K);
  });
}

// Fills `slots` with the slot offsets of token t of source s: from the count launch's
// numbering (its chunk's offsets, then the token's in the chunk), or counted here; then
// (`clean`, when counted here) writes the token's clean routing.
JAX_EP_HOST_DEVICE void ll_choice_slots(const LowLatencyArgs& a, int s, int t, bool clean,
                                        ChoiceSlots& slots, int lane, int lanes) {
  const int K = a.top_k, E = a.num_experts;
  const int64_t here = a.local(s) * a.num_tokens + t;
  const int32_t* ids = a.topk_idx + here * K;
  const bool counted_here = a.counts_in_send();
  fan_sync();  // every lane is done with the table's last use
  for (int k = 0; k < K; ++k) {  // the same trips in every lane
    const int32_t e = ids[k];
    int32_t offset = -1;
    if (is_choice(e, E) && first_occurrence(ids, k)) {
      offset = counted_here ? ll_messages_before(a, s, e, t * K, lane, lanes)
                            : a.chunks_before(s, t)[e] + a.slot_offset[here * K + k];
    }
    slots.set(k, offset, lane);
    if (clean && counted_here && lane == 0) a.clean_idx[here * K + k] = is_choice(e, E) ? e : -1;
  }
  fan_sync();
}

// The send's segment `seg` of token t's rows (`ids`: its routing, `slots`: its messages' slot
// offsets, `x`: the segment's first column of its row): once to each expert it chose, as
// bf16 or cast to FP8 (one loop nest per case: in one, the two cases hold more registers). A
// put view sends, instead, the segment ll_stage left in the send area, one put per message.
template <int kWire, typename Peers>
JAX_EP_HOST_DEVICE void ll_send_rows(const LowLatencyArgs& a, const Peers& peers, int s, int t,
                                     const int32_t* ids, const ChoiceSlots& slots,
                                     const Bf16* x, const LlSegment& seg, int lane, int lanes) {
  const int K = a.top_k, El = a.experts_per_rank();
  const int64_t all_slots = a.slots(), row_bytes = wire_data_bytes(kWire, a.hidden);
  const int64_t scale_row = 4 * wire_scale_words(kWire, a.hidden);
  // The segment's first byte and scale byte in every row (pointers that only Peers::at moves).
  char* const recv_x = static_cast<char*>(a.recv_x) + seg.byte();
  char* const recv_scales =
      kWire == kWireBf16 ? nullptr : reinterpret_cast<char*>(a.recv_scales) + seg.scale_byte();
  // The slot of expert e's rank that message k goes to.
  auto slot_row = [&](int32_t e, int k) {
    return static_cast<int64_t>(e % El) * all_slots + ll_slot(a, s, e, slots[k]);
  };
  if constexpr (Peers::kPuts) {
    const int64_t here = a.local(s) * a.num_tokens + t;
    for (int k = 0; k < K; ++k) {
      if (slots[k] < 0) continue;
      const int32_t e = ids[k];
      const int64_t row = slot_row(e, k);
      peers.put(recv_x + row * row_bytes, e / El, a.send_x + here * row_bytes + seg.byte(),
                seg.bytes(), lane, lanes);
      if (kWire != kWireBf16) {
        peers.put(recv_scales + row * scale_row, e / El,
                  reinterpret_cast<char*>(a.send_scales) + here * scale_row + seg.scale_byte(),
                  seg.scale_bytes(), lane, lanes);
      }
    }
  } else {
    Fan<char> rows(0);
    Fan<char> scales(1);
    for (int k = 0; k < K;) {
      for (; k < K && !rows.full(); ++k) {
        if (slots[k] < 0) continue;
        const int32_t e = ids[k];
        const int d = e / El;
        const int64_t row = slot_row(e, k);
        rows.add(peers.at(recv_x, El * all_slots * row_bytes, d) + row * row_bytes);
        if (kWire != kWireBf16) {
          scales.add(peers.at(recv_scales, El * all_slots * scale_row, d) + row * scale_row);
        }
      }
      if constexpr (kWire != kWireBf16) {
        ll_cast_rows<kWire>(x, seg.n, rows, scales, seg.tail(), lane, lanes);
      } else {
        fan_out_row(rows, x, seg.bytes(), lane, lanes);
      }
    }
  }
}

// Put views, the stage before the send, items (s, t * segments + g): segment g of token t's
// row, as bf16 or cast to its wire format with its scales, once into this rank's send area,
// where the send's puts read it. A put's source must lie in the symmetric buffer (RDMA reads
// it there), and it is finished a launch before the puts, so that every lane of a put reads a
// whole segment, on the GPU as on the CPU's emulated lanes (which run one after another).
template <int kWire>
JAX_EP_HOST_DEVICE void ll_stage(const LowLatencyArgs& a, int s, int64_t item, int lane,
                                 int lanes) {
  int t = 0;
  const LlSegment seg = ll_segment(a.num_tokens, a.hidden, item, &t, kWire);
  const int64_t here = a.local(s) * a.num_tokens + t, row_bytes = a.row_bytes();
  const Bf16* x = a.x + here * a.hidden + seg.first;
  Fan<char> rows(0);
  Fan<char> scales(1);
  rows.add(a.send_x + here * row_bytes + seg.byte());
  if constexpr (kWire != kWireBf16) {
    scales.add(reinterpret_cast<char*>(a.send_scales) + here * 4 * a.scale_words() +
               seg.scale_byte());
    ll_cast_rows<kWire>(x, seg.n, rows, scales, seg.tail(), lane, lanes);
  } else {
    fan_out_row(rows, x, seg.bytes(), lane, lanes);
  }
}

// The send's first items when it numbers its messages itself (counts_in_send), items
// c in [0, E]: c < E, source s's messages to expert c, into s's row of the counts here (the
// launch's tail publishes the row to every rank, LowLatencySendTail; with one rank, its
// receive's count); c == E, its invalid ids.
JAX_EP_HOST_DEVICE void ll_send_count(const LowLatencyArgs& a, int s, int c, int lane,
                                      int lanes) {
  const int E = a.num_experts, entries = a.num_tokens * a.top_k;  // counts_in_send: few
  if (c == E) {
    const int32_t* raw = a.topk_idx + a.local(s) * entries;
    const int32_t invalid =
        warp_count(entries, lane, lanes, [&](int i) { return is_invalid(raw[i], E); });
    if (lane == 0) a.num_invalid[a.local(s)] = invalid;
    return;
  }
  const int32_t total = ll_messages_before(a, s, c, entries, lane, lanes);
  if (lane != 0) return;
  if (!a.per_source_slots) {  // one rank: its receive's count
    a.count[c] = total;
    return;
  }
  a.counts[static_cast<int64_t>(s) * E + c] = total;
}

// The send's items per rank: (counts_in_send) the E + 1 of ll_send_count, which walk the
// most entries and so start first, then every segment of every token.
JAX_EP_HOST_DEVICE int ll_send_counters(const LowLatencyArgs& a) {
  return a.counts_in_send() ? a.num_experts + 1 : 0;
}
inline int64_t ll_send_items(const LowLatencyArgs& a) {
  return ll_send_counters(a) + ll_row_items(a.num_tokens, a.hidden, a.wire);
}

// Phase 2 (the send), after the items of ll_send_count, items (s, t * segments + g): segment
// g of token t of source s goes once to each expert it chose, read once per kFanOut
// messages; with segment 0, every expert rank learns, per choice, the row that holds it
// (src_row, -1 elsewhere), and (counts_in_send) the clean routing is written.
template <int kWire, typename Peers>
JAX_EP_HOST_DEVICE void ll_send(const LowLatencyArgs& a, const Peers& peers, int s,
                                int64_t item, int lane, int lanes) {
  const int R = a.num_ranks, T = a.num_tokens, K = a.top_k, E = a.num_experts;
  const int El = a.experts_per_rank(), counters = ll_send_counters(a);
  if (item < counters) {
    ll_send_count(a, s, static_cast<int>(item), lane, lanes);
    return;
  }
  item -= counters;
  int t = 0;
  const LlSegment seg = ll_segment(T, a.hidden, item, &t, kWire);
  const int64_t slots = a.slots(), src = static_cast<int64_t>(s) * T + t;
  const int64_t here = a.local(s) * T + t;
  const int32_t* ids = a.topk_idx + here * K;
  ChoiceSlots offsets;
  ll_choice_slots(a, s, t, seg.first == 0, offsets, lane, lanes);
  for (int c = lane; seg.first == 0 && c < R * K; c += lanes) {  // cell (d, k), lanes sharing
    const int d = c / K, k = c % K;
    const int32_t e = ids[k];
    int32_t row = -1;
    if (is_choice(e, E) && e / El == d) {
      int first = 0;
      while (ids[first] != e) ++first;
      row = static_cast<int32_t>((e % El) * slots + ll_slot(a, s, e, offsets[first]));
    }
    store_to(peers, a.src_row, slots * K, d, src * K + k, row);
  }
  ll_send_rows<kWire>(a, peers, s, t, ids, offsets, a.x + here * a.hidden + seg.first, seg,
                     lane, lanes);
}

// Phase 3 (the receive, between devices; with every rank here the send delivers), items
// (d, r) for r in [0, E/R * R*T): compact slot r of receiver d. Rows past their expert's count
// are left as they are (docs/contract.md, "Padding"); counted rows (and src_row, items
// r < R*T) move from their per-source slots in the symmetric buffer to XLA's results, src_row
// made compact. The first slot of each expert writes the count.
template <typename Peers>
JAX_EP_HOST_DEVICE void ll_finish(const LowLatencyArgs& a, const Peers& peers, int d, int64_t r,
                                  int lane, int lanes) {
  const int R = a.num_ranks, T = a.num_tokens, El = a.experts_per_rank();
  const int64_t S = a.scale_words(), slots = a.slots();
  const int j = static_cast<int>(r / slots), e = d * El + j;
  const int64_t i = r % slots;
  int32_t count = 0;
  for (int q = 0; q < R; ++q) count += a.counts[static_cast<int64_t>(q) * a.num_experts + e];
  if (i < count) {
    int32_t before = 0;  // the source q whose messages hold compact slot i
    int q = 0;
    for (; q < R - 1; ++q) {
      const int32_t c = a.counts[static_cast<int64_t>(q) * a.num_experts + e];
      if (i < before + c) break;
      before += c;
    }
    const int64_t from = j * slots + static_cast<int64_t>(q) * T + (i - before);
    const int64_t bytes = a.row_bytes();
    copy_row(static_cast<char*>(a.out_x) + (a.local(d) * El * slots + r) * bytes,
             own_copy(peers, static_cast<char*>(a.recv_x), El * slots * bytes, d) + from * bytes,
             bytes, lane, lanes);
    if (S > 0) {
      copy_row(a.out_scales + (a.local(d) * El * slots + r) * S,
               own_copy(peers, a.recv_scales, El * slots * S, d) + from * S, S * 4, lane, lanes);
    }
  }
  if (lane != 0) return;
  if (i == 0) a.count[a.local(d) * El + j] = count;
  if (r < slots) {  // the choices of token r of the group
    const int K = a.top_k;
    const int32_t* sent = own_copy(peers, a.src_row, slots * K, d) + r * K;
    int32_t* to = a.out_src_row + (a.local(d) * slots + r) * K;
    for (int k = 0; k < K; ++k) {
      int32_t row = sent[k];
      if (row >= 0) {
        const int32_t jk = static_cast<int32_t>(row / slots);
        const int32_t slot = static_cast<int32_t>(row % slots);
        row = static_cast<int32_t>(jk * slots) +
              ll_compact_slot(a, slot / T, d * El + jk, slot % T);
      }
      to[k] = row;
    }
  }
}

struct LowLatencyCombineArgs {
  int num_ranks, num_tokens, top_k, num_experts, hidden;
  const Bf16* y;              // [R, E/R, R*T, H]
  const int32_t* src_row;     // [R(expert side), R(source), T, K]
  const int32_t* clean_idx;   // [R, T, K]
  const float* topk_weights;  // [R, T, K]
  // Between devices: [R(home), T, K, H] in the symmetric buffer, where the send returns each
  // choice's row to its token's home. Null with virtual ranks: the receive reads y in place.
  Bf16* staging = nullptr;
  // Put views: [R(source), T, K, H], where ll_combine_stage copies the rows this rank returns,
  // in this rank's symmetric buffer (a put's source must lie there).
  Bf16* send_rows = nullptr;
  Bf16* out;                  // [R, T, H]
  int buffer = 0;  // between devices: which of the two low-latency regions (cuda/peer_ops.h)
  // Rank whose data sits at index 0 of the per-rank arrays that are not reached through Peers
  // (inputs, workspace, summaries): 0 with virtual ranks (all ranks here), this rank's own
  // number between GPUs (one rank here).
  int first_rank = 0;
  JAX_EP_HOST_DEVICE int64_t local(int rank) const { return rank - first_rank; }
};

// Combine send between devices, items (d, s*T + t): expert rank d returns the rows of token t
// of source s, one per choice it holds, to staging slot (t, k) of the home rank s; a put view
// from where ll_combine_stage copied them.
template <typename Peers>
JAX_EP_HOST_DEVICE void ll_combine_send(const LowLatencyCombineArgs& a, const Peers& peers, int d,
                                        int64_t src, int lane, int lanes) {
  const int R = a.num_ranks, T = a.num_tokens, K = a.top_k, H = a.hidden;
  const int El = a.num_experts / R;
  const int64_t slots = static_cast<int64_t>(R) * T;
  const int s = static_cast<int>(src / T);
  const int64_t t = src % T, bytes = 2 * static_cast<int64_t>(H);
  const int32_t* rows = a.src_row + (a.local(d) * slots + src) * K;
  for (int k = 0; k < K; ++k) {
    if (rows[k] < 0) continue;
    if constexpr (Peers::kPuts) {
      peers.put(a.staging + (t * K + k) * H, s,
                a.send_rows + ((a.local(d) * slots + src) * K + k) * H, bytes, lane, lanes);
    } else {
      const Bf16* y = a.y + a.local(d) * El * slots * H;
      copy_row(peers.at(a.staging, static_cast<int64_t>(T) * K * H, s) + (t * K + k) * H,
               y + static_cast<int64_t>(rows[k]) * H, bytes, lane, lanes);
    }
  }
}

// Put views, the stage before the combine send, items (d, s*T + t): the rows the send returns
// for token t of source s, copied into this rank's send area (see ll_stage).
JAX_EP_HOST_DEVICE void ll_combine_stage(const LowLatencyCombineArgs& a, int d, int64_t src,
                                         int lane, int lanes) {
  const int K = a.top_k, H = a.hidden;
  const int64_t slots = static_cast<int64_t>(a.num_ranks) * a.num_tokens;
  const int32_t* rows = a.src_row + (a.local(d) * slots + src) * K;
  const Bf16* y = a.y + a.local(d) * (a.num_experts / a.num_ranks) * slots * H;
  for (int k = 0; k < K; ++k) {
    if (rows[k] < 0) continue;
    copy_row(a.send_rows + ((a.local(d) * slots + src) * K + k) * H,
             y + static_cast<int64_t>(rows[k]) * H, 2 * static_cast<int64_t>(H), lane, lanes);
  }
}

// Combine receive, items (s, t * segments + g): segment g (ll_segment_cols) of the top-k
// weighted sum in k order, float32 from 0, to bf16, of the rows staged for token t of s or,
// with virtual ranks, of the expert rows in y (choice k's row is src_row[d][s*T + t][k] of its
// expert's rank d).
JAX_EP_HOST_DEVICE void ll_combine_token(const LowLatencyCombineArgs& a, int s, int64_t item,
                                         int lane, int lanes) {
  const int T = a.num_tokens, K = a.top_k, H = a.hidden, El = a.num_experts / a.num_ranks;
  int t = 0;
  const LlSegment seg = ll_segment(T, H, item, &t);
  const int64_t first = seg.first, n = seg.n;
  const int64_t slots = static_cast<int64_t>(a.num_ranks) * T;
  const int64_t here = a.local(s) * T + t, src = static_cast<int64_t>(s) * T + t;
  const int32_t* ids = a.clean_idx + here * K;
  const float* w = a.topk_weights + here * K;
  sum_rows(a.out + here * H + first, n, true, K,
           [&](Terms<Bf16>& terms, int k) {
             for (; k < K && !terms.full(); ++k) {
               const int32_t e = ids[k];
               if (e < 0) continue;
               int64_t row = here * K + k;
               const Bf16* rows = a.staging;
               if (!rows) {
                 const int d = e / El;
                 row = d * El * slots + a.src_row[(d * slots + src) * K + k];
                 rows = a.y;
               }
               terms.add(rows + row * H + first, w[k]);
             }
             return k;
           },
           lane, lanes);
}

}  // namespace jax_ep
