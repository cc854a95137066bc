// What the bodies of every op share (cuda/exchange.h): the peer views of virtual ranks
// (VirtualPeers) and the helpers that write through any view (PeerArray, store_to, own_copy);
// the row copies (Word, copy_row, zero_row); the fan of a source row to its destinations
// from one read (Fan); numbering by counter in one pass (Tally); and the counts' chunks
// (count_chunk and its tail), which normal and low-latency dispatch both start with. It
// includes no op's header.
#pragma once

#include <cstdint>
#include "cuda/meter.h"
#include "cuda/numerics.h"
#include "cuda/routing.h"

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

// `bytes` rounded up to whole Words: the size slots give a row and themselves, so that what
// follows stays aligned for any access.
JAX_EP_HOST_DEVICE int64_t word_padded(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Words each lane loads before it stores any: the loads of a copy that are in flight at once.
// The phases' copies keep 4 (their kernels fit 64 registers, 4 blocks per SM); a streaming
// launch has fewer warps, each with a channel's rows to move, and keeps 8 (cuda/channels.h).
constexpr int kWordsInFlight = 4;
constexpr int kStreamWordsInFlight = 8;

// Warps per block of the phase kernels (cuda/phases.cuh): the number of shared fan tables.
constexpr int kBlockWarps = 8;

// Calls f(i, u) for the indices i of the words [first, first + lanes * kWords) of a copy that
// lane `lane` moves (those below `words`), u = 0, 1, ... in each lane's order.
template <int kWords, typename F>
JAX_EP_HOST_DEVICE void each_word(int first, int words, int lane, int lanes, const F& f) {
  JAX_EP_UNROLL for (int u = 0; u < kWords; ++u) {
    const int i = first + u * lanes + lane;
    if (i < words) f(i, u);
  }
}

// The widest unit of a copy, 2^(this) bytes (16, 8, 4, 2 or 1), that `bits` (the OR of its
// addresses and its size) allows: every access of a copy is aligned to its own size, so none
// faults on a GPU (a misaligned access is a sticky error there, which x86 would hide). Slots
// pad their rows to 16 bytes (DispatchArgs::slot_row_bytes), so only a row of XLA's arrays
// whose size is not a multiple of 16 (bfloat16 with odd H: 2-byte units) is copied in
// narrower units.
JAX_EP_HOST_DEVICE int copy_shift(uintptr_t bits) {
  return (bits & 15u) == 0 ? 4 : (bits & 7u) == 0 ? 3 : (bits & 3u) == 0 ? 2 : bits & 1u ? 0 : 1;
}

// Unit i of 2^shift bytes (8, 4, 2 or 1) from s to d: the copies narrower than a Word.
JAX_EP_HOST_DEVICE void copy_unit_at(char* d, const char* s, int64_t i, int shift) {
  switch (shift) {
    case 3:
      reinterpret_cast<uint64_t*>(d)[i] = reinterpret_cast<const uint64_t*>(s)[i];
      break;
    case 2:
      reinterpret_cast<uint32_t*>(d)[i] = reinterpret_cast<const uint32_t*>(s)[i];
      break;
    case 1:
      reinterpret_cast<uint16_t*>(d)[i] = reinterpret_cast<const uint16_t*>(s)[i];
      break;
    default:
      d[i] = s[i];
  }
}

// Copies `bytes` from src to dst with `lanes` cooperating lanes, in the widest units the
// pointers and the size allow (copy_shift): 16-byte words, each lane loading kWords of them
// before storing any; narrower units one at a time (rows of unusual sizes only).
template <int kWords = kWordsInFlight>
JAX_EP_HOST_DEVICE void copy_row(void* dst, const void* src, int64_t bytes, int lane, int lanes) {
  if (lane == 0) meter_rows(bytes, bytes);
  const int shift = copy_shift(reinterpret_cast<uintptr_t>(dst) |
                               reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes));
  if (shift == 4) {
    Word* d = static_cast<Word*>(dst);
    const Word* s = static_cast<const Word*>(src);
    const int words = static_cast<int>(bytes / 16);  // a row holds fewer than 2^31 words
    for (int first = 0; first < words; first += lanes * kWords) {
      Word w[kWords];
      each_word<kWords>(first, words, lane, lanes, [&](int i, int u) { w[u] = s[i]; });
      each_word<kWords>(first, words, lane, lanes, [&](int i, int u) { d[i] = w[u]; });
    }
  } else {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    JAX_EP_NO_UNROLL for (int64_t i = lane; i < bytes >> shift; i += lanes) {
      copy_unit_at(d, s, i, shift);
    }
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
// fan. Like copy_row: 16-byte words when every pointer and the size allow (kWords loads per
// lane, then their stores to each destination), else the widest narrower unit. Every lane of
// the warp calls it with the same fan.
template <int kWords = kWordsInFlight>
JAX_EP_HOST_DEVICE void fan_out_row(Fan<char>& fan, const void* src, int64_t bytes, int lane,
                                    int lanes) {
  const int n = fan.size();
  if (n == 0) return;
  fan_sync();
  if (lane == 0) meter_rows(bytes, n * bytes);
  const int shift = copy_shift(reinterpret_cast<uintptr_t>(src) |
                               static_cast<uintptr_t>(bytes) | fan.address_bits());
  if (shift == 4) {
    const Word* s = static_cast<const Word*>(src);
    const int words = static_cast<int>(bytes / 16);  // a row holds fewer than 2^31 words
    for (int first = 0; first < words; first += lanes * kWords) {
      Word w[kWords];
      each_word<kWords>(first, words, lane, lanes, [&](int i, int u) { w[u] = s[i]; });
      JAX_EP_NO_UNROLL for (int j = 0; j < n; ++j) {
        Word* d = reinterpret_cast<Word*>(fan[j]);
        each_word<kWords>(first, words, lane, lanes, [&](int i, int u) { d[i] = w[u]; });
      }
    }
  } else {
    const char* s = static_cast<const char*>(src);
    JAX_EP_NO_UNROLL for (int64_t i = lane; i < bytes >> shift; i += lanes) {
      JAX_EP_NO_UNROLL for (int j = 0; j < n; ++j) copy_unit_at(fan[j], s, i, shift);
    }
  }
  fan_sync();  // every lane read the table before it is filled again
  fan.clear();
}

JAX_EP_HOST_DEVICE void zero_row(void* dst, int64_t bytes, int lane, int lanes) {
  if (lane == 0) meter_rows(0, bytes);
  char* d = static_cast<char*>(dst);
  const int shift = copy_shift(reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes));
  if (shift == 4) {
    Word* w = reinterpret_cast<Word*>(d);
    for (int64_t i = lane; i < bytes / 16; i += lanes) w[i] = Word{{0, 0, 0, 0}};
  } else {
    JAX_EP_NO_UNROLL for (int64_t i = lane; i < bytes >> shift; i += lanes) {
      switch (shift) {
        case 3: reinterpret_cast<uint64_t*>(d)[i] = 0; break;
        case 2: reinterpret_cast<uint32_t*>(d)[i] = 0; break;
        case 1: reinterpret_cast<uint16_t*>(d)[i] = 0; break;
        default: d[i] = 0;
      }
    }
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

}  // namespace jax_ep
