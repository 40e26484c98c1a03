// _mha.attention_backward: one mha_attention_backward call over the caller's
// arrays, without the GIL.  Arguments arrive checked for their Python types
// and with the gradients allocated (mha/_backward.py); shapes, dtypes and
// values are the library's to check, and its message names the argument.
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

namespace nb = nanobind;

namespace mha_python {
namespace {

using namespace padded_batch;

void attention_backward(nb::handle grad_out, nb::handle query, nb::handle key, nb::handle value,
                        nb::handle out, nb::handle lse, nb::handle grad_query, nb::handle grad_key,
                        nb::handle grad_value, nb::handle attn_mask, nb::handle valid_lens,
                        nb::handle grad_attn_mask, nb::handle sinks, nb::handle grad_sinks,
                        std::optional<double> scale, int32_t causal, bool enable_gqa,
                        double dropout_p, uint64_t dropout_seed, int64_t window_left,
                        int64_t window_right, double softcap, nb::handle alibi_slopes,
                        std::optional<std::string> backend, std::optional<int32_t> threads) {
  const ArrayView dout(grad_out, "grad_out", Access::read_only, kHeads);
  const ArrayView q(query, "query", Access::read_only, kHeads);
  const ArrayView k(key, "key", Access::read_only, kHeads);
  const ArrayView v(value, "value", Access::read_only, kHeads);
  check_heads(q.tensor(), k.tensor(), "key", enable_gqa);
  check_heads(q.tensor(), v.tensor(), "value", enable_gqa);
  const ArrayView o(out, "out", Access::read_only, kHeads);
  const ArrayView forward_lse(lse, "lse", Access::read_only, kLse);
  ArrayView dq(grad_query, "grad_query", Access::writable, kHeads);
  ArrayView dk(grad_key, "grad_key", Access::writable, kHeads);
  ArrayView dv(grad_value, "grad_value", Access::writable, kHeads);
  const std::optional<ArrayView> mask =
      optional_view(attn_mask, "attn_mask", Access::read_only, kMask);
  const std::optional<ArrayView> lens =
      optional_view(valid_lens, "valid_lens", Access::read_only, kValidLens);
  std::optional<ArrayView> dmask =
      optional_view(grad_attn_mask, "grad_attn_mask", Access::writable, kMask);
  // The forward's parameters; its LSE is an input here, not params.lse.
  const nb::object none = nb::none();
  AttentionParamViews views({none, none, none, sinks, alibi_slopes, scale, causal, dropout_p,
                             dropout_seed, window_left, window_right, softcap},
                            {kLse, kRowScales});
  std::optional<ArrayView> dsinks =
      optional_view(grad_sinks, "grad_sinks", Access::writable, kSinks);
  mha_attention_params& params = views.params();
  params.mask = mask ? &mask->tensor() : nullptr;
  params.valid_lens = lens ? &lens->tensor() : nullptr;
  mha_backward_params extra;
  mha_backward_params_init(&extra);
  extra.dmask = dmask ? &dmask->tensor() : nullptr;
  extra.dsinks = dsinks ? &dsinks->tensor() : nullptr;

  const CallOverrides overrides{std::move(backend), threads};
  nb::gil_scoped_release without_gil;
  CallSettings::instance().run(overrides, [&] {
    return mha_attention_backward(&q.tensor(), &k.tensor(), &v.tensor(), &o.tensor(),
                                  &forward_lse.tensor(), &dout.tensor(), &dq.tensor(), &dk.tensor(),
                                  &dv.tensor(), &params, &extra);
  });
}

}  // namespace

void register_backward(nb::module_& module) {
  module.def("attention_backward", &attention_backward, nb::arg("grad_out"), nb::arg("query"),
             nb::arg("key"), nb::arg("value"), nb::arg("out"), nb::arg("lse"),
             nb::arg("grad_query"), nb::arg("grad_key"), nb::arg("grad_value"),
             nb::arg("attn_mask").none(), nb::arg("valid_lens").none(),
             nb::arg("grad_attn_mask").none(), nb::arg("sinks").none(),
             nb::arg("grad_sinks").none(), nb::arg("scale").none(), nb::arg("causal"),
             nb::arg("enable_gqa"), nb::arg("dropout_p"), nb::arg("dropout_seed"),
             nb::arg("window_left"), nb::arg("window_right"), nb::arg("softcap"),
             nb::arg("alibi_slopes").none(), nb::arg("backend").none(), nb::arg("threads").none(),
             "The gradients of _mha.attention's call with the same arguments, from its `out`, "
             "its `lse` and `grad_out`, written into grad_query, grad_key and grad_value (and "
             "grad_attn_mask, grad_sinks when given).  Internal: use "
             "mha.scaled_dot_product_attention_backward.");
}

}  // namespace mha_python
