// _mha.merge_partials: mha_merge_partials over lists of the caller's arrays,
// without the GIL.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "array_view.h"
#include "bindings.h"
#include "errors.h"

namespace nb = nanobind;

namespace mha_python {
namespace {

constexpr RankRule kOut{2, 4, 4};  // [B, H, Lq, Dv]
constexpr RankRule kLse{1, 3, 3};  // [B, H, Lq]

std::vector<ArrayView> views(nb::handle sequence, const char* name, RankRule rule) {
  if (!nb::isinstance<nb::sequence>(sequence) || nb::isinstance<nb::str>(sequence)) {
    throw nb::type_error((std::string(name) + " must be a list or tuple of arrays").c_str());
  }
  std::vector<ArrayView> result;
  const size_t n = nb::len(sequence);
  result.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string item = std::string(name) + "[" + std::to_string(i) + "]";
    result.emplace_back(sequence[i], item.c_str(), Access::read_only, rule);
  }
  return result;
}

void merge_partials(nb::handle outs, nb::handle lses, nb::handle out, nb::handle lse) {
  const std::vector<ArrayView> out_views = views(outs, "outs", kOut);
  const std::vector<ArrayView> lse_views = views(lses, "lses", kLse);
  if (out_views.size() != lse_views.size()) {
    throw nb::value_error(("outs has " + std::to_string(out_views.size()) +
                           " arrays but lses has " + std::to_string(lse_views.size()) +
                           "; they must pair up")
                              .c_str());
  }
  if (out_views.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw nb::value_error("outs holds more partial results than mha can merge at once");
  }
  std::vector<mha_tensor> out_tensors, lse_tensors;
  for (const ArrayView& view : out_views) out_tensors.push_back(view.tensor());
  for (const ArrayView& view : lse_views) lse_tensors.push_back(view.tensor());
  ArrayView merged(out, "out", Access::writable, kOut);
  ArrayView merged_lse(lse, "lse", Access::writable, kLse);

  nb::gil_scoped_release without_gil;
  const mha_status status =
      mha_merge_partials(static_cast<int32_t>(out_tensors.size()), out_tensors.data(),
                         lse_tensors.data(), &merged.tensor(), &merged_lse.tensor());
  if (status != MHA_OK) throw library_error(status);
}

}  // namespace

void register_merge(nb::module_& module) {
  module.def("merge_partials", &merge_partials, nb::arg("outs"), nb::arg("lses"), nb::arg("out"),
             nb::arg("lse"),
             "Merges partial attention results over disjoint key ranges into `out` and `lse`.  "
             "Internal: use mha.merge_partials.");
}

}  // namespace mha_python
