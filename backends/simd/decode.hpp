// The decode layout: vector lanes along the head dimension.
//
// With one (or a few) queries per head, lanes along the queries would idle
// 15 of 16 lanes.  Here the rows are the queries of all the query heads that
// share one KV head (grouped-query attention reads each K and V row once for
// all of them), and each row is a vector along D.  Scores of W keys are
// reduced together; the softmax runs along the keys.  Decoding is bound by
// reading K and V, so the kernel streams them once per item.
//
// This file composes the pieces: the row micro-kernels (row_kernels.hpp),
// the row softmax (softmax.hpp), masks and dropout (masking.hpp), the careful
// path (nonfinite.hpp) and the row epilogue (epilogue.hpp).
#pragma once

#include <mha/plugin_abi.h>
#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/dropout.h"
#include "common/problem.h"
#include "simd/blocking.hpp"
#include "simd/convert.hpp"
#include "simd/epilogue.hpp"
#include "simd/masking.hpp"
#include "simd/nonfinite.hpp"
#include "simd/row_kernels.hpp"
#include "simd/score_variants.hpp"
#include "simd/softmax.hpp"
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
    float* q;            // [rows][Dp], times scale·log2(e), zero-padded
    float* acc;          // [rows][Dvp]
    float* scores;       // [rows][KTP]
    float* row_max;      // [rows]
    float* row_sum;      // [rows]
    int64_t* first_key;  // [rows], absolute key index (window, item)
    int64_t* last_key;   // [rows], absolute key index
    uint32_t* row_key;   // [rows]: dropout hash of each row
    float* k_pack;       // [KT][Dp]
    float* v_pack;       // [KT][Dvp]
    float* pv_total;     // [kDecodeRows][Dvp]: rows_pv's tile sums
    uint8_t* removed;    // [KT]: keys a mask removed from the current row
    int64_t* queued;     // [rows]: the rows whose P·V runs grouped
    float* alpha;        // [rows]: their accumulators' rescaling
  };
  static constexpr int kGroup = Blocking<Arch>::kDecodeRows;

  // Calls f(r0, std::integral_constant<int, n>) for groups of n <= kGroup
  // rows covering [0, count).
  template <class F>
  static void for_row_groups(int64_t count, F&& f) {
    for (int64_t r0 = 0; r0 < count; r0 += kGroup) {
      with_count<kGroup>(static_cast<int>(std::min<int64_t>(kGroup, count - r0)),
                         [&](auto n) { f(r0, n); });
    }
  }

 public:
  static size_t scratch_bytes(const mha_kernel_problem& p, int64_t max_queries) {
    const int64_t rows = (p.heads / p.kv_heads) * max_queries;
    const int64_t dp = round_up(p.d, W), dvp = round_up(p.dv, W);
    return ScratchCarver::bytes({rows * dp, rows * dvp, rows * KTP, rows, rows, 2 * rows, 2 * rows,
                                 rows, KT * dp, KT * dvp, kGroup * dvp, KT / 4 + 1, 2 * rows,
                                 rows});
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
    rows.first_key = reinterpret_cast<int64_t*>(carve.floats(2 * rows.count));
    rows.last_key = reinterpret_cast<int64_t*>(carve.floats(2 * rows.count));
    rows.row_key = reinterpret_cast<uint32_t*>(carve.floats(rows.count));
    rows.k_pack = carve.floats(KT * dp);
    rows.v_pack = carve.floats(KT * dvp);
    rows.pv_total = carve.floats(kGroup * dvp);
    rows.removed = reinterpret_cast<uint8_t*>(carve.floats(KT / 4 + 1));
    rows.queued = reinterpret_cast<int64_t*>(carve.floats(2 * rows.count));
    rows.alpha = carve.floats(rows.count);

    // Scores in base-2 units; a row that came out non-finite (a -inf logit
    // from the data, a logit past FLT_MAX / log2 e, NaN or infinite values)
    // has the item computed again in raw units (ScoreUnits).
    ScoreUnits units = ScoreUnits::base2(p.scale);
    if (!compute(p, item, rows, nq, units)) {
      units = ScoreUnits::raw_units(p.scale);
      compute(p, item, rows, nq, units);
    }
    for (int64_t r = 0; r < rows.count; ++r) {
      const int64_t row_h = r / nq, row_i = r % nq;
      write_item_row<Arch>(item, row_h, row_i, rows.acc + r * dvp, p.dv, rows.row_max[r],
                           rows.row_sum[r], mha_kernel::sink_logit(p, item.h_begin + row_h), units);
    }
  }

 private:
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  static bool compute(const mha_kernel_problem& p, const mha_work_item& item, const Rows& rows,
                      int64_t nq, const ScoreUnits& units) {
    bool ok = false;
    with_dtype(p.kv_dtype, [&](auto kv) {
      constexpr int32_t kKv = decltype(kv)::value;
      ok = units.raw ? compute_in<true, kKv>(p, item, rows, nq, units)
                     : compute_in<false, kKv>(p, item, rows, nq, units);
    });
    return ok;
  }

  // One pass over the item's keys; returns false when a row needs the raw
  // pass: its accumulator is not finite, or it has visible keys but no weight.
  // K and V of dtype kKv are read in place and widened in registers (int8:
  // the key's scale folded into its score, the value's into its weight), or
  // widened into packed fp32 tiles when their rows are strided.
  template <bool kRaw, int32_t kKv>
  static bool compute_in(const mha_kernel_problem& p, const mha_work_item& item, const Rows& rows,
                         int64_t nq, const ScoreUnits& units) {
    using T = element_t<kKv>;
    constexpr bool kInt8 = kKv == MHA_DTYPE_I8;
    const int64_t dp = round_up(p.d, W), dvp = round_up(p.dv, W);
    const int64_t b = item.b;
    const int64_t kvh = mha_kernel::kv_head_of(p, item.h_begin);
    const float c = units.q_factor;
    int64_t max_last = item.k_begin - 1, min_first = item.k_end;
    for (int64_t r = 0; r < rows.count; ++r) {
      const int64_t h = item.h_begin + r / nq, i = item.q_begin + r % nq;
      const int64_t last = std::min(mha_kernel::last_visible_key(p, b, i), item.k_end - 1);
      const int64_t first = std::max(mha_kernel::first_visible_key(p, i), item.k_begin);
      if (first <= last) {
        max_last = std::max(max_last, last);
        min_first = std::min(min_first, first);
      }
      rows.first_key[r] = first;
      rows.last_key[r] = last;
      rows.row_key[r] = mha_dropout::row_key(p.dropout_seed, b, h, i, p.heads, p.lq);
      const int64_t q_at = b * p.q_strides[0] + h * p.q_strides[1] + i * p.q_strides[2];
      float* dst = rows.q + r * dp;
      for (int64_t x = 0; x < p.d; ++x) {
        dst[x] = mha_types::load_float(p.q, p.q_dtype, q_at + x * p.q_strides[3]) * c;
      }
      for (int64_t x = p.d; x < dp; ++x) dst[x] = 0.0f;
      rows.row_max[r] = kNegInf;
      rows.row_sum[r] = 0.0f;
    }
    std::fill(rows.acc, rows.acc + rows.count * dvp, 0.0f);

    const bool k_direct = p.k_strides[3] == 1 && p.d % W == 0;
    const bool v_direct = p.v_strides[3] == 1 && p.dv % W == 0;
    for (int64_t j0 = min_first; j0 <= max_last; j0 += KT) {
      const int keys = static_cast<int>(std::min<int64_t>(KT, max_last + 1 - j0));
      const float* k_scale = kInt8 ? mha_kernel::k_scales(p, b, kvh, j0) : nullptr;
      const float* v_scale = kInt8 ? mha_kernel::v_scales(p, b, kvh, j0) : nullptr;
      const int64_t ks = p.k_scale_strides[2], vs = p.v_scale_strides[2];
      const T* k_typed = mha_kernel::k_row<T>(p, b, kvh, j0);
      const float* k_packed = nullptr;
      if (!k_direct) {
        widen_rows<Arch, kKv>(k_typed, p.k_strides[2], p.k_strides[3], keys, p.d, k_scale, ks,
                              rows.k_pack, dp);
        k_packed = rows.k_pack;
      }
      const T* v_typed = mha_kernel::v_row<T>(p, b, kvh, j0);
      const float* v_rows = nullptr;  // fp32 rows, once V is packed
      int64_t v_stride = dvp;
      if (!v_direct) {
        widen_rows<Arch, kKv>(v_typed, p.v_strides[2], p.v_strides[3], keys, p.dv, v_scale, vs,
                              rows.v_pack, dvp);
        v_rows = rows.v_pack;
      } else if constexpr (kKv == MHA_DTYPE_F32) {
        v_rows = reinterpret_cast<const float*>(v_typed);
        v_stride = p.v_strides[2];
      }
      // 1. Every row's scores, each K vector loaded once for a group of rows.
      for_row_groups(rows.count, [&](int64_t r0, auto n) {
        constexpr int N = decltype(n)::value;
        if (k_direct) {
          rows_scores<Arch, kKv, N>(rows.q + r0 * dp, dp, k_typed, p.k_strides[2], keys,
                                    rows.scores + r0 * KTP, KTP);
        } else {
          rows_scores<Arch, MHA_DTYPE_F32, N>(rows.q + r0 * dp, dp, k_packed, dp, keys,
                                              rows.scores + r0 * KTP, KTP);
        }
      });
      if constexpr (kInt8) {
        if (k_direct) {
          for (int64_t r = 0; r < rows.count; ++r) {
            float* s = rows.scores + r * KTP;
            for (int j = 0; j < keys; ++j) s[j] *= k_scale[j * ks];
          }
        }
      }
      // 2. Row by row: the variants, masks, the softmax and dropout.  A row
      // whose removed keys could pass on a non-finite V takes the guarded
      // P·V at once; the others are queued for step 3.
      int v_finite = -1;  // not checked yet
      int64_t queued = 0;
      for (int64_t r = 0; r < rows.count; ++r) {
        const int64_t h = item.h_begin + r / nq, i = item.q_begin + r % nq;
        float* s = rows.scores + r * KTP;
        if (mha_kernel::has_score_variants(p)) {
          apply_score_variants_row<Arch>(p, s, b, h, i, j0, keys, units);
        }
        if (p.mask_kind != MHA_MASK_NONE) apply_mask_row(p, b, h, i, j0, keys, s, units);
        const int64_t hidden_from = rows.last_key[r] + 1 - j0;
        const int64_t hidden_below = rows.first_key[r] - j0;  // the window's start
        for (int64_t j = std::max<int64_t>(hidden_from, 0); j < keys; ++j) s[j] = kNegInf;
        for (int64_t j = 0; j < std::min<int64_t>(hidden_below, keys); ++j) s[j] = kNegInf;
        // A key a mask or a -inf logit removed must not pass on a NaN or
        // infinity of its V row through 0 · V: rows with removed keys check
        // the tile once (the guarded P·V then reads fp32 rows: V in place is
        // widened into the packed tile first).
        const bool masked = p.mask_kind != MHA_MASK_NONE || hidden_from < keys ||
                            hidden_below > 0 || has_minus_inf<Arch>(s, keys);
        if (masked && v_finite < 0) {
          if (v_rows != nullptr) {
            v_finite = rows_finite<Arch>(v_rows, v_stride, keys, dvp) ? 1 : 0;
          } else {
            v_finite = typed_rows_finite<Arch, kKv>(v_typed, p.v_strides[2], keys, dvp, v_scale, vs)
                           ? 1
                           : 0;
            if (v_finite == 0) {
              widen_rows<Arch, kKv>(v_typed, p.v_strides[2], 1, keys, p.dv, v_scale, vs,
                                    rows.v_pack, dvp);
              v_rows = rows.v_pack;
              v_stride = dvp;
            }
          }
        }
        const bool skip_removed = masked && v_finite == 0;
        if (skip_removed) {
          for (int j = 0; j < keys; ++j) rows.removed[j] = s[j] == kNegInf;
        }
        const float alpha =
            update_softmax_row<Arch, KTP, kRaw>(s, keys, rows.row_max[r], rows.row_sum[r], units);
        if (p.dropout_p > 0.0f) {
          apply_dropout_row<Arch>(p.dropout_p, rows.row_key[r], j0, keys, s);
        }
        if (skip_removed) {  // v_rows is the packed fp32 tile here
          pv_guarded_row(s, rows.removed, 1, keys, alpha, v_rows, v_stride, dvp,
                         rows.acc + r * dvp);
        } else {
          rows.queued[queued] = r;
          rows.alpha[queued++] = alpha;
        }
      }
      // 3. P·V of the queued rows, each V vector loaded once for a group.
      if constexpr (kInt8) {
        if (v_rows == nullptr) {  // V read in place: its scales go into the weights
          for (int64_t n = 0; n < queued; ++n) {
            float* s = rows.scores + rows.queued[n] * KTP;
            for (int j = 0; j < keys; ++j) s[j] *= v_scale[j * vs];  // after the row's sum
          }
        }
      }
      for_row_groups(queued, [&](int64_t g0, auto n) {
        constexpr int N = decltype(n)::value;
        const float* probs[N];
        float* acc[N];
        for (int g = 0; g < N; ++g) {
          probs[g] = rows.scores + rows.queued[g0 + g] * KTP;
          acc[g] = rows.acc + rows.queued[g0 + g] * dvp;
        }
        if (v_rows != nullptr) {
          rows_pv<Arch, MHA_DTYPE_F32, N>(probs, rows.alpha + g0, v_rows, v_stride, keys, dvp, acc,
                                          rows.pv_total);
        } else {
          rows_pv<Arch, kKv, N>(probs, rows.alpha + g0, v_typed, p.v_strides[2], keys, dvp, acc,
                                rows.pv_total);
        }
      });
    }
    // A row with visible keys but no weight: a mask removed every key, or its
    // logits overflowed to -inf in base-2 units (the raw pass finds it).
    for (int64_t r = 0; r < rows.count; ++r) {
      if (rows.row_sum[r] == 0.0f && rows.last_key[r] >= rows.first_key[r]) return false;
    }
    return all_finite<Arch>(rows.acc, rows.count * dvp);
  }
};

}  // namespace mha_simd
