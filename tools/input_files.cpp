// Reading mha-run's .npy inputs: messages that name the flag, float files
// converted to the dtype mha gets, descriptors in the file's own layout.
#include "input_files.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/dtype.h"
#include "half.h"
#include "tool_util.h"

namespace mha_tools {
namespace {

// "(2, 5, 4, 20)"
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i)
    s += (i > 0 ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// "float32" for messages: the names of mha's dtypes as NumPy spells them.
const char* dtype_long_name(mha_dtype dtype) {
  switch (dtype) {
    case MHA_DTYPE_BF16:
      return "bfloat16";
    case MHA_DTYPE_F16:
      return "float16";
    case MHA_DTYPE_I8:
      return "int8";
    case MHA_DTYPE_BOOL:
      return "bool";
    default:
      return "float32";
  }
}

// A descriptor over data of `size` elements in a layout (element strides);
// with add_batch a leading dimension of 1 is added ([H,L,D] as [1,H,L,D]).
// `text` describes the data in messages ("float32 (2, 5, 4, 20)").
mha_tensor describe_layout(void* data, mha_dtype dtype, std::vector<int64_t> shape,
                           std::vector<int64_t> strides, int64_t size, const std::string& text,
                           const std::string& what, bool add_batch) {
  const int given_rank = static_cast<int>(shape.size());
  const int rank = given_rank + (add_batch ? 1 : 0);
  if (rank < 1 || rank > MHA_MAX_DIMS) {
    throw ToolError(what + ": " + text + " has rank " + std::to_string(given_rank) +
                    "; mha takes tensors of rank 1 to " + std::to_string(MHA_MAX_DIMS));
  }
  if (add_batch) {
    shape.insert(shape.begin(), 1);
    strides.insert(strides.begin(), std::max<int64_t>(size, 1));
  }
  mha_tensor t{};
  const mha_status status = mha_tensor_init(&t, data, dtype, rank, shape.data(), strides.data());
  if (status != MHA_OK) throw ToolError(what + ": " + mha_last_error());
  return t;
}

// Bytes per element of the dtypes mha gets here.
std::size_t element_bytes(mha_dtype dtype) {
  switch (dtype) {
    case MHA_DTYPE_BF16:
    case MHA_DTYPE_F16:
      return 2;
    case MHA_DTYPE_I8:
    case MHA_DTYPE_BOOL:
      return 1;
    default:
      return 4;
  }
}

NpyDtype npy_dtype_of(mha_dtype dtype) {
  return dtype == MHA_DTYPE_F16 ? NpyDtype::F16 : NpyDtype::F32;
}

// Element i of a float array, stored as `dtype` (F32, BF16, F16) at `to`;
// false when a finite value became infinite.
bool store_converted(const NpyArray& from, int64_t i, mha_dtype dtype, void* to) {
  const auto n = static_cast<std::size_t>(i);
  if (from.dtype() == NpyDtype::F32) {  // exact in binary32: the library's own rounding
    const float x = from.data_as<float>()[n];
    mha_types::store_float(to, dtype, i, x);
    return !std::isfinite(x) || std::isfinite(mha_types::load_float(to, dtype, i));
  }
  const double x = from.value_as_double(i);
  switch (dtype) {
    case MHA_DTYPE_BF16: {
      const uint16_t bits = bf16_bits_from_double(x);
      static_cast<uint16_t*>(to)[n] = bits;
      return !std::isfinite(x) || std::isfinite(bf16_bits_to_double(bits));
    }
    case MHA_DTYPE_F16: {
      const uint16_t bits = f16_bits_from_double(x);
      static_cast<uint16_t*>(to)[n] = bits;
      return !std::isfinite(x) || std::isfinite(f16_bits_to_double(bits));
    }
    default: {
      const auto f = static_cast<float>(x);
      static_cast<float*>(to)[n] = f;
      return !std::isfinite(x) || std::isfinite(f);
    }
  }
}

}  // namespace

std::string input_label(const char* flag, const std::string& path) {
  return std::string(flag) + " " + path;
}

[[noreturn]] void library_error(const std::string& what, mha_status status) {
  throw ToolError(what + " failed (" + mha_status_name(status) + "): " + mha_last_error());
}

NpyArray read_input(const char* flag, const std::string& path) {
  try {
    return read_npy(path);
  } catch (const NpyError& e) {
    throw ToolError(std::string(flag) + " " + e.what());
  }
}

bool is_float(NpyDtype dtype) {
  return dtype == NpyDtype::F32 || dtype == NpyDtype::F16 || dtype == NpyDtype::F64;
}

int64_t TypedInput::size() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

TypedInput convert_float_input(NpyArray array, mha_dtype dtype, const std::string& what,
                               const char* hint) {
  TypedInput in;
  in.dtype = dtype;
  in.shape = array.shape();
  in.strides = array.strides();
  if (array.dtype() == npy_dtype_of(dtype) && dtype != MHA_DTYPE_BF16) {
    in.file = std::move(array);
    return in;
  }
  const std::size_t bytes = static_cast<std::size_t>(array.size()) * element_bytes(dtype);
  in.converted.assign(bytes / 8 + 1, 0);
  void* to = in.converted.data();
  for (int64_t i = 0; i < array.size(); ++i) {
    if (store_converted(array, i, dtype, to)) continue;
    char text[40];
    std::snprintf(text, sizeof text, "%.17g", array.value_as_double(i));
    const double largest =
        dtype == MHA_DTYPE_F16
            ? kF16Max
            : (dtype == MHA_DTYPE_BF16 ? kBf16Max : static_cast<double>(FLT_MAX));
    char limit[40];
    std::snprintf(limit, sizeof limit, "%.8g", largest);
    throw ToolError(what + ": " + npy_dtype_name(array.dtype()) + " value " + text +
                    " does not fit in " + dtype_long_name(dtype) + " (largest " + limit + ")" +
                    hint);
  }
  if (verbose()) {
    print_error(what + ": " + npy_dtype_name(array.dtype()) + " converted to " +
                dtype_long_name(dtype));
  }
  return in;
}

NpyArray read_float_input(const char* flag, const std::string& path) {
  NpyArray a = read_input(flag, path);
  if (a.dtype() != NpyDtype::F64 && a.dtype() != NpyDtype::F16) return a;
  const bool fortran = a.fortran_order();
  const TypedInput f = convert_float_input(std::move(a), MHA_DTYPE_F32, input_label(flag, path));
  NpyArray out(NpyDtype::F32, f.shape, fortran);  // the converted values keep the file's order
  std::memcpy(out.data(), f.data(), out.nbytes());
  return out;
}

NpyArray load_float_vector(const char* flag, const std::string& path, int max_rank,
                           const char* shapes) {
  NpyArray a = read_float_input(flag, path);
  if (a.dtype() != NpyDtype::F32 || a.rank() < 1 || a.rank() > max_rank) {
    throw ToolError(input_label(flag, path) + ": must be float32 " + shapes +
                    " (<f4; float16 <f2 or float64 <f8, converted); the file holds " +
                    a.describe());
  }
  return a;
}

TypedInput read_typed_input(const char* flag, const std::string& path, mha_dtype dtype,
                            const char* role) {
  NpyArray a = read_input(flag, path);
  if (!is_float(a.dtype())) {
    throw ToolError(input_label(flag, path) + ": " + role +
                    " must be float32 (<f4), float16 (<f2) or float64 (<f8); the file holds " +
                    a.describe());
  }
  return convert_float_input(std::move(a), dtype, input_label(flag, path));
}

mha_tensor describe_array(NpyArray& array, mha_dtype dtype, const std::string& what,
                          bool add_batch) {
  return describe_layout(array.data(), dtype, array.shape(), array.strides(), array.size(),
                         array.describe(), what, add_batch);
}

mha_tensor describe_input(TypedInput& input, const std::string& what, bool add_batch) {
  return describe_layout(input.data(), input.dtype, input.shape, input.strides, input.size(),
                         std::string(dtype_long_name(input.dtype)) + " " + shape_text(input.shape),
                         what, add_batch);
}

}  // namespace mha_tools
