// The cast of bfloat16 rows to a wire format (cuda/wire.h) inside a send, shared by the
// low-latency send (cuda/low_latency.h) and the normal dispatch's (cuda/dispatch.h,
// cuda/dispatch_stream.h): a row, or a segment of one, read once and written in the format to
// every slot of a fan (cast_rows), its bytes those of jax_ep.quant.to_rows; the same cast of
// float32 rows formed part by part, in the normal combine's stages (cast_values,
// cuda/combine.h). And the way back: a row in a format dequantized to bfloat16 inside the
// normal dispatch's unpack (dequantize_row), or part by part to float32 inside the combine's
// sums (dequantize_part, cuda/sums.h). It includes the shared primitives and the wire formats.
#pragma once

#include <cstdint>
#include "cuda/primitives.h"
#include "cuda/wire.h"

namespace jax_ep {

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

// A channel's value as the format reads it (every format but e4m3 reads magnitudes below
// 2^-126 as zero).
template <int kWire>
JAX_EP_HOST_DEVICE float format_reads(float v) {
  return kWire == kWireE4m3 ? v : flush_tiny(v);
}

// Channel i of a part held as a word of bfloat16 bits.
JAX_EP_HOST_DEVICE float channel_of(const Word& part, int i) {
  const uint32_t pair = part.v[i / 2];
  return to_float(Bf16{static_cast<uint16_t>(i % 2 ? pair >> 16 : pair & 0xffffu)});
}
// Channel i of a part held as a word of bfloat16 bits, as the format reads it.
template <int kWire>
JAX_EP_HOST_DEVICE float part_channel(const Word& part, int i) {
  return format_reads<kWire>(channel_of(part, i));
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

// Part `v` of a block (its channels as the format reads them), in format kWire, given the
// block's amax (and nvfp4's row): the part's bytes (8, nvfp4 4, little-endian) and, in
// *scale, the block's scale bytes.
template <int kWire>
JAX_EP_HOST_DEVICE CastWord encode_part(const float (&v)[kCastChannels], float amax,
                                        const Nvfp4Row& row, uint32_t* scale) {
  CastWord word = {};
  if (kWire == kWireNvfp4) {
    const Nvfp4Block b = nvfp4_block(amax, row);
    *scale = b.scale;
    JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) {
      word.v[0] |= nvfp4_element(v[i], b.inverse) << (4 * i);
    }
    return word;
  }
  float inv = 0.0f;
  bool finite = true;
  if (kWire == kWireE4m3) {
    const float s = fp8_scale(amax);
    *scale = float_bits(s);
    inv = reciprocal_rn(s);
  } else {
    *scale = e8m0_scale(kWire, amax);
    finite = *scale != kE8m0Nan;
    inv = e8m0_inverse(static_cast<uint8_t>(*scale));
  }
  JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) {
    float e = mul_rn(v[i], inv);
    if (kWire == kWireMxfp8) e = e < -448.0f ? -448.0f : e > 448.0f ? 448.0f : e;
    const uint32_t code = finite ? to_e4m3(e) : kE4m3Nan;
    word.v[i / 4] |= code << (8 * (i % 4));
  }
  return word;
}

// Stores a part's `bytes` (8 or 4) at `to`: one store when aligned.
JAX_EP_HOST_DEVICE void store_part(char* to, const CastWord& word, int bytes, bool aligned) {
  if (aligned && bytes == 8) {
    *reinterpret_cast<CastWord*>(to) = word;
  } else if (aligned) {
    *reinterpret_cast<uint32_t*>(to) = word.v[0];
  } else {
    for (int b = 0; b < bytes; ++b) to[b] = static_cast<char>(word.v[b / 4] >> (8 * (b % 4)));
  }
}

// The word a row's other bytes hold after its block scales: nvfp4's global scale (the quiet
// NaN for a row that is not finite); 0 (padding) in the other formats.
template <int kWire>
JAX_EP_HOST_DEVICE uint32_t row_tail_word(const Nvfp4Row& row) {
  return kWire != kWireNvfp4 ? 0u : row.finite ? float_bits(row.g) : kQuietNan;
}

// Columns [first, first + n) of a row in the wire format `wire` (a low-latency segment,
// ll_segment_cols, or a whole row, whole_row): where they start in a message's data bytes and in its other bytes, and how
// many bytes they take; the segment that ends the row also takes the row's tail (after the
// block scales: nvfp4's global scale and the padding to a whole word).
struct RowSegment {
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
// A whole row of `hidden` channels as one segment (the normal dispatch casts whole rows).
JAX_EP_HOST_DEVICE RowSegment whole_row(int wire, int hidden) {
  return RowSegment{0, hidden, wire, hidden};
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

// Writes segment `seg` (whole blocks) of token row `token`, cast to the wire format kWire
// once, to every slot of the fans (and empties them): the data to `rows`, each block's scale
// to `scales` (the segment's first scale byte in each row's other bytes), and, where the
// segment ends the row, the row's tail bytes after its scales (nvfp4's global scale, then
// zero padding to a whole word). Lane `lane` casts the parts lane, lane + lanes, ...: one
// 16-byte load, and one store to each slot. nvfp4 first reads the whole row for its amax.
template <int kWire>
JAX_EP_HOST_DEVICE void cast_rows(const Bf16* token, const RowSegment& seg, Fan<char>& rows,
                                     Fan<char>& scales, int lane, int lanes) {
  const int n = rows.size();
  if (n == 0) return;
  fan_sync();
  const Bf16* x = token + seg.first;
  const uintptr_t bits = rows.address_bits() | reinterpret_cast<uintptr_t>(token) |
                         reinterpret_cast<uintptr_t>(x);
  const bool aligned = (bits & 15u) == 0;
  const int64_t H = seg.n;
  const int tail = seg.tail();
  const int block = wire_block(kWire), group = block / kCastChannels;
  const int scale_bytes = wire_scale_bytes(kWire);
  if (lane == 0) {  // and nvfp4's read of the whole row
    meter_rows(2 * H + (kWire == kWireNvfp4 ? 2 * int64_t{seg.hidden} : 0),
               n * (wire_data_bytes(kWire, H) + H / block * scale_bytes + tail));
  }
  const int parts = static_cast<int>(H / kCastChannels);
  Nvfp4Row row{1.0f, 0.0f, true};
  if (kWire == kWireNvfp4) {
    row = nvfp4_row(row_amax(token, seg.hidden / kCastChannels, aligned, lane, lanes));
  }
  for (int first = 0; first < parts; first += lanes) {  // the same trips in every lane
    const int part = first + lane;
    const bool valid = part < parts;
    const Word v = load_part(x, part, valid, aligned);
    const float amax = group_amax<kWire>(x, v, part, group, valid);
    if (!valid) continue;
    float f[kCastChannels];
    JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) f[i] = part_channel<kWire>(v, i);
    uint32_t scale = 0;  // the block's scale bytes (little-endian)
    const CastWord word = encode_part<kWire>(f, amax, row, &scale);
    const int out = kWire == kWireNvfp4 ? 4 : 8;  // bytes of a part
    const int64_t at = static_cast<int64_t>(part) * out;
    for (int j = 0; j < n; ++j) store_part(rows[j] + at, word, out, aligned);
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
      const uint32_t g = row_tail_word<kWire>(row);
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

// cast_rows to the format `wire` names at run time, for the streamed dispatch's senders: one
// casting kernel takes every format (a kernel per format would compile the longest kernel,
// DispatchStream, five times for each peer view).
JAX_EP_HOST_DEVICE void cast_rows_to(int wire, const Bf16* token, int hidden, Fan<char>& rows,
                                     Fan<char>& scales, int lane, int lanes) {
  const RowSegment seg = whole_row(wire, hidden);
  switch (wire) {
    case kWireE4m3: return cast_rows<kWireE4m3>(token, seg, rows, scales, lane, lanes);
    case kWireE4m3Ue8m0: return cast_rows<kWireE4m3Ue8m0>(token, seg, rows, scales, lane, lanes);
    case kWireMxfp8: return cast_rows<kWireMxfp8>(token, seg, rows, scales, lane, lanes);
    default: return cast_rows<kWireNvfp4>(token, seg, rows, scales, lane, lanes);
  }
}

// A cast whose source is float32 values rather than bfloat16 rows: the normal combine's rows
// (cuda/combine.h), each rank's weighted row or partial sum of a token, cast where they are
// formed. values(part, v) fills v with the kCastChannels channels of part `part`. Writes the
// row of `hidden` channels to `out` in format kWire: its data bytes, then its other bytes
// (jax_ep.quant.to_rows's row). Lane `lane` takes the parts lane, lane + lanes, ... in the
// same trips in every lane: the GPU's lanes share a block's amax by shuffles, the CPU's (one
// after another) compute the block's other parts again. nvfp4 first computes every part for
// the row's amax.
template <int kWire, typename Values>
JAX_EP_HOST_DEVICE void cast_values_as(const Values& values, int hidden, char* out, int lane,
                                       int lanes) {
  const int group = wire_block(kWire) / kCastChannels, scale_bytes = wire_scale_bytes(kWire);
  const int parts = hidden / kCastChannels;
  const int bytes = kWire == kWireNvfp4 ? 4 : 8;  // of a part
  char* scales = out + wire_data_bytes(kWire, hidden);
  const bool aligned = (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  auto read = [&](int part, float (&v)[kCastChannels]) {
    values(part, v);
    JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) v[i] = format_reads<kWire>(v[i]);
  };
  auto larger = [&](float amax, int part) {
    float v[kCastChannels];
    read(part, v);
    JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) amax = larger_abs(amax, v[i]);
    return amax;
  };
  Nvfp4Row row{1.0f, 0.0f, true};
  if (kWire == kWireNvfp4) {
    float amax = 0.0f;
#if defined(__CUDA_ARCH__)
    for (int part = lane; part < parts; part += lanes) amax = larger(amax, part);
    JAX_EP_UNROLL for (int offset = 16; offset > 0; offset /= 2) {
      amax = larger_abs(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
#else
    for (int part = 0; part < parts; ++part) amax = larger(amax, part);
#endif
    row = nvfp4_row(amax);
  }
  for (int first = 0; first < parts; first += lanes) {
    const int part = first + lane;
    const bool valid = part < parts;
    float v[kCastChannels] = {};
    if (valid) read(part, v);
    float amax = 0.0f;
#if defined(__CUDA_ARCH__)
    JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) amax = larger_abs(amax, v[i]);
    for (int offset = group / 2; offset > 0; offset /= 2) {
      amax = larger_abs(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
#else
    const int from = part / group * group;
    for (int p = from; valid && p < from + group; ++p) amax = larger(amax, p);
#endif
    if (!valid) continue;
    uint32_t scale = 0;
    store_part(out + static_cast<int64_t>(part) * bytes, encode_part<kWire>(v, amax, row, &scale),
               bytes, aligned);
    if (part % group == 0) {  // the block's scale bytes, little-endian
      for (int b = 0; b < scale_bytes; ++b) {
        scales[part / group * scale_bytes + b] = static_cast<char>(scale >> (8 * b));
      }
    }
    if (part == parts - 1) {  // the row's last bytes: nvfp4's global scale, zeros
      const int at = parts / group * scale_bytes;
      const int tail = static_cast<int>(wire_scale_words(kWire, hidden) * 4) - at;
      const uint32_t g = row_tail_word<kWire>(row);
      for (int b = 0; b < tail; ++b) scales[at + b] = static_cast<char>(b < 4 ? g >> (8 * b) : 0);
    }
  }
}

// cast_values_as to the format `wire` names at run time (not kWireBf16).
template <typename Values>
JAX_EP_HOST_DEVICE void cast_values(int wire, const Values& values, int hidden, char* out,
                                    int lane, int lanes) {
  switch (wire) {
    case kWireE4m3: return cast_values_as<kWireE4m3>(values, hidden, out, lane, lanes);
    case kWireE4m3Ue8m0: return cast_values_as<kWireE4m3Ue8m0>(values, hidden, out, lane, lanes);
    case kWireMxfp8: return cast_values_as<kWireMxfp8>(values, hidden, out, lane, lanes);
    default: return cast_values_as<kWireNvfp4>(values, hidden, out, lane, lanes);
  }
}

// ---------------------------------------------------------------------------------------------
// The way back: jax_ep.quant.dequantize(q, bfloat16) of one row, bit for bit

// A product of dequantization as every platform computes it (jax_ep.fp8.canonical): magnitudes
// below 2^-126 as zeros of their sign, every NaN the positive quiet NaN.
JAX_EP_HOST_DEVICE float canonical(float v) {
  if (v != v) return bits_float(kQuietNan);
  return (v < 0.0f ? -v : v) < kSmallestNormal ? bits_float(float_bits(v) & 0x80000000u) : v;
}
// A float8_e4m3fn code as a float32 (exact; the NaN codes a NaN).
JAX_EP_HOST_DEVICE float e4m3_value(uint32_t code) {
  const uint32_t sign = (code & 0x80u) << 24;
  if ((code & 0x7fu) == 0x7fu) return bits_float(sign | kQuietNan);
  return bits_float(sign | float_bits(e4m3_to_float(static_cast<uint8_t>(code & 0x7fu))));
}
// A float4_e2m1fn code (sign in bit 3) as a float32 (code 8 is -0).
JAX_EP_HOST_DEVICE float e2m1_value(uint32_t code) {
  const uint32_t m = code & 7u;  // 0, 0.5, 1, 1.5, then 2, 3, 4, 6
  const float magnitude = m < 4 ? 0.5f * static_cast<float>(m)
                                : static_cast<float>(2u << ((m - 4) / 2)) * (m & 1u ? 1.5f : 1.0f);
  return code & 8u ? -magnitude : magnitude;
}

// Byte i of a row's scale bytes (unaligned reads of the little-endian words).
JAX_EP_HOST_DEVICE uint32_t scale_byte(const char* scales, int64_t i) {
  return static_cast<uint8_t>(scales[i]);
}

// nvfp4's global scale of a row of `hidden` channels (the 4 bytes after its block scales, in
// its other bytes `scales`); 1 in the other formats.
template <int kWire>
JAX_EP_HOST_DEVICE float global_scale_of(const char* scales, int hidden) {
  if (kWire != kWireNvfp4) return 1.0f;
  uint32_t u = 0;
  for (int b = 0; b < 4; ++b) u |= scale_byte(scales, hidden / wire_block(kWire) + b) << (8 * b);
  return bits_float(u);
}

// Part `part` (8 channels) of the row at `data` in format kWire (its other bytes `scales`,
// nvfp4's global scale g), dequantized: quant.dequantize's float32 products, each made
// canonical, in v. One load of the part's 8 (nvfp4: 4) bytes when aligned.
template <int kWire>
JAX_EP_HOST_DEVICE void dequantize_part(const char* data, const char* scales, int part, float g,
                                        bool aligned, float (&v)[kCastChannels]) {
  const int b = part / (wire_block(kWire) / kCastChannels);
  const int in = kWire == kWireNvfp4 ? 4 : 8;  // bytes of a part
  float scale;
  bool halve = false;  // E8M0's 2^-127: times 2^-126, then 0.5 (as quant.dequantize)
  if (kWire == kWireE4m3) {
    uint32_t u = 0;
    for (int k = 0; k < 4; ++k) u |= scale_byte(scales, 4 * int64_t{b} + k) << (8 * k);
    scale = bits_float(u);
  } else if (kWire == kWireNvfp4) {
    scale = canonical(mul_rn(e4m3_value(scale_byte(scales, b)), g));
  } else {
    const uint32_t e = scale_byte(scales, b);
    scale = e == kE8m0Nan ? bits_float(kQuietNan) : bits_float((e > 0 ? e : 1u) << 23);
    halve = e == 0;
  }
  const char* from = data + static_cast<int64_t>(part) * in;
  CastWord codes = {};
  if (aligned && in == 8) {
    codes = *reinterpret_cast<const CastWord*>(from);
  } else if (aligned) {
    codes.v[0] = *reinterpret_cast<const uint32_t*>(from);
  } else {
    for (int k = 0; k < in; ++k) {
      codes.v[k / 4] |= static_cast<uint32_t>(static_cast<uint8_t>(from[k])) << (8 * (k % 4));
    }
  }
  JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) {
    const float e = kWire == kWireNvfp4 ? e2m1_value(codes.v[0] >> (4 * i) & 15u)
                                        : e4m3_value(codes.v[i / 4] >> (8 * (i % 4)) & 255u);
    v[i] = canonical(mul_rn(e, scale));
    if (halve) v[i] = canonical(mul_rn(v[i], 0.5f));
  }
}

// The row at `data` in format kWire (its data bytes; `scales`, its other bytes: the bytes of
// jax_ep.quant.to_rows), dequantized to `hidden` bfloat16 channels at `out`:
// quant.dequantize's arithmetic, each product made canonical, rounded to bfloat16 at the end.
// Lane `lane` takes the parts of 8 channels lane, lane + lanes, ...: one load of the part's 8
// (nvfp4: 4) bytes, one 16-byte store.
template <int kWire>
JAX_EP_HOST_DEVICE void dequantize_row_as(const char* data, const char* scales, int hidden,
                                          Bf16* out, int lane, int lanes) {
  const int parts = hidden / kCastChannels;
  const bool aligned = ((reinterpret_cast<uintptr_t>(data) | reinterpret_cast<uintptr_t>(out)) &
                        15u) == 0;
  if (lane == 0) meter_rows(wire_row_bytes(kWire, hidden), 2 * int64_t{hidden});
  const float g = global_scale_of<kWire>(scales, hidden);
  for (int part = lane; part < parts; part += lanes) {
    float v[kCastChannels];
    dequantize_part<kWire>(data, scales, part, g, aligned, v);
    Word w = {};
    JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) {
      w.v[i / 2] |= static_cast<uint32_t>(from_float<Bf16>(v[i]).bits) << (i % 2 * 16);
    }
    Bf16* to = out + static_cast<int64_t>(part) * kCastChannels;
    if (aligned) {
      *reinterpret_cast<Word*>(to) = w;
    } else {
      JAX_EP_UNROLL for (int i = 0; i < kCastChannels; ++i) {
        to[i].bits = static_cast<uint16_t>(w.v[i / 2] >> (i % 2 * 16));
      }
    }
  }
}

// dequantize_row_as to the format `wire` names at run time (not kWireBf16).
JAX_EP_HOST_DEVICE void dequantize_row(int wire, const char* data, const char* scales,
                                       int hidden, Bf16* out, int lane, int lanes) {
  switch (wire) {
    case kWireE4m3: return dequantize_row_as<kWireE4m3>(data, scales, hidden, out, lane, lanes);
    case kWireE4m3Ue8m0:
      return dequantize_row_as<kWireE4m3Ue8m0>(data, scales, hidden, out, lane, lanes);
    case kWireMxfp8: return dequantize_row_as<kWireMxfp8>(data, scales, hidden, out, lane, lanes);
    default: return dequantize_row_as<kWireNvfp4>(data, scales, hidden, out, lane, lanes);
  }
}

}  // namespace jax_ep
