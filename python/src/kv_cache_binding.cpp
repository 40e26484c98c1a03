// _mha.kv_cache_write: mha_kv_cache_write over the caller's arrays, without
// the GIL: new K and V rows written in place into their slots of a paged
// cache (vLLM's reshape_and_cache).  The library checks shapes, dtypes and
// the slots before it writes anything, and its message names the argument
// (key, value, key_cache, value_cache, slot_mapping, key_scale_cache,
// value_scale_cache).
#include <nanobind/nanobind.h>

#include <optional>

#include "array_view.h"
#include "bindings.h"
#include "errors.h"

namespace nb = nanobind;

namespace mha_python {
namespace {

constexpr RankRule kRows{3, 3, 3};        // [T, Hkv, D]
constexpr RankRule kCache{4, 4, 4};       // [num_blocks, block_size, Hkv, D]
constexpr RankRule kSlots{1, 1, 1};       // [T]
constexpr RankRule kScaleCache{3, 3, 3};  // [num_blocks, block_size, Hkv]

void kv_cache_write(nb::handle key, nb::handle value, nb::handle key_cache, nb::handle value_cache,
                    nb::handle slot_mapping, nb::handle key_scale_cache,
                    nb::handle value_scale_cache) {
  const ArrayView keys(key, "key", Access::read_only, kRows);
  const ArrayView values(value, "value", Access::read_only, kRows);
  ArrayView k_cache(key_cache, "key_cache", Access::writable, kCache);
  ArrayView v_cache(value_cache, "value_cache", Access::writable, kCache);
  const ArrayView slots(slot_mapping, "slot_mapping", Access::read_only, kSlots);
  std::optional<ArrayView> k_scales =
      optional_view(key_scale_cache, "key_scale_cache", Access::writable, kScaleCache);
  std::optional<ArrayView> v_scales =
      optional_view(value_scale_cache, "value_scale_cache", Access::writable, kScaleCache);
  nb::gil_scoped_release without_gil;
  const mha_status status = mha_kv_cache_write(
      &keys.tensor(), &values.tensor(), &k_cache.tensor(), &v_cache.tensor(), &slots.tensor(),
      k_scales ? &k_scales->tensor() : nullptr, v_scales ? &v_scales->tensor() : nullptr);
  if (status != MHA_OK) throw library_error(status);
}

}  // namespace

void register_kv_cache(nb::module_& module) {
  module.def("kv_cache_write", &kv_cache_write, nb::arg("key"), nb::arg("value"),
             nb::arg("key_cache"), nb::arg("value_cache"), nb::arg("slot_mapping"),
             nb::arg("key_scale_cache").none(), nb::arg("value_scale_cache").none(),
             "Writes the rows of `key` and `value` in place into their slots of the paged "
             "caches (and, int8, each row's scale into the scale caches).  Internal: use "
             "mha.kv_cache_write.");
}

}  // namespace mha_python
