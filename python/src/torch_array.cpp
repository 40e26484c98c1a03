#include "torch_array.h"

#include <Python.h>
#include <nanobind/stl/string.h>

#include <string>

namespace nb = nanobind;

namespace mha_python {
namespace {

// What of torch the import needs, looked up once torch has been imported (by
// the caller: a tensor cannot exist before), then kept for the life of the
// process.  Called with the GIL held.
struct Torch {
  PyTypeObject* tensor_type = nullptr;
  PyObject* is_grad_enabled = nullptr;
  struct Dtype {
    const char* name;
    mha_dtype dtype;
    PyObject* object;
  } dtypes[7] = {{"float32", MHA_DTYPE_F32, nullptr},   {"float16", MHA_DTYPE_F16, nullptr},
                 {"bfloat16", MHA_DTYPE_BF16, nullptr}, {"bool", MHA_DTYPE_BOOL, nullptr},
                 {"int8", MHA_DTYPE_I8, nullptr},       {"int32", MHA_DTYPE_I32, nullptr},
                 {"int64", MHA_DTYPE_I64, nullptr}};
};

// module.name, kept: a strong reference never released.
PyObject* keep(const nb::object& module, const char* name) {
  return nb::object(module.attr(name)).release().ptr();
}

const Torch* torch_functions() {
  static Torch torch;
  if (torch.tensor_type != nullptr) return &torch;
  PyObject* module = PyImport_GetModule(nb::str("torch").ptr());
  if (module == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  nb::object torch_module = nb::steal(module);
  try {
    for (Torch::Dtype& d : torch.dtypes) d.object = keep(torch_module, d.name);
    torch.is_grad_enabled = keep(torch_module, "is_grad_enabled");
    torch.tensor_type = reinterpret_cast<PyTypeObject*>(keep(torch_module, "Tensor"));
  } catch (const nb::python_error&) {
    return nullptr;  // a torch without them: tensors take nanobind's way
  }
  return &torch;
}

// A tuple of ints (torch.Size, stride()) into `values`; its length.
int32_t read_ints(nb::handle tuple, int64_t* values) {
  const auto n = static_cast<int32_t>(PyTuple_GET_SIZE(tuple.ptr()));
  for (int32_t d = 0; d < n && d < MHA_MAX_DIMS; ++d) {
    values[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple.ptr(), d));
  }
  return n;
}

}  // namespace

bool read_torch(nb::handle object, const char* name, TorchArray* array) {
  const Torch* torch = torch_functions();
  if (torch == nullptr || !PyObject_TypeCheck(object.ptr(), torch->tensor_type)) return false;
  try {
    if (!nb::cast<bool>(object.attr("is_cpu"))) return false;
    if (nb::cast<bool>(object.attr("requires_grad")) &&
        nb::cast<bool>(nb::handle(torch->is_grad_enabled)())) {
      throw nb::value_error((std::string(name) +
                             " requires grad, but this mha function has no gradient (only "
                             "mha.scaled_dot_product_attention, mha.multi_head_attention_forward "
                             "and mha.torch.MultiheadAttention have): call it under "
                             "torch.no_grad() (or torch.inference_mode()), or pass tensors that "
                             "do not require grad")
                                .c_str());
    }
    const nb::object dtype = object.attr("dtype");
    array->dtype = MHA_DTYPE_INVALID;
    for (const Torch::Dtype& d : torch->dtypes) {
      if (dtype.ptr() == d.object) array->dtype = d.dtype;
    }
    if (array->dtype == MHA_DTYPE_INVALID) {
      array->dtype_name = nb::cast<std::string>(nb::str(dtype));
      if (array->dtype_name.rfind("torch.", 0) == 0) array->dtype_name.erase(0, 6);
    }
    const nb::object shape = object.attr("shape");
    const nb::object strides = object.attr("stride")();
    if (!PyTuple_Check(shape.ptr()) || !PyTuple_Check(strides.ptr())) return false;
    array->rank = read_ints(shape, array->shape);
    read_ints(strides, array->strides);
    array->data = PyLong_AsVoidPtr(object.attr("data_ptr")().ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  } catch (const nb::python_error&) {
    PyErr_Clear();  // a tensor subclass without these (a fake tensor): nanobind's way
    return false;
  }
  return true;
}

}  // namespace mha_python
