// mha._torch_tensors: torch tensors read through libtorch's C++ API, for
// _mha (torch_tensor_api.h says why this is a module of its own).
//
// A tensor's six attributes (is_cpu, requires_grad, dtype, shape, stride(),
// data_ptr()) cost about 0.5 us through Python with PyTorch 1.13, and S5
// passes five tensors a call; the same fields read from the at::Tensor cost a
// few nanoseconds.  Built only where libtorch's headers are found
// (python/CMakeLists.txt); it refuses to load into a process whose torch is
// not the one it was built and linked against.
#include <ATen/ops/empty.h>
#include <Python.h>
#include <torch/csrc/api/include/torch/version.h>
#include <torch/csrc/autograd/python_variable.h>

#include <string>

#include "torch_tensor_api.h"

namespace mha_python {
namespace {

mha_dtype library_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return MHA_DTYPE_F32;
    case c10::ScalarType::Half:
      return MHA_DTYPE_F16;
    case c10::ScalarType::BFloat16:
      return MHA_DTYPE_BF16;
    case c10::ScalarType::Bool:
      return MHA_DTYPE_BOOL;
    case c10::ScalarType::Char:
      return MHA_DTYPE_I8;
    case c10::ScalarType::Int:
      return MHA_DTYPE_I32;
    case c10::ScalarType::Long:
      return MHA_DTYPE_I64;
    default:
      return MHA_DTYPE_INVALID;
  }
}

int read_tensor(PyObject* object, TorchTensorFields* fields) {
  if (!THPVariable_CheckExact(object)) return 0;
  try {
    const at::Tensor& tensor = THPVariable_Unpack(object);
    // Sparse, meta, quantized or nested tensors, and lazily negated views
    // (whose memory holds the values' negatives): the general way reads (or
    // refuses) them.  (sizes() throws for symbolic shapes: caught below.)
    if (!tensor.defined() || !tensor.is_cpu() || tensor.layout() != c10::kStrided ||
        !tensor.has_storage() || tensor.is_quantized() || tensor.is_neg()) {
      return 0;
    }
    const mha_dtype dtype = library_dtype(tensor.scalar_type());
    const int64_t rank = tensor.dim();
    if (dtype == MHA_DTYPE_INVALID || rank > MHA_MAX_DIMS) return 0;
    fields->data = tensor.data_ptr();
    fields->dtype = dtype;
    fields->rank = static_cast<int32_t>(rank);
    fields->requires_grad = tensor.requires_grad() ? 1 : 0;
    const c10::IntArrayRef shape = tensor.sizes();
    const c10::IntArrayRef strides = tensor.strides();
    for (int64_t d = 0; d < rank; ++d) {
      fields->shape[d] = shape[d];
      fields->strides[d] = strides[d];
    }
    return 1;
  } catch (...) {  // whatever libtorch throws: the general way decides
    return 0;
  }
}

int grad_enabled() {
  return c10::GradMode::is_enabled() ? 1 : 0;
}

PyObject* empty(PyObject* like, int64_t last_dim) {
  TorchTensorFields fields{};
  if (read_tensor(like, &fields) == 0 || fields.rank == 0 || last_dim < 0) return nullptr;
  try {
    const at::Tensor& tensor = THPVariable_Unpack(like);
    fields.shape[fields.rank - 1] = last_dim;
    // options(): dtype, device and layout; never requires_grad.
    PyObject* result =
        THPVariable_Wrap(at::empty(c10::IntArrayRef(fields.shape, fields.rank), tensor.options()));
    if (result == nullptr) PyErr_Clear();
    return result;
  } catch (...) {
    return nullptr;
  }
}

TorchTensorApi api = {kTorchTensorApiVersion, read_tensor, grad_enabled, empty};

// Nonzero, with ImportError set, unless the process's torch is the libtorch
// this module was linked against, of the version of its headers: a module
// built for one torch must not read another's tensors.
int check_torch() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) return -1;
  PyObject* tensor_class = PyObject_GetAttrString(torch, "Tensor");
  PyObject* version = PyObject_GetAttrString(torch, "__version__");
  Py_DECREF(torch);
  const char* version_text = version != nullptr ? PyUnicode_AsUTF8(version) : nullptr;
  const std::string built =
      std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + ".";
  std::string problem;
  if (tensor_class == nullptr || version_text == nullptr) {
    problem = "torch has no Tensor or __version__";
  } else if (std::string(version_text).rfind(built, 0) != 0) {
    problem = "built for torch " + built + "x, running torch " + version_text;
  } else if (THPVariableClass != tensor_class) {
    problem = "its libtorch_python is not the one the running torch loaded";
  }
  Py_XDECREF(tensor_class);
  Py_XDECREF(version);
  if (problem.empty()) return 0;
  PyErr_Clear();
  PyErr_SetString(PyExc_ImportError, ("mha._torch_tensors: " + problem).c_str());
  return -1;
}

PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT,
    "_torch_tensors",
    "torch tensors read through libtorch's C++ API, for mha._mha (internal).",
    -1,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    nullptr};

}  // namespace
}  // namespace mha_python

// Python's name for the init function of the module _torch_tensors.
// NOLINTNEXTLINE(bugprone-reserved-identifier)
PyMODINIT_FUNC PyInit__torch_tensors() {
  using namespace mha_python;
  if (check_torch() != 0) return nullptr;
  PyObject* module = PyModule_Create(&module_definition);
  if (module == nullptr) return nullptr;
  PyObject* capsule = PyCapsule_New(&api, MHA_TORCH_TENSOR_API_CAPSULE, nullptr);
  if (capsule == nullptr || PyModule_AddObject(module, "api", capsule) != 0) {
    Py_XDECREF(capsule);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
