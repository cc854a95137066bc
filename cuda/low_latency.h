// Low-latency dispatch and combine's bodies (cuda/exchange.h): rows cut into column
// segments, LowLatencyArgs and its workspace, the count or the send's own numbering, the
// send (casting to the wire formats, cuda/cast.h), its stage over puts and the finish, then
// LowLatencyCombineArgs, the combine's send and its sums. It includes the casts, the ordered
// sums and the wire formats.
#pragma once

#include <cstdint>
#include "cuda/cast.h"
#include "cuda/sums.h"
#include "cuda/wire.h"

namespace jax_ep {

// Low-latency rows are split into column segments, one warp each: at decode sizes a rank's
// tokens alone are too few warps to fill a GPU (T = 128: 128 warps, where an H100 wants 528),
// so a row is cut into segments of whole 128-channel blocks, enough that T tokens give
// kLlWarps warps per rank. ll_segment_cols: the columns of each segment but the last. An
// nvfp4 row's global scale needs the whole row's amax: each of its segments' warps reads the
// whole row for it (cast_rows), the same in each, a read of the row per segment more, so
// its send cuts the rows of its launch, not of a rank (LowLatencyArgs::send_cut_rows).
constexpr int kLlWarps = 1024;
JAX_EP_HOST_DEVICE int ll_segment_cols(int num_tokens, int hidden) {
  if (hidden % kFp8Block != 0 || num_tokens <= 0) return hidden > 0 ? hidden : 1;
  const int blocks = hidden / kFp8Block;
  const int wanted = (kLlWarps + num_tokens - 1) / num_tokens;
  const int segments = wanted < blocks ? wanted : blocks;
  return (blocks + segments - 1) / segments * kFp8Block;
}
// Items of a low-latency phase over rows cut for `cut_rows` rows (ll_segment_cols): every
// segment of every token of a rank.
JAX_EP_HOST_DEVICE int64_t ll_row_items(int num_tokens, int hidden, int cut_rows) {
  const int cols = ll_segment_cols(cut_rows, hidden);
  return static_cast<int64_t>(num_tokens) * ((hidden + cols - 1) / cols);
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
  // The rows the send cuts into segments (ll_segment_cols) in format `format`: a rank's
  // tokens, but nvfp4's the launch's rows (with virtual ranks every rank's, which alone fill
  // the GPU; between devices a rank's), since each more segment of an nvfp4 row reads it
  // once more. The kernels call it for nvfp4 only and pass their own token count otherwise:
  // the bf16 send between GPUs sits at Hopper's 64 registers, and any other spelling of the
  // same count (this call, or an if-constexpr helper returning num_tokens) spills 8 bytes.
  JAX_EP_HOST_DEVICE int send_cut_rows(int format) const {
    return format == kWireNvfp4 && !per_source_slots ? num_ranks * num_tokens : num_tokens;
  }
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

// Item t * segments + g of a low-latency phase over rows: its token t and segment g.
JAX_EP_HOST_DEVICE RowSegment ll_segment(int cut_rows, int hidden, int64_t item, int* t,
                                        int wire = kWireBf16) {
  const int cols = ll_segment_cols(cut_rows, hidden);
  const int segments = (hidden + cols - 1) / cols;
  *t = static_cast<int>(item / segments);
  const int first = static_cast<int>(item % segments) * cols;
  return RowSegment{first, hidden - first < cols ? hidden - first : cols, wire, hidden};
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
// offsets, `token`: its row): once to each expert it chose, as
// bf16 or cast to FP8 (one loop nest per case: in one, the two cases hold more registers). A
// put view sends, instead, the segment ll_stage left in the send area, one put per message.
template <int kWire, typename Peers>
JAX_EP_HOST_DEVICE void ll_send_rows(const LowLatencyArgs& a, const Peers& peers, int s, int t,
                                     const int32_t* ids, const ChoiceSlots& slots,
                                     const Bf16* token, const RowSegment& seg, int lane,
                                     int lanes) {
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
        cast_rows<kWire>(token, seg, rows, scales, lane, lanes);
      } else {
        fan_out_row(rows, token + seg.first, seg.bytes(), lane, lanes);
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
  const int cut = kWire == kWireNvfp4 ? a.send_cut_rows(kWire) : a.num_tokens;
  const RowSegment seg = ll_segment(cut, a.hidden, item, &t, kWire);
  const int64_t here = a.local(s) * a.num_tokens + t, row_bytes = a.row_bytes();
  const Bf16* token = a.x + here * a.hidden;
  Fan<char> rows(0);
  Fan<char> scales(1);
  rows.add(a.send_x + here * row_bytes + seg.byte());
  if constexpr (kWire != kWireBf16) {
    scales.add(reinterpret_cast<char*>(a.send_scales) + here * 4 * a.scale_words() +
               seg.scale_byte());
    cast_rows<kWire>(token, seg, rows, scales, lane, lanes);
  } else {
    fan_out_row(rows, token + seg.first, seg.bytes(), lane, lanes);
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
  return ll_send_counters(a) + ll_row_items(a.num_tokens, a.hidden, a.send_cut_rows(a.wire));
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
  const int cut = kWire == kWireNvfp4 ? a.send_cut_rows(kWire) : T;
  const RowSegment seg = ll_segment(cut, a.hidden, item, &t, kWire);
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
  ll_send_rows<kWire>(a, peers, s, t, ids, offsets, a.x + here * a.hidden, seg, lane, lanes);
}

// Warps per (local expert, source) pair of the low-latency receive (ll_finish): each moves
// every W-th of the pair's messages, so that the receive's copying items, E/R x R x W per
// receiver, are about twice the messages a receiver gets on average (T*K over its E/R x R
// pairs); a pair holds at most T messages (a source's tokens, each once).
JAX_EP_HOST_DEVICE int ll_finish_pair_warps(int num_tokens, int top_k, int num_experts) {
  const int64_t w = (2 * int64_t{num_tokens} * top_k + num_experts - 1) / num_experts;
  return w < 1 ? 1 : w > num_tokens ? num_tokens : static_cast<int>(w);
}
// The receive's items per receiver: the pairs' warps, then one per 32 tokens of the group
// (their src_row, a token per lane).
JAX_EP_HOST_DEVICE int64_t ll_finish_copies(const LowLatencyArgs& a) {
  return int64_t{a.num_experts} * ll_finish_pair_warps(a.num_tokens, a.top_k, a.num_experts);
}
JAX_EP_HOST_DEVICE int64_t ll_finish_items(const LowLatencyArgs& a) {
  return ll_finish_copies(a) + (a.slots() + 31) / 32;
}

// Phase 3 (the receive, between devices; with every rank here the send delivers), items
// (d, p) of receiver d. p < ll_finish_copies: warp w of the pair (local expert j, source q),
// p = (j * R + q) * W + w, moves the pair's messages w, w + W, ... from their per-source
// slots in the symmetric buffer to their compact slots in XLA's results (after the messages
// of lower sources): the items follow the messages, not the slots (most of which are empty at
// decode sizes). Rows past an expert's count are left as they are (docs/contract.md,
// "Padding"); warp 0 of source 0's pair writes the expert's count. The other items compact
// src_row, a token per lane.
template <typename Peers>
JAX_EP_HOST_DEVICE void ll_finish(const LowLatencyArgs& a, const Peers& peers, int d, int64_t p,
                                  int lane, int lanes) {
  const int R = a.num_ranks, T = a.num_tokens, E = a.num_experts, El = a.experts_per_rank();
  const int64_t slots = a.slots(), copies = ll_finish_copies(a);
  if (p >= copies) {  // the choices of tokens (p - copies) * lanes + lane, ...
    const int K = a.top_k;
    const int32_t* sent = own_copy(peers, a.src_row, slots * K, d);
    const int64_t step = (ll_finish_items(a) - copies) * lanes;
    for (int64_t r = (p - copies) * lanes + lane; r < slots; r += step) {
      int32_t* out = a.out_src_row + (a.local(d) * slots + r) * K;
      for (int k = 0; k < K; ++k) {
        int32_t row = sent[r * K + k];
        if (row >= 0) {
          const int32_t jk = static_cast<int32_t>(row / slots);
          const int32_t slot = static_cast<int32_t>(row % slots);
          row = static_cast<int32_t>(jk * slots) +
                ll_compact_slot(a, slot / T, d * El + jk, slot % T);
        }
        out[k] = row;
      }
    }
    return;
  }
  const int W = ll_finish_pair_warps(T, a.top_k, E);
  const int w = static_cast<int>(p % W), q = static_cast<int>(p / W % R);
  const int j = static_cast<int>(p / W / R), e = d * El + j;
  int32_t before = 0, total = 0;  // the expert's messages from sources below q, and from all
  for (int r = 0; r < R; ++r) {
    const int32_t c = a.counts[static_cast<int64_t>(r) * E + e];
    before += r < q ? c : 0;
    total += c;
  }
  if (lane == 0 && q == 0 && w == 0) a.count[a.local(d) * El + j] = total;
  const int32_t mine = a.counts[static_cast<int64_t>(q) * E + e];
  const int64_t from = j * slots + static_cast<int64_t>(q) * T;  // the pair's first slot
  const int64_t to = a.local(d) * El * slots + j * slots + before;
  const int64_t bytes = a.row_bytes(), S = a.scale_words();
  const char* x = own_copy(peers, static_cast<const char*>(a.recv_x), El * slots * bytes, d);
  for (int32_t n = w; n < mine; n += W) {
    copy_row(static_cast<char*>(a.out_x) + (to + n) * bytes, x + (from + n) * bytes, bytes,
             lane, lanes);
  }
  if (S == 0) return;
  const float* scales = own_copy(peers, static_cast<const float*>(a.recv_scales), El * slots * S, d);
  for (int32_t n = w; n < mine; n += W) {
    copy_row(a.out_scales + (to + n) * S, scales + (from + n) * S, S * 4, lane, lanes);
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
  const RowSegment seg = ll_segment(T, H, item, &t);
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
