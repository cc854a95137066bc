// Ordered sums of rows (cuda/exchange.h), what every combine adds with: the rows of one sum
// kSumBatch at a time (Terms), 16-byte packs (Pack, PackSum) and sum_rows, which adds terms
// in their given order (optionally weighted, or grouped) so the result is bit for bit the
// reference's. It includes only the shared primitives.
#pragma once

#include <cstdint>
#include "cuda/primitives.h"

namespace jax_ep {

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

}  // namespace jax_ep
