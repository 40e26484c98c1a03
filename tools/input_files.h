// mha-run's .npy inputs as mha reads them: read with messages that name
// their flag, float files converted to the dtype mha gets (float32, bf16 or
// f16), and descriptors over them in the file's own layout.  Shared by the
// attention, module and backward modes.
#pragma once

#include <mha/mha.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cli_options.h"
#include "npy.h"

namespace mha_tools {

// "--q q.npy", as messages name an input.
std::string input_label(const char* flag, const std::string& path);

// Throws ToolError "<what> failed (<status name>): <mha_last_error()>".
[[noreturn]] void library_error(const std::string& what, mha_status status);

// Reads an input file; messages name the flag ("--q q.npy: truncated data: ...").
NpyArray read_input(const char* flag, const std::string& path);

// float32, float16 or float64.
bool is_float(NpyDtype dtype);

// Reads a float32, float16 or float64 .npy input as float32 (for the module,
// which computes in fp32): float16 is converted exactly, float64 is rounded
// and refused when a finite value does not fit; each conversion is said on
// stderr under MHA_VERBOSE=1.  Other dtypes are left to the caller.
NpyArray read_float_input(const char* flag, const std::string& path);

// Sinks or ALiBi slopes (--sinks, --alibi in every mode): float32, float16
// and float64 converted as read_float_input converts, of rank 1 to max_rank
// (`shapes` names them in the refusal); the library checks the shape against
// the heads and the batch.
NpyArray load_float_vector(const char* flag, const std::string& path, int max_rank,
                           const char* shapes);

// An input as mha reads it: the file's shape and element strides (C or
// Fortran order) over values of `dtype`.  `file` holds them when the file
// already had that dtype (F32, F16, BOOL); `converted` otherwise (BF16, I8,
// or values converted from another float type).
struct TypedInput {
  mha_dtype dtype = MHA_DTYPE_F32;
  std::vector<int64_t> shape, strides;
  std::optional<NpyArray> file;
  std::vector<uint64_t> converted;  // 8-byte aligned

  int rank() const { return static_cast<int>(shape.size()); }
  int64_t size() const;
  void* data() { return file ? file->data() : static_cast<void*>(converted.data()); }
  const void* data() const {
    return file ? file->data() : static_cast<const void*>(converted.data());
  }
};

// The values of a float array (F32, F64 or F16) as `dtype` (F32, BF16 or
// F16), rounded to nearest with ties to even -- once, also from float64.  A
// finite value that does not fit is refused (ToolError naming `what`); the
// conversion is said on stderr under MHA_VERBOSE=1.  `hint` ends the refusal.
TypedInput convert_float_input(NpyArray array, mha_dtype dtype, const std::string& what,
                               const char* hint = "");

// A float .npy input (float32, float16 or float64, any shape) as `dtype`
// (F32, BF16 or F16), converted as convert_float_input converts Q: rounded
// once to nearest even, said under MHA_VERBOSE=1.  Another file dtype is
// refused (ToolError naming the flag, the file and `role`).
TypedInput read_typed_input(const char* flag, const std::string& path, mha_dtype dtype,
                            const char* role);

// A descriptor over an array in its own layout (C or Fortran order), of
// `dtype`; with add_batch a leading dimension of 1 ([H,L,D] as [1,H,L,D]).
// Throws ToolError naming `what`.
mha_tensor describe_array(NpyArray& array, mha_dtype dtype, const std::string& what,
                          bool add_batch = false);

// A descriptor over an input in its dtype, shape and strides (add_batch as
// describe_array's).  Throws ToolError naming `what`.
mha_tensor describe_input(TypedInput& input, const std::string& what, bool add_batch = false);

}  // namespace mha_tools
