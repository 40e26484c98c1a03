// _mha.attention: one mha_attention call over the caller's arrays, without
// the GIL.  Arguments arrive checked for their Python types and with the
// outputs allocated (mha/_attention.py); shapes, dtypes and values are the
// library's to check, and its message names the argument.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>

#include "array_view.h"
#include "attention_params.h"
#include "bindings.h"
#include "call_settings.h"
#include "torch_array.h"

namespace nb = nanobind;

namespace mha_python {
namespace {

using namespace padded_batch;

void attention(nb::handle query, nb::handle key, nb::handle value, nb::handle out,
               nb::handle attn_mask, nb::handle valid_lens, nb::handle lse, nb::handle k_scale,
               nb::handle v_scale, std::optional<double> scale, int32_t causal, bool enable_gqa,
               double dropout_p, uint64_t dropout_seed, int64_t window_left, int64_t window_right,
               nb::handle sinks, double softcap, nb::handle alibi_slopes,
               std::optional<std::string> backend, std::optional<int32_t> threads) {
  const ArrayView q(query, "query", Access::read_only, kHeads);
  const ArrayView k(key, "key", Access::read_only, kHeads);
  const ArrayView v(value, "value", Access::read_only, kHeads);
  check_heads(q.tensor(), k.tensor(), "key", enable_gqa);
  check_heads(q.tensor(), v.tensor(), "value", enable_gqa);
  ArrayView o(out, "out", Access::writable, kHeads);
  const std::optional<ArrayView> mask =
      optional_view(attn_mask, "attn_mask", Access::read_only, kMask);
  const std::optional<ArrayView> lens =
      optional_view(valid_lens, "valid_lens", Access::read_only, kValidLens);
  AttentionParamViews views({lse, k_scale, v_scale, sinks, alibi_slopes, scale, causal, dropout_p,
                             dropout_seed, window_left, window_right, softcap},
                            {kLse, kRowScales});
  mha_attention_params& params = views.params();
  params.mask = mask ? &mask->tensor() : nullptr;
  params.valid_lens = lens ? &lens->tensor() : nullptr;

  const CallOverrides overrides{std::move(backend), threads};
  nb::gil_scoped_release without_gil;
  CallSettings::instance().run(overrides, [&] {
    return mha_attention(&q.tensor(), &k.tensor(), &v.tensor(), &o.tensor(), &params);
  });
}

}  // namespace

void register_attention(nb::module_& module) {
  module.def("attention", &attention, nb::arg("query"), nb::arg("key"), nb::arg("value"),
             nb::arg("out"), nb::arg("attn_mask").none(), nb::arg("valid_lens").none(),
             nb::arg("lse").none(), nb::arg("k_scale").none(), nb::arg("v_scale").none(),
             nb::arg("scale").none(), nb::arg("causal"), nb::arg("enable_gqa"),
             nb::arg("dropout_p"), nb::arg("dropout_seed"), nb::arg("window_left"),
             nb::arg("window_right"), nb::arg("sinks").none(), nb::arg("softcap"),
             nb::arg("alibi_slopes").none(), nb::arg("backend").none(), nb::arg("threads").none(),
             "out = softmax(query @ key^T * scale + mask) @ value, written into `out` (and the "
             "log-sum-exp into `lse`).  Internal: use mha.scaled_dot_product_attention.");
  module.def("torch_output", &new_torch_output, nb::arg("query"), nb::arg("value"),
             "A new contiguous tensor of query's dtype, shape [..., L, value.shape[-1]], made "
             "by libtorch's C++ API; None when it cannot be made so.  Internal.");
  module.def("torch_tensor_reader", &torch_tensor_reader,
             "How torch tensors are read: 'libtorch' (mha._torch_tensors), 'attributes' or "
             "'torch not imported'.  Internal (diagnostics).");
}

}  // namespace mha_python
