// _mha.varlen_attention: one mha_attention_varlen call over the caller's
// arrays (a packed batch, FlashAttention-2's varlen layout), without the GIL.
// Arguments arrive checked for their Python types and with the outputs
// allocated (mha/_varlen.py); shapes, dtypes and the offsets' values are the
// library's to check, and its message names the argument.  The one check made
// here is FlashAttention-2's max_seqlen_q / max_seqlen_k: when given, no
// sequence may be longer.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "array_view.h"
#include "bindings.h"
#include "call_settings.h"

namespace nb = nanobind;

namespace mha_python {
namespace {

constexpr RankRule kPacked{3, 3, 3};     // [total, H, D]
constexpr RankRule kOffsets{1, 1, 1};    // [B + 1]
constexpr RankRule kLse{2, 2, 2};        // [H, total_q]
constexpr RankRule kRowScales{2, 2, 2};  // an int8 cache's [total_k, Hkv]
constexpr RankRule kSinks{1, 1, 1};      // [H]
constexpr RankRule kSlopes{1, 2, 1};     // [H] or [B, H]

// FlashAttention-2 sizes its work by max_seqlen_q and max_seqlen_k: a longer
// sequence would be cut short there.  Refuses a bound below the longest
// sequence of int32 offsets (offsets of another dtype or rank are left to the
// library, which refuses them by name).
void check_max_seqlen(const mha_tensor& cu, const char* offsets_name,
                      std::optional<int64_t> max_seqlen, const char* max_name, const char* tokens) {
  if (!max_seqlen || cu.dtype != MHA_DTYPE_I32 || cu.ndim != 1) return;
  const auto* offsets = static_cast<const int32_t*>(cu.data);
  for (int64_t b = 0; b + 1 < cu.shape[0]; ++b) {
    const int64_t length = static_cast<int64_t>(offsets[(b + 1) * cu.strides[0]]) -
                           static_cast<int64_t>(offsets[b * cu.strides[0]]);
    if (length <= *max_seqlen) continue;
    throw nb::value_error((std::string(max_name) + " = " + std::to_string(*max_seqlen) +
                           " but sequence " + std::to_string(b) + " of " + offsets_name + " has " +
                           std::to_string(length) + " " + tokens +
                           ": it must be at least the longest sequence's length (or None)")
                              .c_str());
  }
}

void varlen_attention(nb::handle q_object, nb::handle k_object, nb::handle v_object,
                      nb::handle out_object, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k,
                      std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
                      nb::handle lse, nb::handle k_scale, nb::handle v_scale,
                      std::optional<double> scale, int32_t causal, double dropout_p,
                      uint64_t dropout_seed, int64_t window_left, int64_t window_right,
                      nb::handle sinks, double softcap, nb::handle alibi_slopes,
                      std::optional<std::string> backend, std::optional<int32_t> threads) {
  const ArrayView q(q_object, "q", Access::read_only, kPacked);
  const ArrayView k(k_object, "k", Access::read_only, kPacked);
  const ArrayView v(v_object, "v", Access::read_only, kPacked);
  ArrayView o(out_object, "out", Access::writable, kPacked);
  const ArrayView cu_q(cu_seqlens_q, "cu_seqlens_q", Access::read_only, kOffsets);
  const ArrayView cu_k(cu_seqlens_k, "cu_seqlens_k", Access::read_only, kOffsets);
  check_max_seqlen(cu_q.tensor(), "cu_seqlens_q", max_seqlen_q, "max_seqlen_q", "queries");
  check_max_seqlen(cu_k.tensor(), "cu_seqlens_k", max_seqlen_k, "max_seqlen_k", "keys");
  std::optional<ArrayView> lse_view = optional_view(lse, "lse", Access::writable, kLse);
  const std::optional<ArrayView> k_scales =
      optional_view(k_scale, "k_scale", Access::read_only, kRowScales);
  const std::optional<ArrayView> v_scales =
      optional_view(v_scale, "v_scale", Access::read_only, kRowScales);
  const std::optional<ArrayView> sink_view =
      optional_view(sinks, "sinks", Access::read_only, kSinks);
  const std::optional<ArrayView> slope_view =
      optional_view(alibi_slopes, "alibi_slopes", Access::read_only, kSlopes);

  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = &cu_q.tensor();
  varlen.cu_seqlens_k = &cu_k.tensor();
  mha_attention_params params;
  mha_attention_params_init(&params);
  if (scale) {
    params.has_scale = 1;
    params.scale = static_cast<float>(*scale);
  }
  params.causal = causal;
  params.lse = lse_view ? &lse_view->tensor() : nullptr;
  params.k_scale = k_scales ? &k_scales->tensor() : nullptr;
  params.v_scale = v_scales ? &v_scales->tensor() : nullptr;
  params.dropout_p = static_cast<float>(dropout_p);
  params.dropout_seed = dropout_seed;
  params.window_left = window_left;
  params.window_right = window_right;
  params.sinks = sink_view ? &sink_view->tensor() : nullptr;
  params.softcap = static_cast<float>(softcap);
  params.alibi_slopes = slope_view ? &slope_view->tensor() : nullptr;

  const CallOverrides overrides{std::move(backend), threads};
  nb::gil_scoped_release without_gil;
  CallSettings::instance().run(overrides, [&] {
    return mha_attention_varlen(&q.tensor(), &k.tensor(), &v.tensor(), &o.tensor(), &varlen,
                                &params);
  });
}

}  // namespace

void register_varlen(nb::module_& module) {
  module.def("varlen_attention", &varlen_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"),
             nb::arg("out"), nb::arg("cu_seqlens_q"), nb::arg("cu_seqlens_k"),
             nb::arg("max_seqlen_q").none(), nb::arg("max_seqlen_k").none(), nb::arg("lse").none(),
             nb::arg("k_scale").none(), nb::arg("v_scale").none(), nb::arg("scale").none(),
             nb::arg("causal"), nb::arg("dropout_p"), nb::arg("dropout_seed"),
             nb::arg("window_left"), nb::arg("window_right"), nb::arg("sinks").none(),
             nb::arg("softcap"), nb::arg("alibi_slopes").none(), nb::arg("backend").none(),
             nb::arg("threads").none(),
             "Attention over each sequence of a packed batch (q [total_q, H, D], k and v "
             "[total_k, Hkv, D], offsets cu_seqlens_q and cu_seqlens_k), written into `out` (and "
             "the log-sum-exp [H, total_q] into `lse`).  Internal: use mha.varlen_attention.");
}

}  // namespace mha_python
