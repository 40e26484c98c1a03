// The tile softmax of the SIMD kernels: fold one tile of scores into the
// running maximum and sum, and turn the scores into probabilities, in both
// layouts -- vertical (prefill: one lane per query, no horizontal reduction)
// and along a row (decode: one row per query, reductions across lanes).  Both
// work in the units of ScoreUnits (tile_tools.hpp): base 2, or raw units on
// the careful path.
#pragma once

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "simd/exp2.hpp"
#include "simd/tile_tools.hpp"

#if defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace mha_simd {

// The largest lane of x (xsimd 8.1 has no such reducer).  Where a lane is
// NaN the answer may or may not be NaN: a caller that must see NaN looks at
// the lanes again (the rows layout's exps turn a NaN score into a NaN sum).
template <class Arch>
inline float horizontal_max(xsimd::batch<float, Arch> x) {
#if defined(__AVX512F__)
  if constexpr (std::is_base_of<xsimd::avx512f, Arch>::value) return _mm512_reduce_max_ps(x);
#endif
#if defined(__AVX__)
  if constexpr (std::is_base_of<xsimd::avx, Arch>::value) {
    const __m256 v = x;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
#endif
#if defined(__aarch64__)
  if constexpr (std::is_base_of<xsimd::neon64, Arch>::value) return vmaxvq_f32(x);
#endif
  using B = xsimd::batch<float, Arch>;
  alignas(64) float lanes[B::size];
  x.store_aligned(lanes);
  float m = lanes[0];
  for (size_t l = 1; l < B::size; ++l) m = std::max(m, lanes[l]);
  return m;
}

// 2^exponent of a score's distance d (<= 0) to the row maximum.
template <class Arch, bool kRaw>
inline xsimd::batch<float, Arch> exp_of_distance(xsimd::batch<float, Arch> d,
                                                 const ScoreUnits& units) {
  using B = xsimd::batch<float, Arch>;
  if constexpr (kRaw) return fast_exp2<Arch>((d * B(units.to_logit)) * B(kLog2e));
  return fast_exp2<Arch>(d);
}

// Vertical: scores[j][lane] of `keys` keys for nqv vectors of queries (rows
// kStride floats apart) become probabilities; row_max, row_sum and alpha (the
// factor that rescales what the rows accumulated) are updated per lane.
// Returns true when every lane now has a finite running maximum (what the
// prefill's fused path needs).
template <class Arch, int kStride, bool kRaw>
inline bool update_softmax_vertical(float* scores, float* row_max, float* row_sum, float* alpha_out,
                                    int nqv, int keys, const ScoreUnits& units) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  bool all_finite = true;
  for (int v = 0; v < nqv; ++v) {
    float* s = scores + v * W;
    B m0 = B::load_aligned(s), m1 = m0;
    int j = 1;
    for (; j + 1 < keys; j += 2) {
      m0 = xsimd::max(m0, B::load_aligned(s + j * kStride));
      m1 = xsimd::max(m1, B::load_aligned(s + (j + 1) * kStride));
    }
    if (j < keys) m0 = xsimd::max(m0, B::load_aligned(s + j * kStride));
    const B old_max = B::load_aligned(row_max + v * W);
    const B new_max = xsimd::max(old_max, xsimd::max(m0, m1));
    // A row that has seen no visible key yet keeps -inf; subtract 0 instead so
    // that -inf - -inf never happens (exp2 of -inf is 0).
    const B shift = xsimd::select(new_max == B(kNegInf), B(0.0f), new_max);
    const B alpha = exp_of_distance<Arch, kRaw>(old_max - shift, units);
    B sum0 = B::load_aligned(row_sum + v * W) * alpha, sum1 = B(0.0f);
    j = 0;
    for (; j + 1 < keys; j += 2) {
      const B e0 = exp_of_distance<Arch, kRaw>(B::load_aligned(s + j * kStride) - shift, units);
      const B e1 =
          exp_of_distance<Arch, kRaw>(B::load_aligned(s + (j + 1) * kStride) - shift, units);
      e0.store_aligned(s + j * kStride);
      e1.store_aligned(s + (j + 1) * kStride);
      sum0 += e0;
      sum1 += e1;
    }
    if (j < keys) {
      const B e0 = exp_of_distance<Arch, kRaw>(B::load_aligned(s + j * kStride) - shift, units);
      e0.store_aligned(s + j * kStride);
      sum0 += e0;
    }
    new_max.store_aligned(row_max + v * W);
    (sum0 + sum1).store_aligned(row_sum + v * W);
    alpha.store_aligned(alpha_out + v * W);
    all_finite = all_finite && xsimd::all(xsimd::abs(new_max) < B(1e30f));
  }
  return all_finite;
}

// Along a row: the scores s[0, keys) of one query become probabilities (the
// padding of the last vector, up to kPadded, gets weight exactly 0); returns
// the factor that rescales what the row accumulated so far.
template <class Arch, int kPadded, bool kRaw>
inline float update_softmax_row(float* s, int keys, float& row_max, float& row_sum,
                                const ScoreUnits& units) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int j = keys; j < kPadded && j % W != 0; ++j) s[j] = kNegInf;
  // The tile's maximum in vectors, NaN when a score is NaN (the row then
  // takes the raw pass).  Element by element, its chain of compares was a
  // tenth of a grouped decode's time (4 rows, D 128).
  B vector_max(kNegInf);
  auto nan = vector_max != vector_max;
  for (int j = 0; j < keys; j += W) {
    const B x = B::load_aligned(s + j);
    vector_max = xsimd::max(vector_max, x);
    nan = nan || x != x;
  }
  const float tile_max =
      xsimd::any(nan) ? std::numeric_limits<float>::quiet_NaN() : horizontal_max<Arch>(vector_max);
  const float new_max = tile_max != tile_max ? tile_max : std::max(row_max, tile_max);
  const float shift = new_max == kNegInf ? 0.0f : new_max;
  const float alpha = row_max == kNegInf ? 0.0f : std::exp2(units.exponent(row_max - shift));
  B sum(0.0f);
  const B shift_v(shift);
  for (int j = 0; j < keys; j += W) {
    const B e = exp_of_distance<Arch, kRaw>(B::load_aligned(s + j) - shift_v, units);
    e.store_aligned(s + j);
    sum += e;
  }
  row_max = new_max;
  row_sum = row_sum * alpha + xsimd::hadd(sum);
  return alpha;
}

}  // namespace mha_simd
