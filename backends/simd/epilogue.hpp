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
#include "simd/nonfinite.hpp"
#include "simd/tile_tools.hpp"

namespace mha_simd {

// o[x] = acc[x] · inv for x < dv (fp32, unit stride); returns, lane by lane,
// the sum of v - v over the values stored: 0 when all are finite, NaN
// otherwise (write_item_rows checks it; write_row drops it, and the compiler
// with it).
template <class Arch>
inline xsimd::batch<float, Arch> store_scaled_row(const float* acc, int64_t dv, float inv,
                                                  float* o) {
  using B = xsimd::batch<float, Arch>;
  constexpr int W = static_cast<int>(B::size);
  B poison(0.0f);
  int64_t x = 0;
  for (; x + W <= dv; x += W) {
    const B v = B::load_aligned(acc + x) * B(inv);
    v.store_unaligned(o + x);
    poison += v - v;
  }
  if (x < dv) {  // the partial vector, checked as stored: acc's padding is not output
    store_partial<Arch>(o + x, B::load_aligned(acc + x) * B(inv), static_cast<int>(dv - x));
    float tail = 0.0f;
    for (int64_t y = x; y < dv; ++y) tail += o[y] - o[y];
    poison += B(tail);
  }
  return poison;
}

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
    store_scaled_row<Arch>(acc, dv, inv, static_cast<float*>(out));
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

// Whether an item's rows are the common case: fp32 output with unit stride,
// no LSE and no sink to fold in (the sums divided and stored, nothing else).
inline bool plain_output_rows(const mha_work_item& item, float sink) {
  return item.out_dtype == MHA_DTYPE_F32 && item.out_strides[2] == 1 && item.lse == nullptr &&
         sink == -std::numeric_limits<float>::infinity();
}

// Rows row_i0 .. row_i0 + n of a prefill tile (accumulators dvp floats
// apart from acc) written as write_item_row would, one row after another;
// false when a value written is not finite (the caller then computes the
// tile again carefully and writes it again).  The common case -- fp32 output
// with unit stride, no LSE, no sink -- goes straight to its stores, without
// write_item_row's per-row work on the sink, the units and the output's
// dtype (a tile's epilogue was 5-9 % of S4 and S5), and checks the values as
// it stores them instead of reading the accumulators once more before (S4:
// 1.5 % of its time); the bits are the same.  A finite sum is at least the
// weight of the row's maximum, so a value is finite exactly when its
// accumulator is.
template <class Arch>
inline bool write_item_rows(const mha_work_item& item, int64_t row_h, int64_t row_i0, int64_t n,
                            const float* acc, int64_t dvp, int64_t dv, const float* row_max,
                            const float* row_sum, float sink, const ScoreUnits& units) {
  using B = xsimd::batch<float, Arch>;
  if (!plain_output_rows(item, sink)) {
    const bool finite = all_finite<Arch>(acc, n * dvp);
    for (int64_t r = 0; r < n; ++r) {
      write_item_row<Arch>(item, row_h, row_i0 + r, acc + r * dvp, dv, row_max[r], row_sum[r], sink,
                           units);
    }
    return finite;
  }
  auto* out = static_cast<float*>(item.out) + row_h * item.out_strides[0];
  B poison(0.0f);  // a - a: 0 for finite a, NaN otherwise
  for (int64_t r = 0; r < n; ++r) {
    // (No LSE: the row's maximum is not needed.)
    float* o = out + (row_i0 + r) * item.out_strides[1];
    const float* a = acc + r * dvp;
    if (row_sum[r] == 0.0f) {  // no key took part: zeros (write_row)
      write_row<Arch>(a, dv, 0.0f, 0.0f, 1.0f, o, MHA_DTYPE_F32, 1, nullptr);
      continue;
    }
    poison += store_scaled_row<Arch>(a, dv, 1.0f / row_sum[r], o);
  }
  return xsimd::all(poison == poison);
}

}  // namespace mha_simd
