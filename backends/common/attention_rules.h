// What every kernel must agree on: which keys a query sees, where an element
// lives, how the mask reads.  Plain C++ with no ISA code, so each plugin can
// include it.
#pragma once

#include <mha/plugin_abi.h>

#include <algorithm>
#include <cstdint>

namespace mha_kernel {

// The last key query i of batch b may see under the causal rule and the valid
// lengths (-1: none).  The explicit mask may remove more.
inline int64_t last_visible_key(const mha_kernel_problem& p, int64_t b, int64_t i) {
  int64_t last = std::min(p.lk - 1, i + p.causal_diag);
  if (p.valid_lens != nullptr) {
    const int64_t at = b * p.valid_lens_strides[0] + i * p.valid_lens_strides[1];
    const int64_t len = p.valid_lens_is_i64 ? static_cast<const int64_t*>(p.valid_lens)[at]
                                            : static_cast<const int32_t*>(p.valid_lens)[at];
    last = std::min(last, len - 1);
  }
  return last;
}

inline int64_t kv_head_of(const mha_kernel_problem& p, int64_t h) {
  return h / (p.heads / p.kv_heads);
}

inline const float* q_row(const mha_kernel_problem& p, int64_t b, int64_t h, int64_t i) {
  return p.q + b * p.q_strides[0] + h * p.q_strides[1] + i * p.q_strides[2];
}
inline const float* k_row(const mha_kernel_problem& p, int64_t b, int64_t kvh, int64_t j) {
  return p.k + b * p.k_strides[0] + kvh * p.k_strides[1] + j * p.k_strides[2];
}
inline const float* v_row(const mha_kernel_problem& p, int64_t b, int64_t kvh, int64_t j) {
  return p.v + b * p.v_strides[0] + kvh * p.v_strides[1] + j * p.v_strides[2];
}

// Offset of mask element [b, h, i, 0]; keys step by mask_strides[3].
inline int64_t mask_row_offset(const mha_kernel_problem& p, int64_t b, int64_t h, int64_t i) {
  return b * p.mask_strides[0] + h * p.mask_strides[1] + i * p.mask_strides[2];
}

}  // namespace mha_kernel
