#include "attention_params.h"

#include <string>

namespace mha_python {
namespace {

const mha_tensor* tensor_of(const std::optional<ArrayView>& view) {
  return view ? &view->tensor() : nullptr;
}

}  // namespace

void check_heads(const mha_tensor& q, const mha_tensor& kv, const char* name, bool enable_gqa) {
  // One key/value head is PyTorch's broadcast of that head over the query heads: the
  // library's multi-query attention, the same values.
  if (enable_gqa || q.shape[1] == kv.shape[1] || kv.shape[1] == 1) return;
  throw nanobind::value_error(("query has " + std::to_string(q.shape[1]) + " heads but " + name +
                               " has " + std::to_string(kv.shape[1]) +
                               ": pass enable_gqa=True for grouped-query attention (PyTorch "
                               "broadcasts a single head only)")
                                  .c_str());
}

AttentionParamViews::AttentionParamViews(const AttentionArguments& args,
                                         const AttentionArrayRules& rules)
    : lse_(optional_view(args.lse, "lse", Access::writable, rules.lse)),
      k_scale_(optional_view(args.k_scale, "k_scale", Access::read_only, rules.row_scales)),
      v_scale_(optional_view(args.v_scale, "v_scale", Access::read_only, rules.row_scales)),
      sinks_(optional_view(args.sinks, "sinks", Access::read_only, kSinks)),
      alibi_slopes_(optional_view(args.alibi_slopes, "alibi_slopes", Access::read_only, kSlopes)) {
  mha_attention_params_init(&params_);
  if (args.scale) {
    params_.has_scale = 1;
    params_.scale = static_cast<float>(*args.scale);
  }
  params_.causal = args.causal;
  params_.lse = lse_ ? &lse_->tensor() : nullptr;  // written: not const
  params_.k_scale = tensor_of(k_scale_);
  params_.v_scale = tensor_of(v_scale_);
  params_.dropout_p = static_cast<float>(args.dropout_p);
  params_.dropout_seed = args.dropout_seed;
  params_.window_left = args.window_left;
  params_.window_right = args.window_right;
  params_.sinks = tensor_of(sinks_);
  params_.softcap = static_cast<float>(args.softcap);
  params_.alibi_slopes = tensor_of(alibi_slopes_);
}

}  // namespace mha_python
