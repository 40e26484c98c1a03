// What _mha.attention, _mha.attention_backward, _mha.varlen_attention and
// _mha.attention_varlen_backward take alike: the arguments that become
// mha_attention_params (the LSE output, an int8 cache's scales, the variants,
// scale, causal, dropout), viewed while the call runs, the arrays' ranks in
// the padded and the packed layout, and PyTorch's rule on head counts.
#pragma once

#include <mha/mha.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>

#include "array_view.h"

namespace mha_python {

// The arrays of a padded batch as _mha.attention and _mha.attention_backward
// take them.
namespace padded_batch {
// Q, K, V, the output and their gradients are [B, H, L, D]; fewer dimensions
// are leading ones left out.
constexpr RankRule kHeads{2, 4, 4};
constexpr RankRule kLse{1, 3, 3};        // [B, H, Lq]
constexpr RankRule kMask{1, 4, 2};       // broadcast like NumPy against [B, H, Lq, Lk]
constexpr RankRule kValidLens{1, 2, 1};  // [B] or [B, Lq]
constexpr RankRule kRowScales{1, 3, 3};  // an int8 cache's [B, Hkv, Lk]
}  // namespace padded_batch

// The arrays of a packed batch (FlashAttention-2's varlen layout) as
// _mha.varlen_attention and _mha.attention_varlen_backward take them.
namespace packed_batch {
constexpr RankRule kPacked{3, 3, 3};     // [total, H, D]
constexpr RankRule kKeys{3, 4, 3};       // [total_k, Hkv, D] or [num_blocks, block_size, Hkv, D]
constexpr RankRule kOffsets{1, 1, 1};    // [B + 1]
constexpr RankRule kLengths{1, 1, 1};    // [B]
constexpr RankRule kTable{2, 2, 2};      // [B, max_blocks]
constexpr RankRule kLse{2, 2, 2};        // [H, total_q]
constexpr RankRule kRowScales{2, 3, 2};  // an int8 cache's [total_k, Hkv] or [.., block_size, Hkv]
}  // namespace packed_batch

// The per-head arrays, alike in both layouts.
constexpr RankRule kSinks{1, 1, 1};   // [H]
constexpr RankRule kSlopes{1, 2, 1};  // [H] or [B, H]

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

// PyTorch's rule: query heads may differ from key/value heads only with
// enable_gqa, or where key/value has one head, which broadcasts (shapes as the
// library sees them, [B, H, L, D]).  Throws ValueError naming `name` (key or
// value).
void check_heads(const mha_tensor& q, const mha_tensor& kv, const char* name, bool enable_gqa);

}  // namespace mha_python
