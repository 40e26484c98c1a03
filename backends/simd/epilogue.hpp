// The end of a row: one division by its softmax sum, the output written with
// the item's strides, and the natural log of its denominator.  A row in which
// no key took part is zeros with LSE -inf, never NaN.
#pragma once

#include <mha/mha.h>
#include <mha/plugin_abi.h>
#include <xsimd/xsimd.hpp>

#include <cmath>
#include <cstdint>
#include <limits>

#include "common/dtype.h"
#include "common/softmax.h"
#include "simd/convert.hpp"
#include "simd/tile_tools.hpp"

namespace mha_simd {

// out[x · out_stride] = acc[x] · acc_scale / sum for x < dv, rounded once
// to out_dtype (F32, BF16, F16); *lse (when not null) = ln(denominator): the
// row's maximum as a logit plus ln(sum), -inf when sum is 0.
template <class Arch>
inline void write_row(const float* acc, int64_t dv, float natural_max, float sum, float acc_scale,
                      void* out, int32_t out_dtype, int64_t out_stride, float* lse) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  // (A row a sink outweighs entirely has acc_scale 0: its values are
  // multiplied by it, so that a NaN among them stays NaN, as in IEEE
  // arithmetic and the reference.)
  const bool empty = sum == 0.0f;
  const float inv = empty ? 0.0f : acc_scale / sum;
  if (out_dtype != MHA_DTYPE_F32) {
    int64_t x = 0;
    if (out_stride == 1 && !empty) {
      with_dtype(out_dtype, [&](auto dt) {
        constexpr int32_t kOut = decltype(dt)::value;
        if constexpr (kOut == MHA_DTYPE_BF16 || kOut == MHA_DTYPE_F16) {
          auto* o = static_cast<element_t<kOut>*>(out);
          for (; x + W <= dv; x += W)
            store_narrow<Arch, kOut>(o + x, B::load_aligned(acc + x) * B(inv));
        }
      });
    }
    for (; x < dv; ++x) {
      mha_types::store_float(out, out_dtype, x * out_stride, empty ? 0.0f : acc[x] * inv);
    }
  } else if (empty) {
    auto* o = static_cast<float*>(out);
    for (int64_t x = 0; x < dv; ++x) o[x * out_stride] = 0.0f;
  } else if (out_stride == 1) {
    auto* o = static_cast<float*>(out);
    int64_t x = 0;
    for (; x + W <= dv; x += W) (B::load_aligned(acc + x) * B(inv)).store_unaligned(o + x);
    if (x < dv)
      store_partial<Arch>(o + x, B::load_aligned(acc + x) * B(inv), static_cast<int>(dv - x));
  } else {
    auto* o = static_cast<float*>(out);
    for (int64_t x = 0; x < dv; ++x) o[x * out_stride] = acc[x] * inv;
  }
  if (lse != nullptr) {
    *lse = sum == 0.0f ? -std::numeric_limits<float>::infinity() : natural_max + std::log(sum);
  }
}

// write_row for row (row_h, row_i) of a work item -- its maximum and sum in
// the given units -- into its output and LSE slots, with the head's
// attention sink (a logit; -inf: none) joining the denominator.  (The sink
// is folded in as a logit: in raw units a sink of 1e4 over a tiny |scale|
// would overflow.)
template <class Arch>
inline void write_item_row(const mha_work_item& item, int64_t row_h, int64_t row_i,
                           const float* acc, int64_t dv, float row_max, float sum, float sink,
                           const ScoreUnits& units) {
  mha_softmax::Row row{units.natural(row_max), sum};
  const float acc_scale = mha_softmax::fold_sink(row, sink, [](float d) { return std::exp(d); });
  write_row<Arch>(acc, dv, row.max, row.sum, acc_scale,
                  mha_types::element_at(item.out, item.out_dtype,
                                        row_h * item.out_strides[0] + row_i * item.out_strides[1]),
                  item.out_dtype, item.out_strides[2],
                  item.lse == nullptr
                      ? nullptr
                      : item.lse + row_h * item.lse_strides[0] + row_i * item.lse_strides[1]);
}

// Rows row_i0 .. row_i0 + n of a prefill tile (accumulators dvp floats
// apart from acc) written as write_item_row would, one row after another.
// The common case -- fp32 output with unit stride, no LSE, no sink -- goes
// straight to write_row, without write_item_row's per-row work on the
// sink, the units and the output's dtype (a tile's epilogue was 5-9 % of
// S4 and S5); the bits are the same.
template <class Arch>
inline void write_item_rows(const mha_work_item& item, int64_t row_h, int64_t row_i0, int64_t n,
                            const float* acc, int64_t dvp, int64_t dv, const float* row_max,
                            const float* row_sum, float sink, const ScoreUnits& units) {
  const bool plain = item.out_dtype == MHA_DTYPE_F32 && item.out_strides[2] == 1 &&
                     item.lse == nullptr && sink == -std::numeric_limits<float>::infinity();
  if (!plain) {
    for (int64_t r = 0; r < n; ++r) {
      write_item_row<Arch>(item, row_h, row_i0 + r, acc + r * dvp, dv, row_max[r], row_sum[r], sink,
                           units);
    }
    return;
  }
  auto* out = static_cast<float*>(item.out) + row_h * item.out_strides[0];
  for (int64_t r = 0; r < n; ++r) {
    // (No LSE: the row's maximum is not needed.)
    write_row<Arch>(acc + r * dvp, dv, 0.0f, row_sum[r], 1.0f,
                    out + (row_i0 + r) * item.out_strides[1], MHA_DTYPE_F32, 1, nullptr);
  }
}

}  // namespace mha_simd
