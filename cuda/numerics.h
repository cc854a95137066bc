// Float arithmetic of the contract, identical on host and device (docs/contract.md).
//
// Every conversion is written out with integer operations, so the CPU handlers and the CUDA
// kernels round exactly alike (round to nearest even), and every product and sum is a
// separately rounded float32 operation: nvcc would otherwise fuse a product into the
// following addition (one rounding instead of two), which the portable backend never does.
#pragma once

#include <cstdint>
#include <cstring>

#include "cuda/routing.h"  // JAX_EP_HOST_DEVICE

namespace jax_ep {

// 16-bit storage types; arithmetic always happens in float32.
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

// The positive quiet NaN's bits: the one NaN every path writes (docs/contract.md, "Wire
// formats"), whatever NaN a processor's arithmetic made.
constexpr uint32_t kQuietNan = 0x7fc00000u;

JAX_EP_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

JAX_EP_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

JAX_EP_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;  // the host build never contracts (ISO C++, no -ffp-contract=fast)
#endif
}

JAX_EP_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

JAX_EP_HOST_DEVICE float reciprocal_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

// Rounds the unsigned value `mantissa >> shift` to nearest, ties to even (shift in [1, 31]).
JAX_EP_HOST_DEVICE uint32_t shift_round_even(uint32_t mantissa, int shift) {
  const uint32_t quotient = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return quotient + (rest > half || (rest == half && (quotient & 1u)));
}

JAX_EP_HOST_DEVICE float to_float(float v) { return v; }
JAX_EP_HOST_DEVICE float to_float(Bf16 v) { return bits_float(static_cast<uint32_t>(v.bits) << 16); }
JAX_EP_HOST_DEVICE float to_float(F16 v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1fu;
  const uint32_t mantissa = v.bits & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf/NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Subnormal (or zero): mantissa * 2^-24 is exact in float32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
  return sign ? -magnitude : magnitude;
}

// float32 -> storage type, rounding to nearest even.
template <typename T>
JAX_EP_HOST_DEVICE T from_float(float f);

template <>
JAX_EP_HOST_DEVICE float from_float<float>(float f) {
  return f;
}

template <>
JAX_EP_HOST_DEVICE Bf16 from_float<Bf16>(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  return Bf16{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

template <>
JAX_EP_HOST_DEVICE F16 from_float<F16>(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return F16{static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (magnitude >= 0x477ff000u) return F16{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520
  if (magnitude >= 0x38800000u) {  // normal in float16: rebias the exponent by 127 - 15
    return F16{static_cast<uint16_t>(sign | shift_round_even(magnitude - 0x38000000u, 13))};
  }
  if (magnitude <= 0x33000000u) return F16{sign};  // at most 2^-25: rounds to zero
  const int exponent = static_cast<int>(magnitude >> 23);
  const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
  return F16{static_cast<uint16_t>(sign | shift_round_even(mantissa, 126 - exponent))};
}

// float32 -> float8_e4m3fn bits (no infinities), rounding to nearest even. Magnitudes above
// 464 (halfway past 448, the largest finite value) become NaN; a NaN becomes 0x7f whatever
// its sign (which processors set differently: x86 gives inf * 0 a negative NaN, a GPU a
// positive one).
JAX_EP_HOST_DEVICE uint8_t to_e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return 0x7fu;
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if (magnitude > 0x43e80000u) return sign | 0x7fu;  // > 464, inf or NaN
  if (magnitude >= 0x3c800000u) {                     // >= 2^-6: normal; rebias by 127 - 7
    return sign | static_cast<uint8_t>(shift_round_even(magnitude - 0x3c000000u, 20));
  }
  if (magnitude <= 0x3a800000u) return sign;  // at most 2^-10, half the smallest subnormal
  // Subnormal: a multiple of 2^-9 (a result of 8 is the smallest normal, encoded the same way).
  const int exponent = static_cast<int>(magnitude >> 23);
  const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
  return sign | static_cast<uint8_t>(shift_round_even(mantissa, 141 - exponent));
}

// The FP8 rule of docs/contract.md for one block of 128 channels with absolute maximum `amax`:
// scale = max(amax, 1e-4) * float32(1/448), or the quiet NaN 0x7fc00000 when amax is a NaN (a
// NaN makes its block NaN; the NaN a product gives differs between processors); the values are
// multiplied by reciprocal_rn(scale).
constexpr int kFp8Block = 128;
constexpr float kFp8AmaxFloor = 1e-4f;
constexpr float kFp8InvMax = static_cast<float>(1.0 / 448.0);

JAX_EP_HOST_DEVICE float fp8_scale(float amax) {
  if (amax != amax) return bits_float(kQuietNan);
  return mul_rn(amax > kFp8AmaxFloor ? amax : kFp8AmaxFloor, kFp8InvMax);
}

}  // namespace jax_ep
