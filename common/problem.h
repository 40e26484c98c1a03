// Reading a validated call (mha_kernel_problem) the way every kernel must:
// which keys a query sees, where a row of Q, K or V lives, where a mask row
// starts.  Plain C++ with no ISA code, so every plugin can include it.
#pragma once

#include <mha/plugin_abi.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/dropout.h"
#include "common/dtype.h"
#include "common/visibility.h"

namespace mha_kernel {

// The last key query i of batch b sees under the causal rule and the valid
// lengths (-1: none).  The explicit mask may remove more.
inline int64_t last_visible_key(const mha_kernel_problem& p, int64_t b, int64_t i) {
  const int64_t valid_length =
      p.valid_lens == nullptr
          ? p.lk
          : mha_rules::valid_length_at(p.valid_lens, p.valid_lens_is_i64 != 0,
                                       b * p.valid_lens_strides[0] + i * p.valid_lens_strides[1]);
  return mha_rules::visible_keys(i, p.lk, p.causal_diag, valid_length) - 1;
}

// The first key query i sees under the sliding window (0 without one).
inline int64_t first_visible_key(const mha_kernel_problem& p, int64_t i) {
  return mha_rules::first_visible_key(i, p.lower_diag);
}

inline int64_t kv_head_of(const mha_kernel_problem& p, int64_t h) {
  return h / (p.heads / p.kv_heads);
}

// The decode layout's query heads per work item (the runtime plans by it,
// the kernels size their scratch by it): those of one KV head -- or of every
// KV head when K and V are token-major (a token's KV heads closer together
// than its neighbours: [.., L, Hkv, D], a paged cache), so that an item
// reads each token's row whole instead of one KV head's slice of it, which
// memory serves at about half the speed (docs/kernel-design.md).  At most
// kMaxDecodeRows rows (heads x queries).
constexpr int64_t kMaxDecodeRows = 1024;
inline int64_t decode_heads_per_item(const mha_kernel_problem& p) {
  const bool token_major =
      p.kv_heads > 1 && p.k_strides[1] < p.k_strides[2] && p.v_strides[1] < p.v_strides[2];
  if (token_major && p.heads * p.lq <= kMaxDecodeRows) return p.heads;
  return p.heads / p.kv_heads;
}

// The rows layout (MHA_LAYOUT_ROWS) serves problems of at most this many
// keys and queries: all keys fit one tile of lanes, and the call's cost is
// its fixed per-row and per-tile state, which that layout keeps low.  With
// more queries the query-lane layout fills its vectors and wins (16 queries
// over 16 keys: 20-30 % faster there on AVX-512; docs/kernel-design.md).  An item
// holds up to kRowsPerItem rows (heads x queries).
constexpr int64_t kRowsMaxKeys = 16;
constexpr int64_t kRowsMaxQueries = 8;
constexpr int64_t kRowsPerItem = 64;

// Whether a prefill kernel reads K and V through an item-wide copy rather
// than in place: half precision and int8 are widened to fp32, and fp32 rows
// that do not lie back to back (a [B, L, H, D] view, the module's
// [B, L, 3E] projections, a paged cache) are copied -- their strides are
// usually multiples of 1 KiB, which crowd a key tile's rows into a quarter of
// the L1's sets (an AVX-512 kernel, which reads each K row once per query
// tile, still reads fp32 K in place and copies V).  The runtime gives such
// items several query tiles, so that one copy serves them all
// (docs/kernel-design.md).
inline bool kv_copied_per_item(const mha_kernel_problem& p) {
  return p.kv_dtype != MHA_DTYPE_F32 || p.block_table != nullptr || p.k_strides[3] != 1 ||
         p.k_strides[2] != p.d || p.v_strides[3] != 1 || p.v_strides[2] != p.dv;
}

// The first element of a row of Q, K or V, as the element type T of its dtype
// (float for F32, uint16_t for BF16 and F16, int8_t for I8).
template <class T = float>
inline const T* q_row(const mha_kernel_problem& p, int64_t b, int64_t h, int64_t i) {
  return static_cast<const T*>(p.q) + b * p.q_strides[0] + h * p.q_strides[1] + i * p.q_strides[2];
}
// The bytes one key takes in K and V of one KV head: its two rows, and for
// an int8 cache their two scales.
inline int64_t kv_bytes_per_key(const mha_kernel_problem& p) {
  const int64_t element = p.kv_dtype == MHA_DTYPE_I8 ? 1 : mha_types::float_bytes(p.kv_dtype);
  const int64_t scales = p.kv_dtype == MHA_DTYPE_I8 ? 8 : 0;
  return (p.d + p.dv) * element + scales;
}

// Where key j of (b, kvh) starts in a tensor with these strides (K, V, or
// an int8 cache's scales): its batch's rows, or, in a paged cache, row
// j % block_size of the block the table names (plugin_abi.h).
inline int64_t kv_offset(const mha_kernel_problem& p, const int64_t* strides, int64_t b,
                         int64_t kvh, int64_t j) {
  if (p.block_table == nullptr) return b * strides[0] + kvh * strides[1] + j * strides[2];
  const int64_t block = p.block_table[b * p.block_table_stride + j / p.block_size];
  return block * strides[0] + kvh * strides[1] + (j % p.block_size) * strides[2];
}

template <class T = float>
inline const T* k_row(const mha_kernel_problem& p, int64_t b, int64_t kvh, int64_t j) {
  return static_cast<const T*>(p.k) + kv_offset(p, p.k_strides, b, kvh, j);
}
template <class T = float>
inline const T* v_row(const mha_kernel_problem& p, int64_t b, int64_t kvh, int64_t j) {
  return static_cast<const T*>(p.v) + kv_offset(p, p.v_strides, b, kvh, j);
}

// The int8 row scales of keys j0 .. of (b, kvh): scales[j · stride] (in a
// paged cache only up to the end of key j0's block: see for_each_kv_run).
inline const float* k_scales(const mha_kernel_problem& p, int64_t b, int64_t kvh, int64_t j0) {
  return p.k_scale + kv_offset(p, p.k_scale_strides, b, kvh, j0);
}
inline const float* v_scales(const mha_kernel_problem& p, int64_t b, int64_t kvh, int64_t j0) {
  return p.v_scale + kv_offset(p, p.v_scale_strides, b, kvh, j0);
}

// Calls f(t, n) for the runs of keys j0 + t .. j0 + t + n - 1 (covering
// j0 .. j0 + keys - 1) whose rows are evenly spaced: one run, or in a paged
// cache the pieces of the blocks.
template <class F>
inline void for_each_kv_run(const mha_kernel_problem& p, int64_t j0, int64_t keys, F&& f) {
  if (p.block_table == nullptr) {
    if (keys > 0) f(int64_t{0}, keys);
    return;
  }
  for (int64_t t = 0; t < keys;) {
    const int64_t n = std::min(keys - t, p.block_size - (j0 + t) % p.block_size);
    f(t, n);
    t += n;
  }
}

// The additive mask's value at element `at`, as fp32 (F32, BF16 or F16).
inline float mask_value(const mha_kernel_problem& p, int64_t at) {
  return mha_types::load_float(p.mask, p.mask_dtype, at);
}

// Row of a dtype's elements at `row` (element index), widened to fp32: n
// elements `stride` apart, times `scale` (the int8 row scale; 1 otherwise).
inline void widen_row(const void* data, int32_t dtype, int64_t row, int64_t stride, int64_t n,
                      float scale, float* dst) {
  switch (dtype) {
    case MHA_DTYPE_I8: {
      const int8_t* src = static_cast<const int8_t*>(data) + row;
      for (int64_t x = 0; x < n; ++x) dst[x] = scale * static_cast<float>(src[x * stride]);
      break;
    }
    default:  // F32, BF16, F16
      mha_types::widen_row(data, dtype, row, stride, n, dst);
  }
}

// Offset of mask element [b, h, i, 0]; keys step by mask_strides[3].
inline int64_t mask_row_offset(const mha_kernel_problem& p, int64_t b, int64_t h, int64_t i) {
  return b * p.mask_strides[0] + h * p.mask_strides[1] + i * p.mask_strides[2];
}

// The score variants (ABI 6).  Whether the scores change before the mask:
// a softcap or ALiBi.  (A call without them runs the unchanged fused path.)
inline bool has_score_variants(const mha_kernel_problem& p) {
  return p.softcap > 0.0f || p.alibi_slopes != nullptr;
}

// ALiBi's slope for batch b, head h (0 without ALiBi).
inline float alibi_slope(const mha_kernel_problem& p, int64_t b, int64_t h) {
  return p.alibi_slopes == nullptr
             ? 0.0f
             : p.alibi_slopes[b * p.alibi_strides[0] + h * p.alibi_strides[1]];
}

// ALiBi's distance of query i to key j: |i + Lk - Lq - j| on the full
// problem's positions, i.e. |i - j + alibi_diag| in this call's.
inline int64_t alibi_distance(const mha_kernel_problem& p, int64_t i, int64_t j) {
  const int64_t d = i - j + p.alibi_diag;
  return d < 0 ? -d : d;
}

// The dropout hash of row (b, h, i), in the form mha_dropout::keep takes
// with this call's key index j: the row of the full problem (query_offset +
// i of full_lq), its key offset folded in (keep adds j · kKeyStep, and
// (key_offset + j) · kKeyStep = key_offset · kKeyStep + j · kKeyStep mod 2^32).
inline uint32_t dropout_row_key(const mha_kernel_problem& p, int64_t b, int64_t h, int64_t i) {
  return mha_dropout::row_key(p.dropout_seed, b, h, p.query_offset + i, p.heads, p.full_lq) +
         static_cast<uint32_t>(p.key_offset) * mha_dropout::kKeyStep;
}

// Head h's sink logit (-inf: none).
inline float sink_logit(const mha_kernel_problem& p, int64_t h) {
  return p.sinks == nullptr ? -std::numeric_limits<float>::infinity() : p.sinks[h * p.sinks_stride];
}

}  // namespace mha_kernel
