// Reading a validated call (mha_kernel_problem) the way every kernel must:
// which keys a query sees, where a row of Q, K or V lives, where a mask row
// starts.  Plain C++ with no ISA code, so every plugin can include it.
#pragma once

#include <mha/plugin_abi.h>

#include <cstdint>

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
