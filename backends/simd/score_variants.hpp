// What changes the scores before the mask: the logit softcap (Gemma 2),
// s <- c · tanh(s / c), then ALiBi, s <- s - slope · |i + Lk - Lq - j|.  On
// scores in the kernel's units (ScoreUnits: a cap of c logits is
// units.mask(c) in them, tanh's argument and factor scaling alike).
//
// tanh(x) for |x| < 0.625 is x + x³·P(x²), P of degree 4 (Cephes' tanhf
// coefficients: the small-argument form keeps the error relative, which a
// cap much larger than the logits needs -- there c · tanh(s / c) is about s);
// beyond, (1 - e) / (1 + e) with e = 2^(-2|x|·log2 e) <= 0.29 from
// fast_exp2.  |x| is clamped at 9, where tanh is 1 in fp32.  softcap_scores
// (the argument s · (1/c), tanh, the product by c) is within 6 · 2^-24
// relative of c · tanh(s / c) in float64 (tests/micro/test_micro.cpp's
// SoftcapMatchesTanhInFloat64; at most 4 · 2^-24 measured on avx2 and
// avx512, Zen 4).  A NaN stays NaN; ±inf becomes ±c.
#pragma once

#include <mha/plugin_abi.h>
#include <xsimd/xsimd.hpp>

#include <cstdint>

#include "common/problem.h"
#include "simd/exp2.hpp"
#include "simd/tile_tools.hpp"

namespace mha_simd {

template <class Arch>
inline xsimd::batch<float, Arch> fast_tanh(xsimd::batch<float, Arch> x) {
  using B = xsimd::batch<float, Arch>;
  const B a = xsimd::min(xsimd::abs(x), B(9.0f));  // NaN: handled at the end
  // small arguments
  const B z = a * a;
  B p = B(-5.70498872745e-3f);
  p = xsimd::fma(p, z, B(2.06390887954e-2f));
  p = xsimd::fma(p, z, B(-5.37397155531e-2f));
  p = xsimd::fma(p, z, B(1.33314422036e-1f));
  p = xsimd::fma(p, z, B(-3.33332819422e-1f));
  const B small = xsimd::fma(p * z, a, a);
  const B sign = xsimd::bitwise_and(x, B(-0.0f));
  const auto is_small = a < B(0.625f);  // false for NaN
  // A cap well above the logits (Gemma 2's 50 over logits of a few tens)
  // leaves every argument small: the exp and the division are skipped.
  if (xsimd::all(is_small)) return xsimd::bitwise_or(small, sign);
  // large arguments
  const B e = fast_exp2<Arch>(a * B(-2.0f * 1.4426950408889634f));
  const B large = (B(1.0f) - e) / (B(1.0f) + e);
  const B t = xsimd::select(is_small, small, large);
  return xsimd::select(xsimd::isnan(x), x, xsimd::bitwise_or(t, sign));
}

// c · tanh(s / c) for every score of n floats (a multiple of the vector
// width) at s.
template <class Arch>
inline void softcap_scores(float* s, int64_t n, float cap) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  const B c(cap), inv(1.0f / cap);
  for (int64_t x = 0; x < n; x += W) {
    (c * fast_tanh<Arch>(B::load_aligned(s + x) * inv)).store_aligned(s + x);
  }
}

// Softcap and ALiBi on a prefill tile: queries q0 .. q0 + nqv·W of head h
// (lanes), keys j0 .. j0 + keys, scores[j][lane] kStride floats apart.
template <class Arch, int kStride>
inline void apply_score_variants_tile(const mha_kernel_problem& p, float* scores, int64_t b,
                                      int64_t h, int64_t q0, int nqv, int64_t j0, int keys,
                                      const ScoreUnits& units) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  if (p.softcap > 0.0f) {
    const float cap = units.mask(p.softcap);
    for (int j = 0; j < keys; ++j) softcap_scores<Arch>(scores + j * kStride, nqv * W, cap);
  }
  if (p.alibi_slopes != nullptr) {
    // -slope · |q + Lk - Lq - j| with q = q0 + lane: the lanes' distances
    // step by one; floats hold them exactly below 2^24.
    const B slope(-units.mask(mha_kernel::alibi_slope(p, b, h)));
    alignas(64) float lane_index[W];
    for (int l = 0; l < W; ++l) lane_index[l] = static_cast<float>(l);
    const B lanes = B::load_aligned(lane_index);
    for (int j = 0; j < keys; ++j) {
      float* s = scores + j * kStride;
      const float first = static_cast<float>(q0 + p.alibi_diag - (j0 + j));
      for (int v = 0; v < nqv; ++v) {
        const B distance = xsimd::abs(lanes + B(first + static_cast<float>(v * W)));
        xsimd::fma(slope, distance, B::load_aligned(s + v * W)).store_aligned(s + v * W);
      }
    }
  }
}

// Softcap and ALiBi on a decode row: query i of head h, keys j0 .. j0 + keys
// at s (room for whole vectors).
template <class Arch>
inline void apply_score_variants_row(const mha_kernel_problem& p, float* s, int64_t b, int64_t h,
                                     int64_t i, int64_t j0, int keys, const ScoreUnits& units) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  if (p.softcap > 0.0f) softcap_scores<Arch>(s, round_up(keys, W), units.mask(p.softcap));
  if (p.alibi_slopes != nullptr) {
    const float slope = -units.mask(mha_kernel::alibi_slope(p, b, h));
    for (int j = 0; j < keys; ++j) {
      s[j] += slope * static_cast<float>(mha_kernel::alibi_distance(p, i, j0 + j));
    }
  }
}

}  // namespace mha_simd
