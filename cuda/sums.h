// Ordered sums of rows (cuda/exchange.h), what every combine adds with: the rows of one sum
// kSumBatch at a time (Terms), 16-byte packs (Pack, PackSum) and sum_rows, which adds terms
// in their given order (optionally weighted, or grouped) so the result is bit for bit the
// reference's; sum_wire_rows, the same of rows that travelled in a wire format. It includes
// the shared primitives and the casts (cuda/cast.h).
#pragma once

#include <cstdint>
#include "cuda/cast.h"
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

// How many terms collect(terms, from) yields over [0, end), their addresses' bits or'ed into
// *bits (whether every row is aligned).
template <typename T, typename Collect>
JAX_EP_HOST_DEVICE int64_t count_terms(const Collect& collect, int end, uintptr_t* bits) {
  int64_t terms = 0;
  for (int from = 0; from < end;) {
    Terms<T> batch;
    from = collect(batch, from);
    *bits |= address_bits(batch.row, batch.n);
    terms += batch.n;
  }
  return terms;
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
  const int64_t terms = count_terms<T>(collect, end, &bits);
  if (lane == 0) meter_rows(terms * row_bytes, row_bytes);
  constexpr int N = 16 / sizeof(T);
  if ((bits & 15u) == 0) {
    sum_rows_packed<T, N, kGrouped>(out, H / N, weighted, end, collect, lane, lanes);
  } else {
    sum_rows_packed<T, 1, kGrouped>(out, H, weighted, end, collect, lane, lanes);
  }
}

// sum_rows of rows in the wire format kWire (each term a row's data bytes, its other bytes
// after them at wire_data_bytes: the combine's rows quantized before they travel,
// docs/contract.md): each term dequantized to float32 (quant.dequantize's canonical
// products), added in order from 0, each sum rounded to float32, the total rounded to T once.
// Unweighted: the weights were applied before the cast. Lane `lane` writes the parts of 8
// channels lane, lane + lanes, ...; the terms are collected again for every part, as in
// sum_rows.
template <int kWire, typename T, typename Collect>
JAX_EP_HOST_DEVICE void sum_wire_rows_as(T* out, int hidden, int end, const Collect& collect,
                                         int lane, int lanes) {
  const int64_t data = wire_data_bytes(kWire, hidden);
  uintptr_t bits = reinterpret_cast<uintptr_t>(out);
  const int64_t terms = count_terms<T>(collect, end, &bits);
  if (lane == 0) {
    meter_rows(terms * wire_row_bytes(kWire, hidden), hidden * static_cast<int64_t>(sizeof(T)));
  }
  const bool aligned = (bits & 15u) == 0;
  constexpr int N = 16 / sizeof(T);  // values of a 16-byte pack
  const int parts = hidden / kCastChannels;
  JAX_EP_NO_UNROLL for (int part = lane; part < parts; part += lanes) {
    float total[kCastChannels] = {};
    for (int from = 0; from < end;) {
      Terms<T> batch;
      from = collect(batch, from);
      JAX_EP_UNROLL for (int j = 0; j < kSumBatch; ++j) {  // registers: compile-time indices
        if (j >= batch.n) continue;
        const char* row = reinterpret_cast<const char*>(batch.row[j]);
        float v[kCastChannels];
        dequantize_part<kWire>(row, row + data, part, global_scale_of<kWire>(row + data, hidden),
                               aligned, v);
        JAX_EP_UNROLL for (int q = 0; q < kCastChannels; ++q) total[q] = add_rn(total[q], v[q]);
      }
    }
    T* to = out + static_cast<int64_t>(part) * kCastChannels;
    JAX_EP_UNROLL for (int k = 0; k < kCastChannels; k += N) {
      Pack<T, N> p;
      JAX_EP_UNROLL for (int q = 0; q < N; ++q) p.v[q] = from_float<T>(total[k + q]);
      if (aligned) {
        reinterpret_cast<Pack<T, N>*>(to)[k / N] = p;
      } else {
        JAX_EP_UNROLL for (int q = 0; q < N; ++q) to[k + q] = p.v[q];
      }
    }
  }
}

// sum_wire_rows_as in the format `wire` names at run time (not kWireBf16).
template <typename T, typename Collect>
JAX_EP_HOST_DEVICE void sum_wire_rows(int wire, T* out, int hidden, int end,
                                      const Collect& collect, int lane, int lanes) {
  switch (wire) {
    case kWireE4m3: return sum_wire_rows_as<kWireE4m3>(out, hidden, end, collect, lane, lanes);
    case kWireE4m3Ue8m0:
      return sum_wire_rows_as<kWireE4m3Ue8m0>(out, hidden, end, collect, lane, lanes);
    case kWireMxfp8: return sum_wire_rows_as<kWireMxfp8>(out, hidden, end, collect, lane, lanes);
    default: return sum_wire_rows_as<kWireNvfp4>(out, hidden, end, collect, lane, lanes);
  }
}

}  // namespace jax_ep
