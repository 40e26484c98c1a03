// Which keys a query sees: the one home of the visibility rule, included by
// the runtime (validation, the module), the kernels, the tools and the
// benchmarks.  The tests' float64 references keep their own, independent
// copy on purpose.
//
// Query i (of Lq) sees keys first_visible_key(...) <= j < visible_keys(...):
// the causal rule and the right edge of a sliding window (a key at most
// `diagonal` positions after the query, relative to the top-left corner) and
// the valid length cut the row at its end, the window's left edge (a key at
// least `lower` positions after the query -- a negative number) at its
// start; an explicit mask may remove more.
#pragma once

#include <mha/mha.h>

#include <algorithm>
#include <cstdint>

namespace mha_rules {

// The diagonal when no causal rule applies: far enough that i + diagonal never
// limits a row, near enough that i + diagonal + 1 cannot overflow.
constexpr int64_t kNoCausalLimit = INT64_MAX / 4;

// Key j is visible to query i iff j <= i + causal_diagonal(...):
//   MHA_CAUSAL_TOP_LEFT      j <= i            (PyTorch's is_causal)
//   MHA_CAUSAL_BOTTOM_RIGHT  j <= i + Lk - Lq  (the queries end a KV cache)
// Any other value means no causal rule (validation refuses unknown modes).
inline int64_t causal_diagonal(int32_t causal, int64_t lq, int64_t lk) {
  switch (causal) {
    case MHA_CAUSAL_TOP_LEFT:
      return 0;
    case MHA_CAUSAL_BOTTOM_RIGHT:
      return lk - lq;
    default:
      return kNoCausalLimit;
  }
}

// The sliding window, FlashAttention-2's semantics aligned to the bottom-right
// corner: key j takes part for query i iff
//   i + lk - lq - left <= j <= i + lk - lq + right,
// a negative edge meaning unbounded on that side.  Its left edge as the lower
// diagonal (j >= i + lower; -kNoCausalLimit when unbounded):
inline int64_t window_lower_diagonal(int64_t left, int64_t lq, int64_t lk) {
  if (left < 0) return -kNoCausalLimit;
  return std::max(-kNoCausalLimit, lk - lq - std::min(left, kNoCausalLimit));
}

// The upper diagonal of the causal rule and the window's right edge together.
inline int64_t upper_diagonal(int32_t causal, int64_t right, int64_t lq, int64_t lk) {
  const int64_t causal_limit = causal_diagonal(causal, lq, lk);
  if (right < 0) return causal_limit;
  return std::min(causal_limit, lk - lq + std::min(right, kNoCausalLimit));
}

// The first key query i sees (it sees none when this is not below
// visible_keys(...)).
inline int64_t first_visible_key(int64_t i, int64_t lower) {
  return std::max<int64_t>(0, i + lower);
}

// How many keys, from the first, query i sees: keys [0, result) take part
// unless a mask removes them.  valid_length: the row's valid length, or lk
// when there is none.
inline int64_t visible_keys(int64_t i, int64_t lk, int64_t diagonal, int64_t valid_length) {
  return std::max<int64_t>(0, std::min({lk, i + diagonal + 1, valid_length}));
}

// A valid length stored as i32 or i64 at element `offset`.
inline int64_t valid_length_at(const void* data, bool is_i64, int64_t offset) {
  return is_i64 ? static_cast<const int64_t*>(data)[offset]
                : static_cast<const int32_t*>(data)[offset];
}

}  // namespace mha_rules
