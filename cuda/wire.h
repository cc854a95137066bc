// Wire formats of low-latency dispatch (docs/contract.md, "Wire formats"; jax_ep/quant.py):
// the bytes of a row on the wire and the cast rules of each format, identical on host and
// device. A row travels as its data bytes and its other bytes (block scales, then nvfp4's
// global scale, zero-padded to whole float32 words: jax_ep.quant.to_rows).
#pragma once

#include <cstdint>

#include "cuda/numerics.h"

namespace jax_ep {

enum Wire : int {
  kWireBf16 = 0,
  kWireE4m3 = 1,
  kWireE4m3Ue8m0 = 2,
  kWireMxfp8 = 3,
  kWireNvfp4 = 4,
};
constexpr int kNumWires = 5;

// Channels per block of scale (bf16: none; blocks of 128 then).
JAX_EP_HOST_DEVICE int wire_block(int wire) {
  return wire == kWireMxfp8 ? 32 : wire == kWireNvfp4 ? 16 : kFp8Block;
}
// Data bytes of `cols` channels.
JAX_EP_HOST_DEVICE int64_t wire_data_bytes(int wire, int64_t cols) {
  return wire == kWireBf16 ? 2 * cols : wire == kWireNvfp4 ? cols / 2 : cols;
}
// Bytes of one block's scale (e4m3: a float32; the others one byte).
JAX_EP_HOST_DEVICE int wire_scale_bytes(int wire) {
  return wire == kWireBf16 ? 0 : wire == kWireE4m3 ? 4 : 1;
}
// The other bytes of a row of H channels, in float32 words: its block scales, nvfp4's global
// scale after them, zero padding to a whole word.
JAX_EP_HOST_DEVICE int64_t wire_scale_words(int wire, int64_t hidden) {
  if (wire == kWireBf16) return 0;
  const int64_t bytes = hidden / wire_block(wire) * wire_scale_bytes(wire) +
                        (wire == kWireNvfp4 ? 4 : 0);
  return (bytes + 3) / 4;
}

// Bytes of a whole row of H channels in a format: its data bytes, then its other bytes.
JAX_EP_HOST_DEVICE int64_t wire_row_bytes(int wire, int64_t hidden) {
  return wire_data_bytes(wire, hidden) + 4 * wire_scale_words(wire, hidden);
}

// Magnitudes below float32's smallest normal count as zero (every format but e4m3).
constexpr float kSmallestNormal = 1.17549435e-38f;  // 2^-126
JAX_EP_HOST_DEVICE float flush_tiny(float v) {
  return (v < 0.0f ? -v : v) < kSmallestNormal ? 0.0f : v;
}
JAX_EP_HOST_DEVICE bool is_finite(float v) { return (float_bits(v) & 0x7f800000u) != 0x7f800000u; }

constexpr uint8_t kE8m0Nan = 0xFF;
constexpr uint8_t kE4m3Nan = 0x7F;
// The biased exponent (E8M0) of a block's power-of-two scale from its amax: "e4m3_ue8m0", the
// smallest power of two >= max(amax, 1e-4) / 448; "mxfp8", 2^(floor(log2 amax) - 8) clamped
// to [2^-127, 2^127] (2^-127 for zeros). A block holding a NaN or an infinity: 0xFF.
JAX_EP_HOST_DEVICE uint8_t e8m0_scale(int wire, float amax) {
  if (!is_finite(amax)) return kE8m0Nan;
  if (wire == kWireE4m3Ue8m0) {
    const uint32_t s = float_bits(fp8_scale(amax));  // normal: at least 1e-4 / 448
    return static_cast<uint8_t>((s >> 23) + ((s & 0x7fffffu) != 0));
  }
  if (amax <= 0.0f) return 0;
  const int floor_log2 = static_cast<int>(float_bits(amax) >> 23) - 127;  // amax is normal
  const int e = floor_log2 - 8 < -127 ? -127 : floor_log2 - 8 > 127 ? 127 : floor_log2 - 8;
  return static_cast<uint8_t>(e + 127);
}
// 1 / 2^(biased - 127) = 2^(127 - biased), exactly (a normal float32 for every biased a
// finite block gets).
JAX_EP_HOST_DEVICE float e8m0_inverse(uint8_t biased) {
  return bits_float(static_cast<uint32_t>(254 - biased) << 23);
}

// float32 -> float4_e2m1fn code (sign in bit 3), rounding to nearest even, |f| <= 6; NaN
// gives 0 (nvfp4 writes zeros in a non-finite row). Below 1 the codes are 0, 0.5 and 1 (ties
// at 0.25 and 0.75 to the even code); from 1 on, the float's exponent and first mantissa bit
// rounded to nearest even, rebiased.
JAX_EP_HOST_DEVICE uint32_t to_e2m1(float f) {
  if (f != f) return 0;
  const uint32_t u = float_bits(f), magnitude = u & 0x7fffffffu;
  const float m = bits_float(magnitude);
  const uint32_t code = m < 1.0f ? (m >= 0.75f ? 2u : m > 0.25f ? 1u : 0u)
                                 : shift_round_even(magnitude, 22) - 252u;
  return code | ((u >> 28) & 8u);
}

// A float8_e4m3fn code >= 0 that is not NaN, as a float32 (exact).
JAX_EP_HOST_DEVICE float e4m3_to_float(uint8_t code) {
  const uint32_t e = (code >> 3) & 0xfu, m = code & 7u;
  if (e == 0) return static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  return bits_float(((e + 120u) << 23) | (m << 20));
}

// nvfp4's row rule from the row's amax: g = amax * float32(1/2688), 1 for rows of zeros, rows
// too small for a normal g and non-finite rows (whose data are zeros and scales NaN); r, the
// factor of the block amaxes: 1 / (6 g), or 0 where every block is empty (a zero row).
struct Nvfp4Row {
  float g, r;
  bool finite;
};
constexpr float kNvfp4GlobalInv = static_cast<float>(1.0 / 2688.0);
JAX_EP_HOST_DEVICE Nvfp4Row nvfp4_row(float amax) {
  const float g = mul_rn(amax, kNvfp4GlobalInv);
  const bool zero = amax == 0.0f || g < kSmallestNormal, finite = is_finite(amax);
  const float global = zero || !finite ? 1.0f : g;
  return Nvfp4Row{global, zero ? 0.0f : reciprocal_rn(mul_rn(6.0f, global)), finite};
}
// A block's e4m3 scale s_b = e4m3(min(amax * r, 448)) and the factor its elements are
// multiplied by: 1 / (s_b * g), or 0 for an empty block (s_b = 0, or s_b * g too small); in a
// non-finite row, NaN (so that its elements are zeros, to_e2m1).
struct Nvfp4Block {
  uint8_t scale;
  float inverse;
};
JAX_EP_HOST_DEVICE Nvfp4Block nvfp4_block(float amax, const Nvfp4Row& row) {
  if (!row.finite) return Nvfp4Block{kE4m3Nan, bits_float(kQuietNan)};
  const float s = mul_rn(amax, row.r);
  const uint8_t scale = to_e4m3(s < 448.0f ? s : 448.0f);
  const float q = mul_rn(e4m3_to_float(scale), row.g);
  const bool empty = scale == 0 || q < kSmallestNormal;
  return Nvfp4Block{scale, empty ? 0.0f : reciprocal_rn(q)};
}
// An element's e2m1 code in its block.
JAX_EP_HOST_DEVICE uint32_t nvfp4_element(float v, float inverse) {
  const float e = mul_rn(v, inverse);
  return to_e2m1(e < -6.0f ? -6.0f : e > 6.0f ? 6.0f : e);
}

}  // namespace jax_ep
