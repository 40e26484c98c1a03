// The online softmax of one row, in plain C++: the scalar backend folds each
// key tile into its rows with it, and the module's attention-weights path
// folds a whole row at once.  (The SIMD kernels have their vector forms in
// backends/simd/softmax.hpp; the tests' references their own.)
#pragma once

#include <cstdint>
#include <limits>

namespace mha_softmax {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// NaN-propagating maximum: a NaN logit must poison its row, as in the
// references.
inline float max_propagating_nan(float a, float b) {
  return (b > a || b != b) ? b : a;
}

// A row's running maximum and sum of weights.
struct Row {
  float max = kNegInf;
  float sum = 0.0f;
};

// What folding a tile did to its row.
struct Fold {
  bool any;     // false: no key of the tile takes part; nothing changed
  float alpha;  // what the row accumulated before must be multiplied by this
};

// Folds logits s[0, n) (a key that takes no part is -inf) into the row:
// each other logit becomes its weight weight_of(s - max) -- weight_of(d) is
// e^d in the logits' units --, -inf ones stay -inf (so a caller can skip their
// values: 0·V would pass on a NaN or infinity of a removed key's row), and
// the tile's weights, summed apart from the row, join its sum.  Summing in
// two levels keeps rounding growing with the tile width plus the number of
// tiles, not with the number of keys.
template <class WeightOf>
inline Fold fold_tile(float* s, int64_t n, Row& row, WeightOf&& weight_of) {
  float tile_max = kNegInf;
  for (int64_t j = 0; j < n; ++j) tile_max = max_propagating_nan(tile_max, s[j]);
  if (tile_max == kNegInf) return {false, 1.0f};
  const float new_max = max_propagating_nan(row.max, tile_max);
  float alpha = 1.0f;
  if (new_max > row.max) {
    alpha = weight_of(row.max - new_max);  // 0 on the row's first keys
    row.sum *= alpha;
    row.max = new_max;
  } else if (new_max != new_max) {
    row.max = new_max;
  }
  float tile_sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    if (s[j] == kNegInf) continue;
    s[j] = weight_of(s[j] - row.max);
    tile_sum += s[j];
  }
  row.sum += tile_sum;
  return {true, alpha};
}

// Folds an attention sink -- a logit without a value row, in the row's
// units; -inf: none -- into a finished row.  Returns what the row's
// accumulated values must be multiplied by (besides the division by the new
// sum).  A row without keys gets sum 1 (the sink's weight) and factor 0.
template <class WeightOf>
inline float fold_sink(Row& row, float sink, WeightOf&& weight_of) {
  if (sink == kNegInf) return 1.0f;
  const float new_max = max_propagating_nan(row.max, sink);
  const float alpha = row.sum == 0.0f ? 0.0f : weight_of(row.max - new_max);
  row.sum = row.sum * alpha + weight_of(sink - new_max);
  row.max = new_max;
  return alpha;
}

}  // namespace mha_softmax
