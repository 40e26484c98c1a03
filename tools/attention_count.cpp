// The (query, key) pairs an attention call computes, for the FLOPs that
// `mha-run --repeat` reports: useful work only, by the library's own
// visibility rule.
#include <algorithm>
#include <cmath>

#include "attention_run.h"
#include "common/dtype.h"
#include "common/visibility.h"

namespace mha_tools {
namespace {

// Elements of an int32 / int64 descriptor, or of a bool / float32 one.
int64_t integer_at(const mha_tensor& t, int64_t offset) {
  if (t.dtype == MHA_DTYPE_I64) return static_cast<const int64_t*>(t.data)[offset];
  return static_cast<const int32_t*>(t.data)[offset];
}

bool mask_allows(const mha_tensor& mask, int64_t offset) {
  if (mask.dtype == MHA_DTYPE_BOOL) return static_cast<const uint8_t*>(mask.data)[offset] != 0;
  return mha_types::load_float(mask.data, mask.dtype, offset) != -INFINITY;
}

// Keys first_key .. key_limit-1 of (batch b, query i) survive the window,
// the causal mode and valid lengths: the library's own visibility rule
// (common/visibility.h).
int64_t first_key(const AttentionCall& call, int64_t i) {
  const int64_t lq = call.q.shape[2], lk = call.k.shape[2];
  return mha_rules::first_visible_key(i,
                                      mha_rules::window_lower_diagonal(call.window_left, lq, lk));
}

int64_t key_limit(const AttentionCall& call, int64_t b, int64_t i) {
  const int64_t lq = call.q.shape[2], lk = call.k.shape[2];
  int64_t valid_length = lk;
  if (call.valid_lens) {
    const mha_tensor& vl = *call.valid_lens;
    valid_length = integer_at(vl, b * vl.strides[0] + (vl.ndim == 2 ? i * vl.strides[1] : 0));
  }
  return mha_rules::visible_keys(
      i, lk, mha_rules::upper_diagonal(call.causal, call.window_right, lq, lk), valid_length);
}

// Element offset in a mask broadcast (NumPy style, aligned right) to [B,H,Lq,Lk].
int64_t mask_offset(const mha_tensor& mask, const int64_t (&index)[4]) {
  int64_t offset = 0;
  for (int32_t d = 0; d < mask.ndim; ++d) {
    const int64_t full = index[4 - mask.ndim + d];
    if (mask.shape[d] != 1) offset += full * mask.strides[d];
  }
  return offset;
}

// Element b of an I32 [B + 1] offsets tensor.
int64_t offset_at(const mha_tensor& cu, int64_t b) {
  return static_cast<const int32_t*>(cu.data)[b * cu.strides[0]];
}

// The pairs of one head of a packed batch: each sequence with its own lengths.
int64_t count_packed_pairs_of_head(const AttentionCall& call) {
  const mha_tensor& cu_q = *call.cu_seqlens_q;
  int64_t pairs = 0;
  for (int64_t b = 0; b + 1 < cu_q.shape[0]; ++b) {
    const int64_t lq = offset_at(cu_q, b + 1) - offset_at(cu_q, b);
    const int64_t lk =
        call.seqused_k ? offset_at(*call.seqused_k, b)
                       : offset_at(*call.cu_seqlens_k, b + 1) - offset_at(*call.cu_seqlens_k, b);
    const int64_t lower = mha_rules::window_lower_diagonal(call.window_left, lq, lk);
    const int64_t upper = mha_rules::upper_diagonal(call.causal, call.window_right, lq, lk);
    for (int64_t i = 0; i < lq; ++i) {
      pairs += std::max<int64_t>(
          0, mha_rules::visible_keys(i, lk, upper, lk) - mha_rules::first_visible_key(i, lower));
    }
  }
  return pairs;
}

int64_t count_pairs_of_head(const AttentionCall& call, int64_t b, int64_t h) {
  int64_t pairs = 0;
  for (int64_t i = 0; i < call.q.shape[2]; ++i) {
    const int64_t first = first_key(call, i), limit = key_limit(call, b, i);
    if (!call.mask) {
      pairs += std::max<int64_t>(0, limit - first);
      continue;
    }
    for (int64_t j = first; j < limit; ++j) {
      const int64_t index[4] = {b, h, i, j};
      if (mask_allows(*call.mask, mask_offset(*call.mask, index))) ++pairs;
    }
  }
  return pairs;
}

}  // namespace

int64_t count_attention_pairs(const AttentionCall& call) {
  const int64_t batch = call.q.shape[0], heads = call.q.shape[1];
  if (call.cu_seqlens_q) return heads * count_packed_pairs_of_head(call);
  // Causal mode and valid lengths are the same for every head; so is a mask
  // without a head dimension.
  const bool per_head =
      call.mask && call.mask->ndim >= 3 && call.mask->shape[call.mask->ndim - 3] != 1;
  int64_t pairs = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (per_head) {
      for (int64_t h = 0; h < heads; ++h) pairs += count_pairs_of_head(call, b, h);
    } else {
      pairs += heads * count_pairs_of_head(call, b, 0);
    }
  }
  return pairs;
}

double attention_flops(const AttentionCall& call) {
  const double d = static_cast<double>(call.q.shape[call.q.ndim - 1]);
  const double dv = static_cast<double>(call.v.shape[call.v.ndim - 1]);
  return 2.0 * (d + dv) * static_cast<double>(count_attention_pairs(call));
}

}  // namespace mha_tools
