// Rows along a dispatch's routing: `jax_ep.dispatch(x2, handle=h)` and combine's backward send
// another [T, W] array per rank where the dispatch that made the handle put its tokens' rows,
// without counting again. Each receiver knows where every one of its rows comes from (the
// handle's recv_src: source rank s and token t as s * T + t; expert-major, entry_row first
// finds an entry's row), so it pulls: result slot j gets row t of rank s's array, or zeros
// where the slot holds no row.
//
// With virtual ranks every rank's array is in the call: one launch reads the rows where they
// are. Between devices a peer cannot read the buffers XLA owns, so each rank first copies its
// array into its symmetric buffer (the stage) and meets its peers, then every receiver copies
// its rows from the sources' stages with loads: two launches, no count, and each delivered row
// read once from the stage and written once. Loads need a store view of the peers: over puts
// (between nodes) the op is not offered, and jax_ep runs the dispatch again instead
// (jax_ep/backends/cuda.py).
#pragma once

#include <cstdint>

#include "cuda/primitives.h"

namespace jax_ep {

struct RowsArgs {
  int num_ranks, num_tokens;
  int capacity;       // result slots per rank: the dispatch's rows (entries, expert-major)
  int64_t num_rows;   // recv_src's rows per rank: capacity, or R*T expert-major
  int64_t row_bytes;  // bytes of one row of x
  bool expert_major;
  const char* x;             // [R, T, row_bytes]
  const int32_t* recv_src;   // [R, num_rows]: s * T + t, or -1
  const int32_t* entry_row;  // [R, capacity] expert-major (a slot's row, or -1), else null
  char* out;                 // [R, capacity, row_bytes]
  // Between devices: this rank's copy of x in its symmetric buffer; null with virtual ranks.
  char* stage = nullptr;
  int first_rank = 0;  // the rank at index 0 of the per-rank arrays (peer_ops.h, as the others)
};

// Between devices, items t < T: x's row t into this rank's stage.
struct RowsStage {
  static constexpr bool kCopy = true;
  RowsArgs a;
  JAX_EP_HOST_DEVICE void operator()(int, int64_t t, int lane, int lanes) const {
    copy_row(a.stage + t * a.row_bytes, a.x + t * a.row_bytes, a.row_bytes, lane, lanes);
  }
};

// Items (rank, j < capacity): result slot j of `rank`, from the source's stage (between
// devices) or its x (virtual ranks), reached through `peers` (a store view).
template <typename Peers>
struct RowsPull {
  static constexpr bool kCopy = true;
  RowsArgs a;
  Peers peers;
  JAX_EP_HOST_DEVICE void operator()(int rank, int64_t j, int lane, int lanes) const {
    const int64_t v = rank - a.first_rank;
    const int64_t row = a.expert_major ? a.entry_row[v * a.capacity + j] : j;
    const int32_t src = row >= 0 ? a.recv_src[v * a.num_rows + row] : -1;
    char* to = a.out + (v * a.capacity + j) * a.row_bytes;
    if (src < 0) {
      zero_row(to, a.row_bytes, lane, lanes);
      return;
    }
    const int s = src / a.num_tokens;
    const int64_t t = src % a.num_tokens;
    const char* from = a.stage != nullptr
                           ? peers.at(static_cast<const char*>(a.stage), 0, s)
                           : peers.at(a.x, int64_t{a.num_tokens} * a.row_bytes, s);
    copy_row(to, from + t * a.row_bytes, a.row_bytes, lane, lanes);
  }
};

}  // namespace jax_ep
