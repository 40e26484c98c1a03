#include "array_view.h"

#include <string>

#include "torch_array.h"

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

// The memory of an array as DLPack or the buffer protocol describes it:
// strides in units of `stride_unit` (1: elements; the item size: bytes).
struct Layout {
  const void* data;
  int32_t rank;
  const int64_t* shape;
  const int64_t* strides;
  int64_t stride_unit;
};

// The descriptor of an array of the library's `dtype`, with the leading
// dimensions the rule adds.
mha_tensor describe(const Layout& layout, mha_dtype dtype, RankRule rule) {
  const int32_t rank = layout.rank;
  mha_tensor tensor{};
  // Inputs are only read: the library takes them through const descriptors.
  tensor.data = const_cast<void*>(layout.data);
  tensor.dtype = dtype;
  const int32_t added = rank < rule.library_rank ? rule.library_rank - rank : 0;
  tensor.ndim = rank + added;
  for (int32_t d = 0; d < added; ++d) {
    tensor.shape[d] = 1;
    tensor.strides[d] = 0;  // a dimension of one element: the stride is never used
  }
  for (int32_t d = 0; d < rank; ++d) {
    tensor.shape[added + d] = layout.shape[d];
    tensor.strides[added + d] = layout.strides[d] / layout.stride_unit;
  }
  return tensor;
}

void check_rank(int32_t rank, const char* name, RankRule rule) {
  if (rank < rule.min_rank || rank > rule.max_rank) {
    throw nb::value_error(
        (std::string(name) + " must have " + std::to_string(rule.min_rank) +
         (rule.min_rank == rule.max_rank ? "" : " to " + std::to_string(rule.max_rank)) +
         " dimensions, has " + std::to_string(rank))
            .c_str());
  }
}

[[noreturn]] void refuse_dtype(const char* name, const std::string& dtype) {
  throw nb::type_error((std::string(name) + " has dtype " + dtype +
                        ", which mha does not take (it takes float32, bfloat16, float16, "
                        "bool, int8, int32 and int64, each where the argument allows it)")
                           .c_str());
}

// The descriptor of a DLPack export (either kind of nb::ndarray).
template <class Array>
mha_tensor describe(const Array& array, const char* name, RankRule rule) {
  const auto rank = static_cast<int32_t>(array.ndim());
  check_rank(rank, name, rule);
  const mha_dtype dtype = library_dtype(array.dtype());
  if (dtype == MHA_DTYPE_INVALID) refuse_dtype(name, dtype_text(array.dtype()));
  return describe(Layout{array.data(), rank, array.shape_ptr(), array.stride_ptr(), 1}, dtype,
                  rule);
}

}  // namespace

bool ArrayView::read_buffer(nb::handle object, const char* name, Access access, RankRule rule) {
  if (!buffer_.acquire(object.ptr(), access == Access::writable)) return false;
  const Py_buffer& view = buffer_.view();
  static_assert(sizeof(Py_ssize_t) == sizeof(int64_t), "buffer shapes read as int64_t");
  check_rank(view.ndim, name, rule);
  tensor_ = describe(Layout{view.buf, view.ndim, reinterpret_cast<const int64_t*>(view.shape),
                            reinterpret_cast<const int64_t*>(view.strides), view.itemsize},
                     buffer_.dtype(), rule);
  return true;
}

ArrayView::ArrayView(nb::handle object, const char* name, Access access, RankRule rule) {
  if (read_buffer(object, name, access, rule)) return;  // NumPy
  if (TorchArray torch; read_torch(object, name, &torch)) {
    check_rank(torch.rank, name, rule);
    if (torch.dtype == MHA_DTYPE_INVALID) refuse_dtype(name, torch.dtype_name);
    tensor_ =
        describe(Layout{torch.data, torch.rank, torch.shape, torch.strides, 1}, torch.dtype, rule);
    return;
  }
  // Any other DLPack array.  No conversion: an object that is not already a
  // CPU array is refused rather than copied into one.
  const bool imported = access == Access::read_only
                            ? nb::try_cast(object, read_only_, /*convert=*/false)
                            : nb::try_cast(object, writable_, /*convert=*/false);
  if (!imported && *buffer_.refusal() != '\0') {
    throw nb::type_error(
        (std::string(name) + " cannot be read in place: " + buffer_.refusal()).c_str());
  }
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
