// The decode layout: vector lanes along the head dimension.
//
// With one (or a few) queries per head, lanes along the queries would idle
// 15 of 16 lanes.  Here the rows are the queries of all the query heads that
// share one KV head (grouped-query attention reads each K and V row once for
// all of them), and each row is a vector along D.  Scores of W keys are
// reduced together; the softmax runs along the keys.  Decoding is
// bound by reading K and V, so the kernel streams them once per item.
#pragma once

#include <mha/plugin_abi.h>
#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/attention_rules.h"
#include "common/dropout.h"
#include "simd/blocking.hpp"
#include "simd/dropout_simd.hpp"
#include "simd/exp2.hpp"
#include "simd/row_sums.hpp"
#include "simd/tile_tools.hpp"

namespace mha_simd {

template <class Arch>
class DecodeKernel {
  using B = xsimd::batch<float, Arch>;
  static constexpr int W = static_cast<int>(B::size);
  static constexpr int KT = Blocking<Arch>::kDecodeKeyTile;
  static constexpr int KTP = (KT + W - 1) / W * W;

  struct Rows {
    int64_t count;
    float* q;           // [rows][Dp], times scale·log2(e), zero-padded
    float* acc;         // [rows][Dvp]
    float* scores;      // [rows][KTP]
    float* row_max;     // [rows]
    float* row_sum;     // [rows]
    int64_t* last_key;  // [rows], absolute key index
    uint32_t* row_key;  // [rows]: dropout hash of each row
    float* k_pack;      // [KT][Dp]
    float* v_pack;      // [KT][Dvp]
    uint8_t* removed;   // [KT]: keys a mask removed from the current row
  };

 public:
  static size_t scratch_bytes(const mha_kernel_problem& p, int64_t max_queries) {
    const int64_t rows = (p.heads / p.kv_heads) * max_queries;
    const int64_t dp = round_up(p.d, W), dvp = round_up(p.dv, W);
    return ScratchCarver::bytes({rows * dp, rows * dvp, rows * KTP, rows, rows, 2 * rows, rows,
                                 KT * dp, KT * dvp, KT / 4 + 1});
  }

  static void run(const mha_kernel_problem& p, const mha_work_item& item, void* scratch) {
    const int64_t nq = item.q_end - item.q_begin;
    const int64_t dp = round_up(p.d, W), dvp = round_up(p.dv, W);
    Rows rows{};
    rows.count = (item.h_end - item.h_begin) * nq;
    ScratchCarver carve(scratch);
    rows.q = carve.floats(rows.count * dp);
    rows.acc = carve.floats(rows.count * dvp);
    rows.scores = carve.floats(rows.count * KTP);
    rows.row_max = carve.floats(rows.count);
    rows.row_sum = carve.floats(rows.count);
    rows.last_key = reinterpret_cast<int64_t*>(carve.floats(2 * rows.count));
    rows.row_key = reinterpret_cast<uint32_t*>(carve.floats(rows.count));
    rows.k_pack = carve.floats(KT * dp);
    rows.v_pack = carve.floats(KT * dvp);
    rows.removed = reinterpret_cast<uint8_t*>(carve.floats(KT / 4 + 1));

    // Scores in base-2 units; a row that came out non-finite (a -inf logit
    // from the data, a logit past FLT_MAX / log2 e, NaN or infinite values)
    // has the item computed again in raw units (ScoreUnits).
    ScoreUnits units = ScoreUnits::base2(p.scale);
    if (!compute(p, item, rows, nq, units)) {
      units = ScoreUnits::raw_units(p.scale);
      compute(p, item, rows, nq, units);
    }
    write_rows(p, item, rows, nq, units);
  }

 private:
  // One pass over the item's keys; returns false when a row needs the raw
  // pass: its accumulator is not finite, or it has visible keys but no weight.
  template <bool kRaw>
  static bool compute_in(const mha_kernel_problem& p, const mha_work_item& item, const Rows& rows,
                         int64_t nq, const ScoreUnits& units) {
    const int64_t dp = round_up(p.d, W), dvp = round_up(p.dv, W);
    const int64_t b = item.b;
    const int64_t kvh = mha_kernel::kv_head_of(p, item.h_begin);
    const float c = units.q_factor;
    int64_t max_last = item.k_begin - 1;
    for (int64_t r = 0; r < rows.count; ++r) {
      const int64_t h = item.h_begin + r / nq, i = item.q_begin + r % nq;
      const int64_t last = std::min(mha_kernel::last_visible_key(p, b, i), item.k_end - 1);
      max_last = std::max(max_last, last);
      rows.last_key[r] = last;
      rows.row_key[r] = mha_dropout::row_key(p.dropout_seed, b, h, i, p.heads, p.lq);
      const float* q = mha_kernel::q_row(p, b, h, i);
      float* dst = rows.q + r * dp;
      for (int64_t x = 0; x < p.d; ++x) dst[x] = q[x * p.q_strides[3]] * c;
      for (int64_t x = p.d; x < dp; ++x) dst[x] = 0.0f;
      rows.row_max[r] = kNegInf;
      rows.row_sum[r] = 0.0f;
    }
    std::fill(rows.acc, rows.acc + rows.count * dvp, 0.0f);

    const bool k_direct = p.k_strides[3] == 1 && p.d % W == 0;
    const bool v_direct = p.v_strides[3] == 1 && p.dv % W == 0;
    for (int64_t j0 = item.k_begin; j0 <= max_last; j0 += KT) {
      const int keys = static_cast<int>(std::min<int64_t>(KT, max_last + 1 - j0));
      const float* k_rows = mha_kernel::k_row(p, b, kvh, j0);
      int64_t k_stride = p.k_strides[2];
      if (!k_direct) {
        pack_rows(k_rows, p.k_strides[2], p.k_strides[3], keys, p.d, rows.k_pack, dp);
        k_rows = rows.k_pack;
        k_stride = dp;
      }
      const float* v_rows = mha_kernel::v_row(p, b, kvh, j0);
      int64_t v_stride = p.v_strides[2];
      if (!v_direct) {
        pack_rows(v_rows, p.v_strides[2], p.v_strides[3], keys, p.dv, rows.v_pack, dvp);
        v_rows = rows.v_pack;
        v_stride = dvp;
      }
      int v_finite = -1;  // not checked yet
      for (int64_t r = 0; r < rows.count; ++r) {
        const int64_t h = item.h_begin + r / nq, i = item.q_begin + r % nq;
        float* s = rows.scores + r * KTP;
        row_scores(rows.q + r * dp, dp, k_rows, k_stride, keys, s);
        if (p.mask_kind != MHA_MASK_NONE) apply_mask(p, b, h, i, j0, keys, s, units);
        const int64_t hidden_from = rows.last_key[r] + 1 - j0;
        for (int64_t j = std::max<int64_t>(hidden_from, 0); j < keys; ++j) s[j] = kNegInf;
        // A key a mask or a -inf logit removed must not pass on a NaN or
        // infinity of its V row through 0 · V: rows with removed keys check
        // the tile once.
        const bool masked =
            p.mask_kind != MHA_MASK_NONE || hidden_from < keys || has_minus_inf(s, keys);
        if (masked && v_finite < 0) v_finite = rows_finite(v_rows, v_stride, keys, dvp) ? 1 : 0;
        const bool guarded = masked && v_finite == 0;
        if (guarded) {
          for (int j = 0; j < keys; ++j) rows.removed[j] = s[j] == kNegInf;
        }
        const float alpha = update_softmax<kRaw>(s, keys, rows.row_max[r], rows.row_sum[r], units);
        if (p.dropout_p > 0.0f) apply_dropout(p.dropout_p, rows.row_key[r], j0, keys, s);
        if (guarded) {
          accumulate_pv_guarded(s, rows.removed, keys, alpha, v_rows, v_stride, dvp,
                                rows.acc + r * dvp);
        } else {
          accumulate_pv(s, keys, alpha, v_rows, v_stride, dvp, rows.acc + r * dvp);
        }
      }
    }
    // A row with visible keys but no weight: a mask removed every key, or its
    // logits overflowed to -inf in base-2 units (the raw pass finds it).
    for (int64_t r = 0; r < rows.count; ++r) {
      if (rows.row_sum[r] == 0.0f && rows.last_key[r] >= item.k_begin) return false;
    }
    B poison(0.0f);  // a - a is 0 for finite a, NaN for NaN and infinities
    for (int64_t x = 0; x < rows.count * dvp; x += W) {
      const B a = B::load_aligned(rows.acc + x);
      poison += a - a;
    }
    return xsimd::all(poison == poison);
  }

  static bool compute(const mha_kernel_problem& p, const mha_work_item& item, const Rows& rows,
                      int64_t nq, const ScoreUnits& units) {
    return units.raw ? compute_in<true>(p, item, rows, nq, units)
                     : compute_in<false>(p, item, rows, nq, units);
  }

  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // s[j] = q · K[j] for the tile's keys, W keys per horizontal reduction.
  static void row_scores(const float* q, int64_t dp, const float* k_rows, int64_t k_stride,
                         int keys, float* s) {
    for (int j0 = 0; j0 < keys; j0 += W) {
      const int n = std::min(W, keys - j0);
      B acc[W];
      for (int k = 0; k < W; ++k) acc[k] = B(0.0f);
      for (int64_t x = 0; x < dp; x += W) {
        const B qv = B::load_aligned(q + x);
        for (int k = 0; k < n; ++k) {
          acc[k] = xsimd::fma(qv, B::load_unaligned(k_rows + (j0 + k) * k_stride + x), acc[k]);
        }
      }
      sums_of<Arch>(acc).store_aligned(s + j0);
    }
  }

  static void apply_mask(const mha_kernel_problem& p, int64_t b, int64_t h, int64_t i, int64_t j0,
                         int keys, float* s, const ScoreUnits& units) {
    const int64_t ms = p.mask_strides[3];
    const int64_t row = mha_kernel::mask_row_offset(p, b, h, i) + j0 * ms;
    if (p.mask_kind == MHA_MASK_BOOL) {
      const auto* m = static_cast<const uint8_t*>(p.mask) + row;
      for (int j = 0; j < keys; ++j) {
        if (m[j * ms] == 0) s[j] = kNegInf;
      }
    } else {
      const auto* m = static_cast<const float*>(p.mask) + row;
      for (int j = 0; j < keys; ++j) s[j] += units.mask(m[j * ms]);
    }
  }

  // Online softmax of one row over one key tile; returns the factor that
  // rescales what the row accumulated so far.
  template <bool kRaw>
  static float update_softmax(float* s, int keys, float& row_max, float& row_sum,
                              const ScoreUnits& units) {
    float tile_max = kNegInf;
    for (int j = 0; j < keys; ++j) tile_max = (s[j] > tile_max || s[j] != s[j]) ? s[j] : tile_max;
    const float new_max = tile_max != tile_max ? tile_max : std::max(row_max, tile_max);
    const float shift = new_max == kNegInf ? 0.0f : new_max;
    const float alpha = row_max == kNegInf ? 0.0f : std::exp2(units.exponent(row_max - shift));
    // The padding keys of the last vector get weight exactly 0.
    for (int j = keys; j < KTP && j % W != 0; ++j) s[j] = kNegInf;
    B sum(0.0f);
    const B shift_v(shift);
    for (int j = 0; j < keys; j += W) {
      B d = B::load_aligned(s + j) - shift_v;
      if constexpr (kRaw) d = (d * B(units.abs_scale)) * B(kLog2e);
      const B e = fast_exp2<Arch>(d);
      e.store_aligned(s + j);
      sum += e;
    }
    row_max = new_max;
    row_sum = row_sum * alpha + xsimd::hadd(sum);
    return alpha;
  }

  // Dropout after the running sum took the weights (the softmax's sum is that
  // of the weights before dropout).
  static void apply_dropout(float p, uint32_t row_key, int64_t j0, int keys, float* s) {
    using U = xsimd::batch<uint32_t, Arch>;
    const DropoutFactor<Arch> factor(p);
    alignas(64) uint32_t lane_steps[W];
    for (int k = 0; k < W; ++k) lane_steps[k] = static_cast<uint32_t>(k) * mha_dropout::kKeyStep;
    const U lanes = U::load_aligned(lane_steps);
    for (int j = 0; j < keys; j += W) {
      const uint32_t first = row_key + static_cast<uint32_t>(j0 + j) * mha_dropout::kKeyStep;
      (B::load_aligned(s + j) * factor(U(first) + lanes)).store_aligned(s + j);
    }
  }

  // acc = acc · alpha + Σ_j p_j · V_j.  Summed in two levels -- runs of kRun
  // keys from zero, then the runs into the tile's total -- so that rounding
  // grows with kRun + keys / kRun rather than with the number of keys (which
  // matters when many keys are alike and their rounding errors do not cancel).
  static void accumulate_pv(const float* probs, int keys, float alpha, const float* v_rows,
                            int64_t v_stride, int64_t dvp, float* acc) {
    constexpr int kRun = 32;
    constexpr int NC = Blocking<Arch>::kDecodePvVectors;
    for (int64_t c0 = 0; c0 < dvp; c0 += NC * W) {
      const int nc = static_cast<int>(std::min<int64_t>(NC, (dvp - c0) / W));
      B total[NC];
      for (int c = 0; c < nc; ++c) total[c] = B(0.0f);
      for (int j0 = 0; j0 < keys; j0 += kRun) {
        const int end = std::min(keys, j0 + kRun);
        B o[NC];
        for (int c = 0; c < nc; ++c) o[c] = B(0.0f);
        for (int j = j0; j < end; ++j) {
          const B pj(probs[j]);
          const float* v = v_rows + j * v_stride + c0;
          for (int c = 0; c < nc; ++c) o[c] = xsimd::fma(pj, B::load_unaligned(v + c * W), o[c]);
        }
        for (int c = 0; c < nc; ++c) total[c] += o[c];
      }
      const B a(alpha);
      for (int c = 0; c < nc; ++c) {
        xsimd::fma(B::load_aligned(acc + c0 + c * W), a, total[c]).store_aligned(acc + c0 + c * W);
      }
    }
  }

  static bool has_minus_inf(const float* s, int keys) {
    auto found = B(0.0f) != B(0.0f);
    int j = 0;
    for (; j + W <= keys; j += W) found = found || B::load_aligned(s + j) == B(kNegInf);
    bool any = xsimd::any(found);
    for (; j < keys; ++j) any = any || s[j] == kNegInf;
    return any;
  }

  static bool rows_finite(const float* v_rows, int64_t v_stride, int keys, int64_t dvp) {
    B poison(0.0f);  // v - v is 0 for finite v, NaN for NaN and infinities
    for (int j = 0; j < keys; ++j) {
      for (int64_t x = 0; x < dvp; x += W) {
        const B v = B::load_unaligned(v_rows + j * v_stride + x);
        poison += v - v;
      }
    }
    return xsimd::all(poison == poison);
  }

  // P·V of one row skipping removed keys: the rare path of V with non-finite values.
  static void accumulate_pv_guarded(const float* probs, const uint8_t* removed, int keys,
                                    float alpha, const float* v_rows, int64_t v_stride, int64_t dvp,
                                    float* acc) {
    for (int64_t x = 0; x < dvp; ++x) acc[x] *= alpha;
    for (int j = 0; j < keys; ++j) {
      if (removed[j]) continue;
      const float* v = v_rows + j * v_stride;
      for (int64_t x = 0; x < dvp; ++x) acc[x] += probs[j] * v[x];
    }
  }

  static void write_rows(const mha_kernel_problem& p, const mha_work_item& item, const Rows& rows,
                         int64_t nq, const ScoreUnits& units) {
    const int64_t dvp = round_up(p.dv, W);
    for (int64_t r = 0; r < rows.count; ++r) {
      const float sum = rows.row_sum[r];
      const bool empty = sum == 0.0f;
      const float inv = empty ? 0.0f : 1.0f / sum;
      const int64_t row_h = r / nq, row_i = r % nq;
      float* out = item.out + row_h * item.out_strides[0] + row_i * item.out_strides[1];
      const float* acc = rows.acc + r * dvp;
      for (int64_t x = 0; x < p.dv; ++x) {
        out[x * item.out_strides[2]] = empty ? 0.0f : acc[x] * inv;
      }
      if (item.lse != nullptr) {
        item.lse[row_h * item.lse_strides[0] + row_i * item.lse_strides[1]] =
            empty ? kNegInf : units.lse(rows.row_max[r], sum);
      }
    }
  }
};

}  // namespace mha_simd
