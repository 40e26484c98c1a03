// mha_quantize_kv: rows to int8 with one fp32 scale per row, the layout of
// mha_attention's int8 KV cache.
#include <mha/mha.h>

#include <cmath>
#include <cstdint>

#include "common/dtype.h"
#include "error.h"
#include "quantize.h"
#include "validate.h"

using namespace mha::rt;

namespace {

// The offset of element [b, h, l, 0] of a 4-D descriptor.
int64_t row_offset(const mha_tensor& t, int64_t b, int64_t h, int64_t l) {
  return b * t.strides[0] + h * t.strides[1] + l * t.strides[2];
}

mha_status check_quantize(const mha_tensor* src, const mha_tensor* dst, const mha_tensor* scale) {
  if (mha_status s = check_tensor(src, "src", 4, 4); s != MHA_OK) return s;
  if (mha_status s = check_tensor(dst, "dst", 4, 4); s != MHA_OK) return s;
  if (mha_status s = check_tensor(scale, "scale", 3, 3); s != MHA_OK) return s;
  if (mha_types::float_bytes(src->dtype) == 0) {
    return fail(MHA_ERR_INVALID_DTYPE, "src has dtype %s; it must be f32, bf16 or f16",
                dtype_name(src->dtype));
  }
  if (dst->dtype != MHA_DTYPE_I8) {
    return fail(MHA_ERR_INVALID_DTYPE, "dst has dtype %s; it must be i8", dtype_name(dst->dtype));
  }
  if (mha_status s = check_f32(scale, "scale"); s != MHA_OK) return s;
  for (int d = 0; d < 4; ++d) {
    if (dst->shape[d] != src->shape[d]) {
      return fail(MHA_ERR_SHAPE_MISMATCH, "dst has shape %s; it must be src's, %s",
                  shape_text(*dst).c_str(), shape_text(*src).c_str());
    }
  }
  for (int d = 0; d < 3; ++d) {
    if (scale->shape[d] != src->shape[d]) {
      return fail(MHA_ERR_SHAPE_MISMATCH,
                  "scale has shape %s; it must be [B, Hkv, L] = [%lld, %lld, %lld]",
                  shape_text(*scale).c_str(), static_cast<long long>(src->shape[0]),
                  static_cast<long long>(src->shape[1]), static_cast<long long>(src->shape[2]));
    }
  }
  const mha_tensor* inputs[] = {src, scale};
  const char* names[] = {"src", "scale"};
  if (mha_status s = check_no_overlap(*dst, "dst", inputs, names, 2); s != MHA_OK) return s;
  if (mha_status s = check_no_overlap(*scale, "scale", inputs, names, 1); s != MHA_OK) return s;
  // Every value must be finite: checked before anything is written.
  for (int64_t b = 0; b < src->shape[0]; ++b) {
    for (int64_t h = 0; h < src->shape[1]; ++h) {
      for (int64_t l = 0; l < src->shape[2]; ++l) {
        const int64_t row = row_offset(*src, b, h, l);
        for (int64_t x = 0; x < src->shape[3]; ++x) {
          const float value =
              mha_types::load_float(src->data, src->dtype, row + x * src->strides[3]);
          if (!std::isfinite(value)) {
            return fail(MHA_ERR_INVALID_VALUE,
                        "src[%lld][%lld][%lld][%lld] = %g; int8 rows need finite values",
                        static_cast<long long>(b), static_cast<long long>(h),
                        static_cast<long long>(l), static_cast<long long>(x),
                        static_cast<double>(value));
          }
        }
      }
    }
  }
  return MHA_OK;
}

}  // namespace

extern "C" mha_status mha_quantize_kv(const mha_tensor* src, mha_tensor* dst, mha_tensor* scale) {
  clear_error();
  return guarded([&] {
    if (mha_status s = check_quantize(src, dst, scale); s != MHA_OK) return s;
    const int64_t d = src->shape[3];
    auto* out = static_cast<int8_t*>(dst->data);
    auto* scales = static_cast<float*>(scale->data);
    for (int64_t b = 0; b < src->shape[0]; ++b) {
      for (int64_t h = 0; h < src->shape[1]; ++h) {
        for (int64_t l = 0; l < src->shape[2]; ++l) {
          const int64_t row = row_offset(*src, b, h, l);
          scales[b * scale->strides[0] + h * scale->strides[1] + l * scale->strides[2]] =
              mha::rt::quantize_row(src->data, src->dtype, row, src->strides[3], d, out,
                                    row_offset(*dst, b, h, l), dst->strides[3]);
        }
      }
    }
    return MHA_OK;
  });
}

namespace mha::rt {

float quantize_row(const void* src, int32_t dtype, int64_t at, int64_t stride, int64_t d,
                   int8_t* dst, int64_t dst_at, int64_t dst_stride) {
  float largest = 0.0f;
  for (int64_t x = 0; x < d; ++x) {
    largest = std::fmax(largest, std::fabs(mha_types::load_float(src, dtype, at + x * stride)));
  }
  const float row_scale = largest / 127.0f;
  for (int64_t x = 0; x < d; ++x) {
    const float value = mha_types::load_float(src, dtype, at + x * stride);
    // Round to nearest even; |value| <= largest keeps it within +-127 (the
    // division can round 127.0 up by an ulp, never to 128).
    const float q = row_scale == 0.0f ? 0.0f : std::nearbyint(value / row_scale);
    dst[dst_at + x * dst_stride] = static_cast<int8_t>(std::fmax(-127.0f, std::fmin(127.0f, q)));
  }
  return row_scale;
}

}  // namespace mha::rt
