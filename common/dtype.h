// The element types of mha's tensors and their conversions to and from fp32,
// in plain C++ (no ISA code): the scalar backend reads with them, the
// runtime writes half-precision results and quantises with them, and the
// SIMD kernels use them for their scalar edges.  Conversions to a half type
// round to nearest, ties to even; NaN stays NaN (quiet), infinities stay.
#pragma once

#include <mha/mha.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mha_types {

// The short name of a dtype, as the messages, mha-run's flags and the
// benchmarks' shape suffixes spell it ("unknown" for a value not in the enum).
inline const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case MHA_DTYPE_F32:
      return "f32";
    case MHA_DTYPE_F16:
      return "f16";
    case MHA_DTYPE_BF16:
      return "bf16";
    case MHA_DTYPE_BOOL:
      return "bool";
    case MHA_DTYPE_I32:
      return "i32";
    case MHA_DTYPE_I64:
      return "i64";
    case MHA_DTYPE_I8:
      return "i8";
    default:
      return "unknown";
  }
}

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// bfloat16: the upper half of an fp32.
inline float bf16_to_f32(uint16_t h) {
  return float_of(static_cast<uint32_t>(h) << 16);
}
inline uint16_t f32_to_bf16(float x) {
  const uint32_t u = bits_of(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE binary16.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return float_of(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {  // zero or subnormal: mantissa · 2^-24
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign != 0 ? -magnitude : magnitude;
  }
  return float_of(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}
inline uint16_t f32_to_f16(float x) {
  const uint32_t u = bits_of(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);   // NaN
  if (magnitude >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to inf
  if (magnitude < 0x38800000u) {  // below the smallest normal half: a subnormal or 0
    // magnitude / 2^-24, rounded to nearest even by the fp32 addition of 0.5 ulp units.
    const float scaled = float_of(magnitude) * 16777216.0f;  // exact: a power of two
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)));
  }
  // Normal: rebias the exponent (127 -> 15), round the mantissa to 10 bits.
  const uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - (112u << 23)) >> 13));
}

// Bytes per element of the floating types (0 for others).
inline int float_bytes(int32_t dtype) {
  switch (dtype) {
    case MHA_DTYPE_F32:
      return 4;
    case MHA_DTYPE_BF16:
    case MHA_DTYPE_F16:
      return 2;
    default:
      return 0;
  }
}

// The address of element `at` of data of a floating dtype (F32, BF16, F16).
inline void* element_at(void* data, int32_t dtype, int64_t at) {
  return static_cast<char*>(data) + at * float_bytes(dtype);
}

// Element `at` of floating data of the given dtype (F32, BF16, F16), as fp32.
inline float load_float(const void* data, int32_t dtype, int64_t at) {
  switch (dtype) {
    case MHA_DTYPE_BF16:
      return bf16_to_f32(static_cast<const uint16_t*>(data)[at]);
    case MHA_DTYPE_F16:
      return f16_to_f32(static_cast<const uint16_t*>(data)[at]);
    default:
      return static_cast<const float*>(data)[at];
  }
}

// Writes x as the given dtype (F32, BF16, F16) at element `at`.
inline void store_float(void* data, int32_t dtype, int64_t at, float x) {
  switch (dtype) {
    case MHA_DTYPE_BF16:
      static_cast<uint16_t*>(data)[at] = f32_to_bf16(x);
      break;
    case MHA_DTYPE_F16:
      static_cast<uint16_t*>(data)[at] = f32_to_f16(x);
      break;
    default:
      static_cast<float*>(data)[at] = x;
  }
}

// n elements of floating data (F32, BF16, F16) from element `at`, `stride`
// apart, widened into dense fp32 `dst`; and dense fp32 `src` rounded into
// such data.  The dtype is decided once per row, not per element as
// load_float and store_float do: the runtime's rows of half-precision
// backward and module calls (a bf16 S1 backward on Zen 5: 10.2 % -> 4.9 %
// of its perf samples in the runtime).
inline void widen_row(const void* data, int32_t dtype, int64_t at, int64_t stride, int64_t n,
                      float* dst) {
  if (dtype == MHA_DTYPE_F32) {
    const float* src = static_cast<const float*>(data) + at;
    for (int64_t x = 0; x < n; ++x) dst[x] = src[x * stride];
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(data) + at;
  if (dtype == MHA_DTYPE_BF16) {
    for (int64_t x = 0; x < n; ++x) dst[x] = bf16_to_f32(src[x * stride]);
  } else {
    for (int64_t x = 0; x < n; ++x) dst[x] = f16_to_f32(src[x * stride]);
  }
}
inline void narrow_row(const float* src, int64_t n, void* data, int32_t dtype, int64_t at,
                       int64_t stride) {
  if (dtype == MHA_DTYPE_F32) {
    float* dst = static_cast<float*>(data) + at;
    for (int64_t x = 0; x < n; ++x) dst[x * stride] = src[x];
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(data) + at;
  if (dtype == MHA_DTYPE_BF16) {
    for (int64_t x = 0; x < n; ++x) dst[x * stride] = f32_to_bf16(src[x]);
  } else {
    for (int64_t x = 0; x < n; ++x) dst[x * stride] = f32_to_f16(src[x]);
  }
}

}  // namespace mha_types
