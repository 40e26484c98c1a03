// The dropout factor of W weights at once: 1/(1-p) where the weight is kept,
// 0 where it is dropped (the rule of common/dropout.h, in vector form).
#pragma once

#include <xsimd/xsimd.hpp>

#include <cstdint>
#include <cstring>

#include "common/dropout.h"

namespace mha_simd {

template <class Arch>
class DropoutFactor {
  using U = xsimd::batch<uint32_t, Arch>;
  using I = xsimd::batch<int32_t, Arch>;
  using F = xsimd::batch<float, Arch>;

 public:
  DropoutFactor(float p) : drop_below_(mha_dropout::threshold(p)) {
    const float scale = 1.0f / (1.0f - p);
    std::memcpy(&scale_bits_, &scale, sizeof scale);
  }

  // hashes = row key + key index * kKeyStep, per lane.
  F operator()(U x) const {
    x ^= x >> 16;
    x *= U(0x85EBCA6Bu);
    x ^= x >> 13;
    x *= U(0xC2B2AE35u);
    x ^= x >> 16;
    // Unsigned x >= drop_below as a signed comparison with the sign bits flipped.
    const I flipped = xsimd::bitwise_cast<I>(x ^ U(0x80000000u));
    const auto keep = flipped >= I(static_cast<int32_t>(drop_below_ ^ 0x80000000u));
    return xsimd::bitwise_cast<F>(xsimd::bitwise_cast(keep) & I(scale_bits_));
  }

 private:
  uint32_t drop_below_;
  int32_t scale_bits_ = 0;
};

}  // namespace mha_simd
