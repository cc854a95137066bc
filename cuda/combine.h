// Normal combine's bodies (cuda/exchange.h): CombineArgs, the stages between devices
// (rank-major rows, expert-major partial sums, the return over puts) and the sums of each
// token over the receivers in rank order; with a wire format (kCast), the stages cast the rows
// they stage and the sums dequantize them. It includes the ordered sums and the rings its
// arguments name.
#pragma once

#include <cstdint>
#include <type_traits>
#include "cuda/channels.h"
#include "cuda/sums.h"

namespace jax_ep {

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
  // Between devices, bfloat16 y: the format the rows travel home in (cuda/wire.h;
  // docs/contract.md, combine's wire_format). Each receiver's float32 row of a token (the
  // weighted row, expert-major the partial sum) is cast where it is staged, in the room of a
  // row of y (a row in any format is smaller), and the home sums the rows dequantized.
  // kWireBf16: the rows travel as T.
  int wire = kWireBf16;
  JAX_EP_HOST_DEVICE int64_t row_bytes() const {  // of a staged (returned, streamed) row
    return wire != kWireBf16 ? wire_row_bytes(wire, hidden)
                             : hidden * static_cast<int64_t>(sizeof(T));
  }
  // Rank whose data sits at index 0 of the per-rank arrays that are not reached through Peers
  // (inputs, workspace, summaries): 0 with virtual ranks (all ranks here), this rank's own
  // number between GPUs (one rank here).
  int first_rank = 0;
  JAX_EP_HOST_DEVICE int64_t local(int rank) const { return rank - first_rank; }
};

// kCast: the bytes a cast of a row formed from `terms` rows of y moves (nvfp4 reads them
// twice, the first time for the row's amax), metered by lane 0.
template <typename T>
JAX_EP_HOST_DEVICE void meter_cast(const CombineArgs<T>& a, int64_t terms) {
  const int64_t reads = a.wire == kWireNvfp4 ? 2 : 1;
  meter_rows(reads * terms * a.hidden * static_cast<int64_t>(sizeof(T)), a.row_bytes());
}

// kCast, rank-major: row x of y times its weight (*weight; none: unweighted), in float32,
// cast to the wire format at `out`.
template <typename T>
JAX_EP_HOST_DEVICE void cast_weighted_row(const CombineArgs<T>& a, const T* x,
                                          const float* weight, char* out, int lane, int lanes) {
  static_assert(std::is_same_v<T, Bf16>, "the combine casts bfloat16 rows");
  const float w = weight ? *weight : 1.0f;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  cast_values(a.wire,
              [&](int part, float (&v)[kCastChannels]) {
                const Word p = load_part(x, part, true, aligned);
                JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) {
                  v[i] = weight ? mul_rn(channel_of(p, i), w) : channel_of(p, i);
                }
              },
              a.hidden, out, lane, lanes);
}

// The sum of one token's rows at its home (out), in rank order: sum_rows of rows of T
// (weighted when `weighted`), or, kCast, sum_wire_rows of the rows in the wire format (their
// weights applied before the cast). `collect` as sum_rows's.
template <bool kCast, typename T, typename Collect>
JAX_EP_HOST_DEVICE void combine_sum(const CombineArgs<T>& a, T* out, bool weighted, int end,
                                    const Collect& collect, int lane, int lanes) {
  if constexpr (kCast) {
    sum_wire_rows(a.wire, out, a.hidden, end, collect, lane, lanes);
  } else {
    sum_rows(out, a.hidden, weighted, end, collect, lane, lanes);
  }
}

// Between devices, expert-major, items (d, src) for src in [0, R*T): receiver d stages where
// token src sits and, if it has a row, the row's partial sum, where its home reads it: the
// row's entries in sorted order, each times its weight, in float32 from 0, stored in y's type
// or, kCast, cast to the wire format. One row per token and receiver crosses to the home, not
// one per entry.
template <bool kCast, typename T>
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
  if constexpr (kCast) {
    static_assert(std::is_same_v<T, Bf16>, "the combine casts bfloat16 rows");
    if (lane == 0) {
      int64_t count = 0;
      for (int k = 0; k < K; ++k) count += entries[k] >= 0;
      meter_cast(a, count);
    }
    const bool aligned = ((reinterpret_cast<uintptr_t>(y) | H * sizeof(T)) & 15u) == 0;
    cast_values(a.wire,
                [&](int part, float (&v)[kCastChannels]) {
                  JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) v[i] = 0.0f;
                  for (int k = 0; k < K; ++k) {
                    const int32_t e = entries[k];
                    if (e < 0) continue;
                    const Word p = load_part(y + static_cast<int64_t>(e) * H, part, true, aligned);
                    JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) {
                      const float x = channel_of(p, i);
                      v[i] = add_rn(v[i], w ? mul_rn(x, w[e]) : x);
                    }
                  }
                },
                a.hidden, reinterpret_cast<char*>(a.partial + row * H), lane, lanes);
    return;
  }
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
// them, or, kCast, the row times its weight cast to the wire format. Only the rows that carry
// data leave y (docs/contract.md, "Padding").
template <bool kCast, typename T>
JAX_EP_HOST_DEVICE void combine_stage(const CombineArgs<T>& a, int d, int64_t src, int lane,
                                      int lanes) {
  const int64_t rows = static_cast<int64_t>(a.num_ranks) * a.num_tokens, H = a.hidden;
  const int32_t row = a.src_row[a.local(d) * rows + src];
  if (lane == 0) a.staged.src_row[src] = row;
  if (row < 0) return;
  const int64_t at = a.local(d) * a.capacity + row;
  if constexpr (kCast) {
    if (lane == 0) meter_cast(a, 1);
    cast_weighted_row(a, a.y + at * H, a.weights ? a.weights + at : nullptr,
                      reinterpret_cast<char*>(a.staged.y + row * H), lane, lanes);
    return;
  }
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
  peers.put(a.returned.rows + slot * H, s, from, a.row_bytes(), lane, lanes);
  if (lane == 0 && !a.expert_major && a.weights) {  // none with a wire format
    store_to(peers, a.returned.weights, 0, s, slot, a.weights[row]);
  }
}

// Items (s, t): home rank s sums token t's rows over the receivers in rank order: rank-major,
// each receiver's row of y times its weight; between devices expert-major, each receiver's
// partial sum of the row (combine_partial); over puts, the rows the receivers returned here;
// kCast, those rows in the wire format (combine_sum). Expert-major with virtual ranks:
// combine_token_entries.
template <bool kCast, typename T, typename Peers>
JAX_EP_HOST_DEVICE void combine_token(const CombineArgs<T>& a, const Peers& peers, int s, int t,
                                      int lane, int lanes) {
  const int R = a.num_ranks, Tn = a.num_tokens;
  const int64_t src = static_cast<int64_t>(s) * Tn + t, H = a.hidden;
  T* out = a.out + (a.local(s) * Tn + t) * H;
  if constexpr (Peers::kPuts) {
    const bool weighted = !a.expert_major && a.weights;
    auto collect = [&](Terms<T>& terms, int d) {
      for (; d < R && !terms.full(); ++d) {
        const int64_t slot = static_cast<int64_t>(d) * Tn + t;
        if (a.returned.row[slot] < 0) continue;
        terms.add(a.returned.rows + slot * H, weighted ? a.returned.weights[slot] : 0.0f);
      }
      return d;
    };
    combine_sum<kCast>(a, out, weighted, R, collect, lane, lanes);
  } else {
    const int64_t rows = static_cast<int64_t>(R) * Tn;
    const bool em = a.expert_major;
    const T* base = em ? a.partial : a.y;
    const int64_t rows_per_rank = em ? rows : a.capacity;
    const float* weights = em ? nullptr : a.weights;
    auto collect = [&](Terms<T>& terms, int d) {
      for (; d < R && !terms.full(); ++d) {
        const int32_t row = peers.at(a.src_row, rows, d)[src];
        if (row < 0) continue;  // adding +0.0 would change nothing
        terms.add(peers.at(base, rows_per_rank * H, d) + static_cast<int64_t>(row) * H,
                  weights ? peers.at(weights, rows_per_rank, d)[row] : 0.0f);
      }
      return d;
    };
    combine_sum<kCast>(a, out, weights != nullptr, R, collect, lane, lanes);
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

}  // namespace jax_ep
