// The rare path of non-finite data.  A key that a mask or a -inf logit
// removed must not pass on a NaN or infinity of its V row through 0 · V, and a
// row whose result came out non-finite is computed again carefully.  The
// checks are cheap vector sweeps; the guarded P·V is plain loops, as it only
// runs on tiles whose V holds NaN or infinities.
#pragma once

#include <xsimd/xsimd.hpp>

#include <cstdint>
#include <limits>

#include "simd/convert.hpp"

namespace mha_simd {

// True when every one of the n floats at data (a multiple of W, aligned) is finite.
// a - a is 0 for finite a, NaN for NaN and infinities; four sums, so that the
// additions' latency does not bind (one chain made this check 3 % of S4).
template <class Arch>
inline bool all_finite(const float* data, int64_t n) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  B poison[4] = {B(0.0f), B(0.0f), B(0.0f), B(0.0f)};
  int64_t x = 0;
  for (; x + 4 * W <= n; x += 4 * W) {
    for (int c = 0; c < 4; ++c) {
      const B a = B::load_aligned(data + x + c * W);
      poison[c] += a - a;
    }
  }
  for (; x < n; x += W) {
    const B a = B::load_aligned(data + x);
    poison[0] += a - a;
  }
  const B all = (poison[0] + poison[1]) + (poison[2] + poison[3]);
  return xsimd::all(all == all);
}

// True when every value of `keys` V rows (dvp floats each) is finite (four
// sums, as all_finite).
template <class Arch>
inline bool rows_finite(const float* v_rows, int64_t v_stride, int keys, int64_t dvp) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  B poison[4] = {B(0.0f), B(0.0f), B(0.0f), B(0.0f)};
  int j = 0;
  for (; j + 4 <= keys; j += 4) {
    for (int64_t x = 0; x < dvp; x += W) {
      for (int c = 0; c < 4; ++c) {
        const B v = B::load_unaligned(v_rows + (j + c) * v_stride + x);
        poison[c] += v - v;
      }
    }
  }
  for (; j < keys; ++j) {
    for (int64_t x = 0; x < dvp; x += W) {
      const B v = B::load_unaligned(v_rows + j * v_stride + x);
      poison[0] += v - v;
    }
  }
  const B all = (poison[0] + poison[1]) + (poison[2] + poison[3]);
  return xsimd::all(all == all);
}

// rows_finite for rows of dtype kKv read in place: half-precision values
// widened; int8 values are always finite, so their rows' scales are checked.
template <class Arch, int32_t kKv>
inline bool typed_rows_finite(const element_t<kKv>* v_rows, int64_t v_stride, int keys, int64_t dvp,
                              const float* scales, int64_t scale_stride) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  if constexpr (kKv == MHA_DTYPE_I8) {
    float poison = 0.0f;
    for (int j = 0; j < keys; ++j) poison += scales[j * scale_stride] - scales[j * scale_stride];
    return poison == poison;
  } else {
    B poison(0.0f);
    for (int j = 0; j < keys; ++j) {
      for (int64_t x = 0; x < dvp; x += W) {
        const B v = load_widen<Arch, kKv>(v_rows + j * v_stride + x);
        poison += v - v;
      }
    }
    return xsimd::all(poison == poison);
  }
}

// True when a score of s[0, keys) is -inf (a key the data itself removed).
template <class Arch>
inline bool has_minus_inf(const float* s, int keys) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  auto found = B(0.0f) != B(0.0f);
  int j = 0;
  for (; j + W <= keys; j += W) found = found || B::load_aligned(s + j) == B(kNegInf);
  bool any = xsimd::any(found);
  for (; j < keys; ++j) any = any || s[j] == kNegInf;
  return any;
}

// acc = acc · alpha + Σ_j p_j · V_j over the keys not removed, for one row:
// probs[j · p_stride], removed[j · p_stride].
inline void pv_guarded_row(const float* probs, const uint8_t* removed, int64_t p_stride, int keys,
                           float alpha, const float* v_rows, int64_t v_stride, int64_t dvp,
                           float* acc) {
  for (int64_t x = 0; x < dvp; ++x) acc[x] *= alpha;
  for (int j = 0; j < keys; ++j) {
    if (removed[j * p_stride]) continue;
    const float pj = probs[j * p_stride];
    const float* v = v_rows + j * v_stride;
    for (int64_t x = 0; x < dvp; ++x) acc[x] += pj * v[x];
  }
}

}  // namespace mha_simd
