// _mha.attention_varlen_backward: one mha_attention_varlen_backward call over
// the caller's arrays (a packed batch with packed keys: a paged cache has no
// backward pass), without the GIL.  Arguments arrive checked for their Python
// types and with the gradients allocated (mha/_varlen_autograd.py); shapes,
// dtypes and the offsets' values are the library's to check, and its message
// names the argument.  Every sequence's work is in the one call, balanced over
// the threads; the library writes the zeros of the rows no query reads.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "array_view.h"
#include "attention_params.h"
#include "bindings.h"
#include "call_settings.h"

namespace nb = nanobind;

namespace mha_python {
namespace {

using namespace packed_batch;

void attention_varlen_backward(nb::handle grad_out, nb::handle q_object, nb::handle k_object,
                               nb::handle v_object, nb::handle out_object, nb::handle lse,
                               nb::handle grad_q, nb::handle grad_k, nb::handle grad_v,
                               nb::handle cu_seqlens_q, nb::handle cu_seqlens_k,
                               nb::handle seqused_k, nb::handle sinks, nb::handle grad_sinks,
                               std::optional<double> scale, int32_t causal, double dropout_p,
                               uint64_t dropout_seed, int64_t window_left, int64_t window_right,
                               double softcap, nb::handle alibi_slopes,
                               std::optional<std::string> backend, std::optional<int32_t> threads) {
  const ArrayView dout(grad_out, "grad_out", Access::read_only, kPacked);
  const ArrayView q(q_object, "q", Access::read_only, kPacked);
  const ArrayView k(k_object, "k", Access::read_only, kPacked);
  const ArrayView v(v_object, "v", Access::read_only, kPacked);
  const ArrayView o(out_object, "out", Access::read_only, kPacked);
  const ArrayView forward_lse(lse, "lse", Access::read_only, kLse);
  ArrayView dq(grad_q, "grad_q", Access::writable, kPacked);
  ArrayView dk(grad_k, "grad_k", Access::writable, kPacked);
  ArrayView dv(grad_v, "grad_v", Access::writable, kPacked);
  const ArrayView cu_q(cu_seqlens_q, "cu_seqlens_q", Access::read_only, kOffsets);
  const ArrayView cu_k(cu_seqlens_k, "cu_seqlens_k", Access::read_only, kOffsets);
  const std::optional<ArrayView> used =
      optional_view(seqused_k, "seqused_k", Access::read_only, kLengths);
  // The forward's parameters; its LSE is an input here, not params.lse.
  const nb::object none = nb::none();
  const AttentionParamViews views({none, none, none, sinks, alibi_slopes, scale, causal, dropout_p,
                                   dropout_seed, window_left, window_right, softcap},
                                  {kLse, kRowScales});
  std::optional<ArrayView> dsinks =
      optional_view(grad_sinks, "grad_sinks", Access::writable, kSinks);
  mha_varlen_params varlen;
  mha_varlen_params_init(&varlen);
  varlen.cu_seqlens_q = &cu_q.tensor();
  varlen.cu_seqlens_k = &cu_k.tensor();
  varlen.seqused_k = used ? &used->tensor() : nullptr;
  const mha_attention_params& params = views.params();
  mha_backward_params extra;
  mha_backward_params_init(&extra);
  extra.dsinks = dsinks ? &dsinks->tensor() : nullptr;

  const CallOverrides overrides{std::move(backend), threads};
  nb::gil_scoped_release without_gil;
  CallSettings::instance().run(overrides, [&] {
    return mha_attention_varlen_backward(&q.tensor(), &k.tensor(), &v.tensor(), &o.tensor(),
                                         &forward_lse.tensor(), &dout.tensor(), &dq.tensor(),
                                         &dk.tensor(), &dv.tensor(), &varlen, &params, &extra);
  });
}

}  // namespace

void register_varlen_backward(nb::module_& module) {
  module.def("attention_varlen_backward", &attention_varlen_backward, nb::arg("grad_out"),
             nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"),
             nb::arg("grad_q"), nb::arg("grad_k"), nb::arg("grad_v"), nb::arg("cu_seqlens_q"),
             nb::arg("cu_seqlens_k"), nb::arg("seqused_k").none(), nb::arg("sinks").none(),
             nb::arg("grad_sinks").none(), nb::arg("scale").none(), nb::arg("causal"),
             nb::arg("dropout_p"), nb::arg("dropout_seed"), nb::arg("window_left"),
             nb::arg("window_right"), nb::arg("softcap"), nb::arg("alibi_slopes").none(),
             nb::arg("backend").none(), nb::arg("threads").none(),
             "The gradients of _mha.varlen_attention's call over packed keys with the same "
             "arguments, from its `out`, its `lse` ([H, total_q]) and `grad_out`, written into "
             "grad_q, grad_k and grad_v (and grad_sinks when given, the sum over the "
             "sequences): each sequence's those of the sequence alone, zeros where no query "
             "reads.  Internal: use mha.varlen_attention under torch's autograd.");
}

}  // namespace mha_python
