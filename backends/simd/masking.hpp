// What removes or reweights keys after the scores: the explicit mask (bool or
// additive, in the units of the scores), the causal / window / valid-length
// limits and dropout -- for a prefill tile (scores[j][lane], rows kStride
// floats apart) and for a decode row (s[j]).
#pragma once

#include <mha/plugin_abi.h>
#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/dropout.h"
#include "common/problem.h"
#include "simd/dropout_simd.hpp"
#include "simd/tile_tools.hpp"

namespace mha_simd {

// The explicit mask on a tile: queries q0 .. q0 + nq of head h, keys j0 ..
// j0 + keys, into scores[j][r].
template <class Arch, int kStride>
inline void apply_mask_tile(const mha_kernel_problem& p, float* scores, int64_t b, int64_t h,
                            int64_t q0, int64_t nq, int nqv, int64_t j0, int keys,
                            const ScoreUnits& units) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t ms = p.mask_strides[3];
  const bool is_bool = p.mask_kind == MHA_MASK_BOOL;
  if (p.mask_strides[2] == 0) {
    // The same mask row for every query of the tile (key padding): one
    // broadcast per key.
    const int64_t row = mha_kernel::mask_row_offset(p, b, h, q0) + j0 * ms;
    for (int j = 0; j < keys; ++j) {
      float* s = scores + j * kStride;
      if (is_bool) {
        if (static_cast<const uint8_t*>(p.mask)[row + j * ms] != 0) continue;
        for (int v = 0; v < nqv; ++v) B(kNegInf).store_aligned(s + v * W);
      } else {
        const B add(units.mask(mha_kernel::mask_value(p, row + j * ms)));
        for (int v = 0; v < nqv; ++v) (B::load_aligned(s + v * W) + add).store_aligned(s + v * W);
      }
    }
    return;
  }
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t row = mha_kernel::mask_row_offset(p, b, h, q0 + r) + j0 * ms;
    if (is_bool) {
      const auto* m = static_cast<const uint8_t*>(p.mask) + row;
      for (int j = 0; j < keys; ++j) {
        if (m[j * ms] == 0) scores[j * kStride + r] = kNegInf;
      }
    } else {
      for (int j = 0; j < keys; ++j) {
        scores[j * kStride + r] += units.mask(mha_kernel::mask_value(p, row + j * ms));
      }
    }
  }
}

// The explicit mask on one query's row of scores s[0, keys).
inline void apply_mask_row(const mha_kernel_problem& p, int64_t b, int64_t h, int64_t i, int64_t j0,
                           int keys, float* s, const ScoreUnits& units) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t ms = p.mask_strides[3];
  const int64_t row = mha_kernel::mask_row_offset(p, b, h, i) + j0 * ms;
  if (p.mask_kind == MHA_MASK_BOOL) {
    const auto* m = static_cast<const uint8_t*>(p.mask) + row;
    for (int j = 0; j < keys; ++j) {
      if (m[j * ms] == 0) s[j] = kNegInf;
    }
  } else {
    for (int j = 0; j < keys; ++j) s[j] += units.mask(mha_kernel::mask_value(p, row + j * ms));
  }
}

// Causal, window and valid-length limits on a tile: key j (relative to the
// item) is hidden from lane q when j < first_key[q] or j > last_key[q].  Only
// tiles that cross some query's limit get here.  The comparisons run in
// floats relative to the tile, where every value is a small integer: exact
// for any sequence length.  visibility_bounds writes them (bounds: 2·nqv·W
// floats, each lane's first and last visible key of the tile, -1 to keys).
template <class Arch>
inline void visibility_bounds(const int64_t* first_key, const int64_t* last_key, float* bounds,
                              int nqv, int64_t j_rel0, int keys) {
  constexpr int W = static_cast<int>(xsimd::batch<float, Arch>::size);
  const int64_t lanes = int64_t{nqv} * W;
  for (int64_t r = 0; r < lanes; ++r) {
    const int64_t first = std::min<int64_t>(std::max<int64_t>(first_key[r] - j_rel0, -1), keys);
    const int64_t last = std::min<int64_t>(std::max<int64_t>(last_key[r] - j_rel0, -1), keys);
    bounds[r] = static_cast<float>(first);
    bounds[lanes + r] = static_cast<float>(last);
  }
}

template <class Arch, int kStride>
inline void apply_visibility_tile(float* scores, const int64_t* first_key, const int64_t* last_key,
                                  float* bounds, int nqv, int64_t j_rel0, int keys) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t lanes = int64_t{nqv} * W;
  visibility_bounds<Arch>(first_key, last_key, bounds, nqv, j_rel0, keys);
  const float* tile_first = bounds;
  const float* tile_last = bounds + lanes;
  for (int v = 0; v < nqv; ++v) {
    const B first = B::load_aligned(tile_first + v * W);
    const B last = B::load_aligned(tile_last + v * W);
    for (int j = 0; j < keys; ++j) {
      float* s = scores + j * kStride + v * W;
      const B key = B(static_cast<float>(j));
      xsimd::select((key > last) || (key < first), B(kNegInf), B::load_aligned(s)).store_aligned(s);
    }
  }
}

// Dropout on a tile's probabilities, after the running sum took them: the sum
// (and the LSE) are those of the weights before dropout, as the softmax is.
template <class Arch, int kStride>
inline void apply_dropout_tile(float dropout_p, const uint32_t* row_keys, float* scores, int nqv,
                               int64_t j0, int keys) {
  using B = xsimd::batch<float, Arch>;
  using U = xsimd::batch<uint32_t, Arch>;
  constexpr int W = static_cast<int>(B::size);
  const DropoutFactor<Arch> factor(dropout_p);
  for (int v = 0; v < nqv; ++v) {
    const U rows = U::load_aligned(row_keys + v * W);
    for (int j = 0; j < keys; ++j) {
      float* s = scores + j * kStride + v * W;
      const uint32_t step = static_cast<uint32_t>(j0 + j) * mha_dropout::kKeyStep;
      (B::load_aligned(s) * factor(rows + U(step))).store_aligned(s);
    }
  }
}

// Dropout on one row's probabilities s[0, keys) (whole vectors).
template <class Arch>
inline void apply_dropout_row(float dropout_p, uint32_t row_key, int64_t j0, int keys, float* s) {
  using B = xsimd::batch<float, Arch>;
  using U = xsimd::batch<uint32_t, Arch>;
  constexpr int W = static_cast<int>(B::size);
  const DropoutFactor<Arch> factor(dropout_p);
  alignas(64) uint32_t lane_steps[W];
  for (int k = 0; k < W; ++k) lane_steps[k] = static_cast<uint32_t>(k) * mha_dropout::kKeyStep;
  const U lanes = U::load_aligned(lane_steps);
  for (int j = 0; j < keys; j += W) {
    const uint32_t first = row_key + static_cast<uint32_t>(j0 + j) * mha_dropout::kKeyStep;
    (B::load_aligned(s + j) * factor(U(first) + lanes)).store_aligned(s + j);
  }
}

}  // namespace mha_simd
