// One row quantised to int8 with its scale, as mha_quantize_kv and
// mha_kv_cache_write store an int8 KV cache.
#pragma once

#include <cstdint>

namespace mha::rt {

// Row src[at + x · stride], x < d, of dtype F32, BF16 or F16 (finite values)
// into dst[dst_at + x · dst_stride]: symmetric, scale = max|row| / 127, each
// value rounded to nearest even of value / scale (a row of zeros: scale 0,
// zeros).  Returns the scale.
float quantize_row(const void* src, int32_t dtype, int64_t at, int64_t stride, int64_t d,
                   int8_t* dst, int64_t dst_at, int64_t dst_stride);

}  // namespace mha::rt
