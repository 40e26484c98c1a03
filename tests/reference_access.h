// Reading the caller's descriptors in float64, for the references
// (reference.cpp, reference_backward.cpp): elements of any dtype, the mask
// broadcast to [B, H, Lq, Lk], valid lengths.  Written from the formats'
// and the API's definitions; it uses mha's header types only.
#pragma once

#include <mha/mha.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace mha_test::reference_access {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

inline void require(bool condition, const std::string& what) {
  if (!condition) throw std::invalid_argument("reference: " + what);
}

inline void require_tensor(const mha_tensor& t, const char* name, int32_t min_ndim,
                           int32_t max_ndim) {
  require(t.data != nullptr, std::string(name) + " has no data");
  require(t.ndim >= min_ndim && t.ndim <= max_ndim, std::string(name) + " has the wrong rank");
  for (int32_t d = 0; d < t.ndim; ++d) {
    require(t.shape[d] > 0, std::string(name) + " has a size <= 0");
    require(t.strides[d] >= 0, std::string(name) + " has a negative stride");
  }
}

// IEEE binary16 and bfloat16 bits as the double they denote, written here
// from the formats' definitions (independent of the library's conversions).
inline double from_f16(uint16_t bits) {
  const double sign = (bits & 0x8000u) != 0 ? -1.0 : 1.0;
  const int exponent = (bits >> 10) & 0x1F;
  const int mantissa = bits & 0x3FF;
  if (exponent == 0x1F) {
    return mantissa != 0 ? std::numeric_limits<double>::quiet_NaN() : sign * kInf;
  }
  // mantissa · 2^-24 (subnormal) or (1024 + mantissa) · 2^(exponent - 25),
  // the power of two from a table (std::ldexp per element made the f16
  // backward tests six times slower than bf16's); every product is exact.
  static const auto kPowers = [] {
    std::array<double, 31> powers{};
    for (int e = 0; e < 31; ++e) powers[static_cast<size_t>(e)] = std::ldexp(1.0, e - 25);
    return powers;
  }();
  if (exponent == 0) return sign * mantissa * kPowers[1];
  return sign * (1024 + mantissa) * kPowers[static_cast<size_t>(exponent)];
}
inline double from_bf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return static_cast<double>(f);
}

// Element `offset` of a descriptor of a floating dtype (F32, BF16, F16) or I8.
inline double value_at(const mha_tensor& t, int64_t offset) {
  switch (t.dtype) {
    case MHA_DTYPE_BF16:
      return from_bf16(static_cast<const uint16_t*>(t.data)[offset]);
    case MHA_DTYPE_F16:
      return from_f16(static_cast<const uint16_t*>(t.data)[offset]);
    case MHA_DTYPE_I8:
      return static_cast<double>(static_cast<const int8_t*>(t.data)[offset]);
    default:
      return static_cast<double>(static_cast<const float*>(t.data)[offset]);
  }
}

// Element (i0, i1, i2, i3) of a rank-4 descriptor.
inline double at4(const mha_tensor& t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  return value_at(t, i0 * t.strides[0] + i1 * t.strides[1] + i2 * t.strides[2] + i3 * t.strides[3]);
}

// Element (i0, i1, i2) of a rank-3 descriptor.
inline double at3(const mha_tensor& t, int64_t i0, int64_t i1, int64_t i2) {
  return value_at(t, i0 * t.strides[0] + i1 * t.strides[1] + i2 * t.strides[2]);
}

inline bool floating(int32_t dtype) {
  return dtype == MHA_DTYPE_F32 || dtype == MHA_DTYPE_BF16 || dtype == MHA_DTYPE_F16;
}

// The mask, right-aligned against [B, H, Lq, Lk]: strides of the four logical
// axes (0 where the mask lacks the axis or has size 1 there).
struct MaskView {
  const mha_tensor* t = nullptr;
  int64_t strides[4] = {0, 0, 0, 0};
};

inline MaskView make_mask_view(const mha_tensor* mask, const int64_t full[4]) {
  MaskView view;
  if (mask == nullptr) return view;
  require_tensor(*mask, "mask", 2, 4);
  require(mask->dtype == MHA_DTYPE_BOOL || floating(mask->dtype),
          "mask must be bool, f32, bf16 or f16");
  const int32_t offset = 4 - mask->ndim;
  for (int32_t axis = offset; axis < 4; ++axis) {
    const int64_t size = mask->shape[axis - offset];
    require(size == 1 || size == full[axis], "mask does not broadcast to [B, H, Lq, Lk]");
    view.strides[axis] = size == 1 ? 0 : mask->strides[axis - offset];
  }
  view.t = mask;
  return view;
}

inline int64_t valid_length(const mha_tensor* vl, int64_t b, int64_t i) {
  const int64_t offset = b * vl->strides[0] + (vl->ndim == 2 ? i * vl->strides[1] : 0);
  if (vl->dtype == MHA_DTYPE_I64) return static_cast<const int64_t*>(vl->data)[offset];
  return static_cast<const int32_t*>(vl->data)[offset];
}

}  // namespace mha_test::reference_access
