// The C interface between the extension _mha and the optional module
// mha._torch_tensors, which reads torch tensors through libtorch's C++ API
// (an inline read of the at::Tensor behind the Python object) instead of
// through six Python attributes a tensor.
//
// Why a second module: only it links libtorch, so `import mha` needs no torch,
// and a package built where libtorch's headers were missing (or run with
// another torch than the one it was built for) still reads tensors, through
// their attributes.  _mha imports the module when torch is imported and takes
// this table from its capsule; plain C types only, so the two sides share no
// C++ ABI.
#pragma once

#include <Python.h>
#include <mha/mha.h>

#include <cstdint>

#define MHA_TORCH_TENSOR_API_MODULE "mha._torch_tensors"
#define MHA_TORCH_TENSOR_API_CAPSULE "mha._torch_tensors.api"

namespace mha_python {

// The version of the table below: _mha uses a table of its own version only.
inline constexpr int32_t kTorchTensorApiVersion = 1;

// What mha needs of a tensor.
struct TorchTensorFields {
  void* data;
  int32_t dtype;  // an mha_dtype, never MHA_DTYPE_INVALID
  int32_t rank;   // at most MHA_MAX_DIMS
  int32_t requires_grad;
  int64_t shape[MHA_MAX_DIMS];
  int64_t strides[MHA_MAX_DIMS];  // in elements
};

struct TorchTensorApi {
  int32_t version;
  // 1 with *fields filled when `object` is a torch.Tensor or nn.Parameter (not
  // a subclass: it may redefine what its attributes say) on the CPU, strided,
  // with storage, not a lazily negated view, of at most MHA_MAX_DIMS
  // dimensions and a dtype mha has a name for; 0 for anything else, with no
  // Python error set, so the caller reads it the general way (which words
  // the errors).  GIL held.
  int (*read)(PyObject* object, TorchTensorFields* fields);
  // torch.is_grad_enabled() of the calling thread.
  int (*grad_enabled)();
  // A new contiguous tensor of like's dtype and device and like's shape but
  // for its last dimension, `last_dim` (at::empty, as torch.empty_like);
  // null, with no Python error set, when `like` is not a tensor `read` reads
  // or libtorch refuses (the caller allocates the general way).  GIL held.
  PyObject* (*empty)(PyObject* like, int64_t last_dim);
};

}  // namespace mha_python
