// The per-row and per-pair rules every backward kernel applies (plain C++,
// no ISA code): which keys of a block a query row sees, and the logit of a
// pair with its derivative factor.  The forward's rules (common/problem.h)
// decide; this only phrases them for the backward's loops.
#pragma once

#include <mha/plugin_abi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/problem.h"

namespace mha_backward {

// The keys [lo, hi] of the block [j0, j1) that query i of batch b may see
// under the causal rule, the window and the valid lengths (lo > hi: none).
// The explicit mask may remove more.
struct KeyRange {
  int64_t lo, hi;
  bool empty() const { return lo > hi; }
};
inline KeyRange visible_in_block(const mha_kernel_problem& p, int64_t b, int64_t i, int64_t j0,
                                 int64_t j1) {
  return KeyRange{std::max(j0, mha_kernel::first_visible_key(p, i)),
                  std::min(j1 - 1, mha_kernel::last_visible_key(p, b, i))};
}

// The queries [first, last] that can see some key of [j0, j1) by the causal
// rule and the window alone (valid lengths and masks are per row).
struct QueryRange {
  int64_t first, last;
};
inline QueryRange queries_seeing(const mha_kernel_problem& p, int64_t j0, int64_t j1) {
  // Key j is seen by query i iff i + lower_diag <= j <= i + causal_diag.
  const int64_t limit = mha_rules::kNoCausalLimit;
  const int64_t first = p.causal_diag >= limit ? 0 : std::max<int64_t>(0, j0 - p.causal_diag);
  const int64_t last =
      p.lower_diag <= -limit ? p.lq - 1 : std::min<int64_t>(p.lq - 1, j1 - 1 - p.lower_diag);
  return QueryRange{first, last};
}

// The logit of a pair from its raw dot product q·k, with d(logit)/d(q·k):
// scale, then softcap (tanh's derivative), then ALiBi and the additive mask
// (constants: no factor).
struct Logit {
  float value;
  float slope;  // d value / d(q·k)
};
inline Logit logit_of(float dot, float scale, float softcap, float alibi_bias, float mask_add) {
  float x = dot * scale;
  float slope = scale;
  if (softcap > 0.0f) {
    const float y = x / softcap;
    const float t = std::tanh(y);
    x = softcap * t;
    // 1 - tanh², as 4e / (1 + e)² with e = e^(-2|y|) where 1 - t² would
    // cancel (t near ±1): a saturated cap's gradient stays accurate.
    const float e = std::exp(-2.0f * std::fabs(y));
    slope *= std::fabs(y) < 0.625f ? 1.0f - t * t : 4.0f * e / ((1.0f + e) * (1.0f + e));
  }
  return Logit{x + alibi_bias + mask_add, slope};
}

}  // namespace mha_backward
