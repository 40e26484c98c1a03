#include "array_view.h"

#include <string>

namespace nb = nanobind;

namespace mha_python {
namespace {

// "float64", "uint8", "bool": the dtype as NumPy and PyTorch name it.
std::string dtype_text(nb::dlpack::dtype dtype) {
  using code = nb::dlpack::dtype_code;
  const auto kind = static_cast<code>(dtype.code);
  if (kind == code::Bool) return "bool";
  std::string name = "(DLPack type code " + std::to_string(dtype.code) + ") ";
  if (kind == code::Int) name = "int";
  if (kind == code::UInt) name = "uint";
  if (kind == code::Float) name = "float";
  if (kind == code::Bfloat) name = "bfloat";
  if (kind == code::Complex) name = "complex";
  return name + std::to_string(dtype.bits);
}

// The library's dtype for a DLPack dtype, MHA_DTYPE_INVALID when it has none.
// Which dtypes each argument accepts is the library's to say (with a message
// naming the argument); this only translates.
mha_dtype library_dtype(nb::dlpack::dtype dtype) {
  if (dtype.lanes != 1) return MHA_DTYPE_INVALID;
  switch (static_cast<nb::dlpack::dtype_code>(dtype.code)) {
    case nb::dlpack::dtype_code::Float:
      if (dtype.bits == 32) return MHA_DTYPE_F32;
      if (dtype.bits == 16) return MHA_DTYPE_F16;
      break;
    case nb::dlpack::dtype_code::Bfloat:
      if (dtype.bits == 16) return MHA_DTYPE_BF16;
      break;
    case nb::dlpack::dtype_code::Bool:
      if (dtype.bits == 8) return MHA_DTYPE_BOOL;
      break;
    case nb::dlpack::dtype_code::Int:
      if (dtype.bits == 32) return MHA_DTYPE_I32;
      if (dtype.bits == 64) return MHA_DTYPE_I64;
      if (dtype.bits == 8) return MHA_DTYPE_I8;
      break;
    default:
      break;
  }
  return MHA_DTYPE_INVALID;
}

std::string python_type_name(nb::handle object) {
  return nb::type_name(object.type()).c_str();
}

// The descriptor of `array` (either kind of nb::ndarray), with the leading
// dimensions the rule adds.
template <class Array>
mha_tensor describe(const Array& array, const char* name, RankRule rule) {
  const auto rank = static_cast<int32_t>(array.ndim());
  if (rank < rule.min_rank || rank > rule.max_rank) {
    throw nb::value_error(
        (std::string(name) + " must have " + std::to_string(rule.min_rank) +
         (rule.min_rank == rule.max_rank ? "" : " to " + std::to_string(rule.max_rank)) +
         " dimensions, has " + std::to_string(rank))
            .c_str());
  }
  const mha_dtype dtype = library_dtype(array.dtype());
  if (dtype == MHA_DTYPE_INVALID) {
    throw nb::type_error((std::string(name) + " has dtype " + dtype_text(array.dtype()) +
                          ", which mha does not take (it takes float32, bfloat16, float16, "
                          "bool, int8, int32 and int64, each where the argument allows it)")
                             .c_str());
  }
  mha_tensor tensor{};
  // Inputs are only read: the library takes them through const descriptors.
  tensor.data = const_cast<void*>(static_cast<const void*>(array.data()));
  tensor.dtype = dtype;
  const int32_t added = rank < rule.library_rank ? rule.library_rank - rank : 0;
  tensor.ndim = rank + added;
  for (int32_t d = 0; d < added; ++d) {
    tensor.shape[d] = 1;
    tensor.strides[d] = 0;  // a dimension of one element: the stride is never used
  }
  for (int32_t d = 0; d < rank; ++d) {
    tensor.shape[added + d] = array.shape_ptr()[d];
    tensor.strides[added + d] = array.stride_ptr()[d];
  }
  return tensor;
}

}  // namespace

ArrayView::ArrayView(nb::handle object, const char* name, Access access, RankRule rule) {
  // No conversion: an object that is not already a CPU array is refused
  // rather than copied into one.
  const bool imported = access == Access::read_only
                            ? nb::try_cast(object, read_only_, /*convert=*/false)
                            : nb::try_cast(object, writable_, /*convert=*/false);
  if (!imported) {
    const char* what = access == Access::read_only ? "an array" : "a writable array";
    throw nb::type_error((std::string(name) + " must be " + what +
                          " on the CPU (a NumPy array, a PyTorch tensor or any DLPack array), "
                          "not " +
                          python_type_name(object))
                             .c_str());
  }
  tensor_ = access == Access::read_only ? describe(read_only_, name, rule)
                                        : describe(writable_, name, rule);
}

std::optional<ArrayView> optional_view(nb::handle object, const char* name, Access access,
                                       RankRule rule) {
  if (object.is_none()) return std::nullopt;
  return ArrayView(object, name, access, rule);
}

}  // namespace mha_python
