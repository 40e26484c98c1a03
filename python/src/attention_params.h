// What _mha.attention and _mha.varlen_attention take alike: the arguments
// that become mha_attention_params (the LSE output, an int8 cache's scales,
// the variants, scale, causal, dropout), viewed while the call runs.
#pragma once

#include <mha/mha.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>

#include "array_view.h"

namespace mha_python {

struct AttentionArguments {
  nanobind::handle lse, k_scale, v_scale, sinks, alibi_slopes;
  std::optional<double> scale;
  int32_t causal;
  double dropout_p;
  uint64_t dropout_seed;
  int64_t window_left, window_right;
  double softcap;
};

// The layouts of the optional arrays, which differ between a padded and a
// packed batch (sinks and ALiBi slopes do not).
struct AttentionArrayRules {
  RankRule lse;
  RankRule row_scales;
};

// Views the arrays in the order the messages are expected in (lse, k_scale,
// v_scale, sinks, alibi_slopes) and fills params; params points into this
// object, which must outlive the call.
class AttentionParamViews {
 public:
  AttentionParamViews(const AttentionArguments& args, const AttentionArrayRules& rules);
  const mha_attention_params& params() const { return params_; }
  mha_attention_params& params() { return params_; }

 private:
  std::optional<ArrayView> lse_, k_scale_, v_scale_, sinks_, alibi_slopes_;
  mha_attention_params params_{};
};

}  // namespace mha_python
