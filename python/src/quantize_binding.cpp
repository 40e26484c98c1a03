// _mha.quantize_kv: mha_quantize_kv over the caller's arrays, without the GIL.
// The outputs arrive allocated (mha/_quantize.py); the library checks shapes,
// dtypes and values and its message names the argument (src, dst, scale).
#include <nanobind/nanobind.h>

#include "array_view.h"
#include "bindings.h"
#include "errors.h"

namespace nb = nanobind;

namespace mha_python {
namespace {

constexpr RankRule kRows{2, 4, 4};    // [B, Hkv, L, D]; fewer dimensions are leading ones
constexpr RankRule kScales{1, 3, 3};  // [B, Hkv, L]

void quantize_kv(nb::handle src, nb::handle dst, nb::handle scale) {
  const ArrayView source(src, "src", Access::read_only, kRows);
  ArrayView rows(dst, "dst", Access::writable, kRows);
  ArrayView scales(scale, "scale", Access::writable, kScales);
  nb::gil_scoped_release without_gil;
  const mha_status status = mha_quantize_kv(&source.tensor(), &rows.tensor(), &scales.tensor());
  if (status != MHA_OK) throw library_error(status);
}

}  // namespace

void register_quantize(nb::module_& module) {
  module.def("quantize_kv", &quantize_kv, nb::arg("src"), nb::arg("dst"), nb::arg("scale"),
             "Quantises the rows of `src` to int8 in `dst`, one float32 scale per row in "
             "`scale`.  Internal: use mha.quantize_kv.");
}

}  // namespace mha_python
