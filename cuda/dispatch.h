// Normal dispatch's bodies (cuda/exchange.h): DispatchArgs and its workspace, the count
// (phase 1) and its tail, the send (phase 2) with its metadata, the stage over puts, the
// node-aware relay, and the finish (phase 3) that copies the rows out to XLA's results. It
// includes the shared primitives, the casts to the wire formats (cuda/cast.h) and the rings
// its arguments name (cuda/channels.h).
#pragma once

#include <cstdint>
#include "cuda/cast.h"
#include "cuda/channels.h"
#include "cuda/primitives.h"

namespace jax_ep {

struct DispatchArgs {
  int num_ranks;    // R
  int num_tokens;   // T per rank
  int top_k;        // K
  int num_experts;  // E
  int capacity;     // rows (rank-major) or entries (expert-major) per receiver
  bool expert_major;
  // Expert-major: the capacity keeps the first entries by source, then local expert
  // (drop_order="source"), instead of the first in the layout's order.
  bool drop_by_source = false;
  int64_t row_bytes;   // bytes of one token row as it travels (x's, or the wire format's)
  int64_t scale_cols;  // float32 scales per row (0 without FP8)
  // The send casts x's bfloat16 rows of `hidden` channels to this wire format (cuda/wire.h)
  // as it writes them (cast_rows): row_bytes and scale_cols are then the format's data bytes
  // and scale words, x has no scales, and every slot from there on holds the bytes of
  // jax_ep.quant.to_rows, as when the quantized rows are dispatched. kWireBf16: x's rows and
  // scales travel as they are.
  int wire = kWireBf16;
  int hidden = 0;
  // With a wire format, the finish (streamed: the receivers) dequantizes each row into XLA's
  // x, bfloat16 [capacity, hidden] without scales (dequantize_row: the bits of
  // jax_ep.quant.dequantize), reading the row once as it travelled: no dequantization pass.
  bool dequantize = false;

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
  int32_t* entry_kept;    // [R, E]: entries of source s for expert e the capacity keeps
  int32_t* expert_kept;   // [R, E/R]: entries of each local expert of receiver d kept
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
  // A row of XLA's x in bytes, and of its scales in words (dequantize: bfloat16, no scales).
  JAX_EP_HOST_DEVICE int64_t result_row_bytes() const {
    return dequantize ? 2 * int64_t{hidden} : row_bytes;
  }
  JAX_EP_HOST_DEVICE int64_t result_scale_cols() const { return dequantize ? 0 : scale_cols; }
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
  // Bytes of the row part of a slot (packed, ring and relay slots): the row, padded to 16, so
  // that the scales and metadata after it are aligned for their loads and stores, and the
  // row copies move 16-byte words, whatever the row's size (bfloat16 with odd H).
  JAX_EP_HOST_DEVICE int64_t slot_row_bytes() const { return word_padded(row_bytes); }
  // Bytes of a packed slot: the row part, its scales, its metadata, rounded up to 16.
  JAX_EP_HOST_DEVICE int64_t packed_slot() const {
    return word_padded(slot_row_bytes() + 4 * (scale_cols + 1 + 2 * int64_t{top_k}));
  }
  // Bytes of a ring slot: the row part, its scales, its source, its row on the receiver, the
  // token's K ids and K weights, rounded up to 16 (dispatch_stream.h).
  JAX_EP_HOST_DEVICE int64_t ring_slot() const {
    return word_padded(slot_row_bytes() + 4 * (scale_cols + 2 + 2 * int64_t{top_k}));
  }
  // Bytes of a relay ring's slot: a ring slot's and the targets() (receiver, row) pairs in
  // the relay's node, rounded up to 16.
  JAX_EP_HOST_DEVICE int64_t relay_slot() const {
    return word_padded(slot_row_bytes() +
                       4 * (scale_cols + 2 + 2 * int64_t{top_k} + 2 * targets()));
  }
  // Bytes from one row to the next in the receive, send and relay areas.
  JAX_EP_HOST_DEVICE int64_t row_stride() const { return packed ? packed_slot() : row_bytes; }
  // Source s's token t in x, bfloat16, when the send casts (wire).
  JAX_EP_HOST_DEVICE const Bf16* bf16_row(int s, int t) const {
    return reinterpret_cast<const Bf16*>(x) + (local(s) * num_tokens + t) * hidden;
  }
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
  int32_t* src = reinterpret_cast<int32_t*>(slot + a.slot_row_bytes()) + a.scale_cols;
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
// this call that are not reached through Peers (chunk_counts to expert_kept). Returns its
// length; with `work`, points a's arrays into it. a's shape fields must be set; sets its
// chunk fields.
inline int64_t carve_dispatch_workspace(DispatchArgs* a, int64_t V, int32_t* work = nullptr) {
  const int64_t R = a->num_ranks, T = a->num_tokens, K = a->top_k, E = a->num_experts;
  a->chunk_shift = count_chunk_shift(a->top_k);
  a->num_chunks = count_chunks(a->num_tokens, a->top_k);
  int32_t** parts[] = {&a->counts,     &a->chunk_counts, &a->token_offset, &a->entry_offset,
                       &a->row_base,   &a->source_base,  &a->entry_base,   &a->entry_kept,
                       &a->expert_kept};
  const int64_t sizes[] = {R * (R + E), V * a->num_chunks * (R + E + 1), V * T * R, V * T * K,
                           V * R,       V * R,                           V * E,     V * E,
                           V * (E / R)};
  int64_t used = 0;
  for (int i = 0; i < 9; ++i) {
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

// Expert-major: f(s, g, kept) for each source s and expert g of rank d, in the order in which
// the capacity keeps d's entries (by expert, then source; drop_by_source, by source, then
// expert): `kept` of the entries of (s, g) fit. O(R * E/R) from the counts.
template <typename F>
JAX_EP_HOST_DEVICE void for_kept(const DispatchArgs& a, int d, const F& f) {
  const int R = a.num_ranks, El = a.experts_per_rank(), n = a.num_counters();
  const bool by_source = a.drop_by_source;
  int64_t before = 0;
  for (int i = 0; i < (by_source ? R : El); ++i) {
    for (int j = 0; j < (by_source ? El : R); ++j) {
      const int s = by_source ? i : j, g = d * El + (by_source ? j : i);
      const int32_t count = a.counts[static_cast<int64_t>(s) * n + R + g];
      const int64_t room = a.capacity - before;
      f(s, g, room <= 0 ? 0 : room < count ? static_cast<int32_t>(room) : count);
      before += count;
    }
  }
}

// Expert-major, the count tail's item for expert e: for each source s of [first, first +
// ranks), where its kept entries of e start on e's rank d (after the kept entries of d's
// lower experts, then those of e from lower sources) and how many are kept; when d is one of
// them, the entries of e kept there.
JAX_EP_HOST_DEVICE void dispatch_entry_bases(const DispatchArgs& a, int first, int ranks,
                                             int e) {
  const int El = a.experts_per_rank(), d = e / El;
  int32_t lower = 0, total = 0;
  for_kept(a, d, [&](int, int g, int32_t kept) { lower += g < e ? kept : 0; });
  for_kept(a, d, [&](int s, int g, int32_t kept) {
    if (g != e) return;
    if (s >= first && s < first + ranks) {
      a.entry_base[a.local(s) * a.num_experts + e] = lower + total;
      a.entry_kept[a.local(s) * a.num_experts + e] = kept;
    }
    total += kept;
  });
  if (d >= first && d < first + ranks) a.expert_kept[a.local(d) * El + e - d * El] = total;
}

// The count phase's tail (run once every source's counts are here), items c in [0, R + E):
// where the sources [first, first + ranks) start writing for counter c. c < R: their first
// rank-major row on rank c and, when c is one of them, where every source starts on c (for
// its finish's src_row). c >= R (expert-major only): their first entry position for expert
// e = c - R on e's rank (entries of lower local experts of that rank first, then those of e
// from lower source ranks).
JAX_EP_HOST_DEVICE void dispatch_bases(const DispatchArgs& a, int first, int ranks, int c) {
  const int R = a.num_ranks, n = a.num_counters();
  if (c >= R) {
    if (a.expert_major) dispatch_entry_bases(a, first, ranks, c - R);
    return;
  }
  int32_t base = 0;
  const bool receiver_here = c >= first && c < first + ranks;
  for (int q = 0; q < (receiver_here ? R : first + ranks); ++q) {
    if (receiver_here) a.source_base[a.local(c) * R + q] = base;
    if (q >= first && q < first + ranks) a.row_base[a.local(q) * R + c] = base;
    base += a.counts[static_cast<int64_t>(q) * n + c];
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

// The candidates of a token's rows: the receivers (rank-major) or its choices (expert-major);
// candidate c's receiver, and the row (entry) it keeps there, or -1 (not sent, or cut by the
// capacity).
JAX_EP_HOST_DEVICE int dispatch_candidates(const DispatchArgs& a) {
  return a.expert_major ? a.top_k : a.num_ranks;
}
JAX_EP_HOST_DEVICE int dispatch_receiver(const DispatchArgs& a, const int32_t* ids, int c) {
  return a.expert_major ? ids[c] / a.experts_per_rank() : c;
}
// Expert-major: the entry of the token's choice k on its expert's rank when the capacity
// keeps it, else -1: its place among its source's entries of that expert, if one of the kept
// ones, after where they start. ids[k] must be a choice.
JAX_EP_HOST_DEVICE int32_t kept_entry(const DispatchArgs& a, const int32_t* ids, int s, int t,
                                      int k) {
  const int64_t here = a.local(s) * a.num_tokens + t;
  const int32_t place = a.chunks_before(s, t)[a.num_ranks + ids[k]] +
                        a.entry_offset[here * a.top_k + k];
  const int64_t group = a.local(s) * a.num_experts + ids[k];  // (source, expert)
  return place < a.entry_kept[group] ? a.entry_base[group] + place : -1;
}
JAX_EP_HOST_DEVICE int32_t dispatch_row_at(const DispatchArgs& a, const int32_t* ids, int s,
                                           int t, int c, int d) {
  if (a.expert_major) return ids[c] >= 0 ? kept_entry(a, ids, s, t, c) : -1;
  const int32_t at = rank_major_row(a, ids, s, t, d);
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

// A store view's send when it casts (wire): token t of source s read once per kFanOut rows
// (entries) it keeps, cast to the wire format with its scale words into each (cast_rows).
template <int kWire, typename Peers>
JAX_EP_HOST_DEVICE void dispatch_cast_out(const DispatchArgs& a, const Peers& peers,
                                          const int32_t* ids, int s, int t, int lane,
                                          int lanes) {
  const int candidates = dispatch_candidates(a);
  const int64_t bytes = a.row_bytes, scale_row = 4 * a.scale_cols, cap = a.capacity;
  char* const scale_base = reinterpret_cast<char*>(a.recv_scales);
  Fan<char> rows(0);
  Fan<char> scales(1);
  for (int c = 0; c < candidates;) {
    for (; c < candidates && !rows.full(); ++c) {
      const int d = dispatch_receiver(a, ids, c);
      const int32_t at = dispatch_row_at(a, ids, s, t, c, d);
      if (at < 0) continue;
      rows.add(peers.at(a.recv_x, cap * bytes, d) + at * bytes);
      scales.add(peers.at(scale_base, cap * scale_row, d) + at * scale_row);
    }
    cast_rows<kWire>(a.bf16_row(s, t), whole_row(kWire, a.hidden), rows, scales, lane, lanes);
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
  const int32_t pos = kept_entry(a, ids, s, t, k);
  const bool kept = pos >= 0;
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
           static_cast<int64_t>(row) * K + rank, pos);
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
// relay. kWire: a store view's send casts the rows (over puts the stage has cast them).
template <int kWire, typename Peers>
JAX_EP_HOST_DEVICE void dispatch_send(const DispatchArgs& a, const Peers& peers, int s, int t,
                                      int lane, int lanes) {
  static_assert(kWire == kWireBf16 || !Peers::kPuts, "over puts, dispatch_stage casts");
  if constexpr (!Peers::kPuts) dispatch_send_metadata(a, peers, s, t, lane, lanes);
  const int64_t here = a.local(s) * a.num_tokens + t;
  const int32_t* ids = a.route(s, t);
  if constexpr (kWire != kWireBf16) {
    dispatch_cast_out<kWire>(a, peers, ids, s, t, lane, lanes);
    return;
  }
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

// Put views, the stage before the send, items (s, t): token t's row and scales, copied (or,
// kWire, cast) into this rank's send area, where the send's puts read them (see ll_stage);
// rank-major, with its metadata into the same slot (packed), expert-major, its metadata put
// into the receivers (here, so that the NVSHMEM code of the small puts and that of the rows'
// puts do not share one kernel's registers).
template <int kWire, typename Peers>
JAX_EP_HOST_DEVICE void dispatch_stage(const DispatchArgs& a, const Peers& peers, int s, int t,
                                       int lane, int lanes) {
  const int64_t here = a.local(s) * a.num_tokens + t, S = a.scale_cols, K = a.top_k;
  char* row = a.send_x + here * a.row_stride();
  float* scales = a.packed ? reinterpret_cast<float*>(row + a.slot_row_bytes())
                           : a.send_scales + here * S;
  if constexpr (kWire != kWireBf16) {
    Fan<char> rows(0);
    Fan<char> scale_rows(1);
    rows.add(row);
    scale_rows.add(reinterpret_cast<char*>(scales));
    cast_rows<kWire>(a.bf16_row(s, t), whole_row(kWire, a.hidden), rows, scale_rows, lane,
                     lanes);
  } else {
    copy_row(row, a.x + here * a.row_bytes, a.row_bytes, lane, lanes);
    if (S > 0) copy_row(scales, a.scales + here * S, S * 4, lane, lanes);
  }
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
// kDequantize: XLA's rows are bfloat16 (DispatchArgs::dequantize), the rows that move
// dequantized into them.
template <bool kDequantize, typename Peers>
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
    if constexpr (kDequantize) {
      const int64_t H = a.hidden;
      Bf16* to = reinterpret_cast<Bf16*>(x.moves ? o.x + ld * cap * a.result_row_bytes() : x.to) +
                 i * H;
      if (i < kept && x.moves) {
        const char* from = x.sent + i * (packed ? a.packed_slot() : a.row_bytes);
        const char* from_scales = packed ? from + a.slot_row_bytes()
                                         : reinterpret_cast<const char*>(scales.sent + i * S);
        dequantize_row(a.wire, from, from_scales, a.hidden, to, lane, lanes);
      }
      if (i >= kept && a.zero_padding) zero_row(to, 2 * H, lane, lanes);
    } else if (i < kept && x.moves) {
      // Packed, the row and its scales are in slot i (x.sent: this rank's receive area).
      const char* from = x.sent + i * (packed ? a.packed_slot() : a.row_bytes);
      copy_row(x.to + i * a.row_bytes, from, a.row_bytes, lane, lanes);
      copy_row(scales.to + i * S,
               packed ? reinterpret_cast<const float*>(from + a.slot_row_bytes())
                      : scales.sent + i * S,
               S * 4, lane, lanes);
    }
    if (!kDequantize && i >= kept && a.zero_padding) {
      zero_row(x.to + i * a.row_bytes, a.row_bytes, lane, lanes);
      zero_row(scales.to + i * S, S * 4, lane, lanes);
    }
  }
  // Where each token of the group landed on d (src_row): a search among its source's rows,
  // each lane its own token (tokens i * lanes + lane), so that a warp runs 32 at once.
  const int64_t tokens = int64_t{R} * a.num_tokens, t = int64_t{i} * lanes + lane;
  if (t < tokens) {
    int32_t* src_row = o.src_row ? o.src_row + ld * tokens : a.src_row + ld * tokens;
    src_row[t] = dispatch_src_row(a, peers, d, static_cast<int>(t / a.num_tokens),
                                  static_cast<int>(t % a.num_tokens));
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
  if (i < El) {
    int32_t count = 0;
    if (a.expert_major) {  // entries of expert i kept under the capacity
      count = a.expert_kept[a.local(d) * El + i];
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

}  // namespace jax_ep
