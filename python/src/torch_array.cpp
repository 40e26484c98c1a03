#include "torch_array.h"

#include "errors.h"
#include "torch_tensor_api.h"

#include <Python.h>
#include <link.h>
#include <nanobind/stl/string.h>

#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>

namespace nb = nanobind;

namespace mha_python {
namespace {

// What of torch the import needs, looked up once torch has been imported (by
// the caller: a tensor cannot exist before), then kept for the life of the
// process.  Called with the GIL held.
struct Torch {
  PyTypeObject* tensor_type = nullptr;
  // mha._torch_tensors' reader, when the package has it and it loads into
  // this process's torch; null: every tensor is read through its attributes.
  const TorchTensorApi* fast = nullptr;
  PyObject* is_grad_enabled = nullptr;
  // The attribute names, interned once: a lookup by a C string would build a
  // new str for each (S5 reads six attributes of five tensors a call).
  PyObject* is_cpu = nullptr;
  PyObject* requires_grad = nullptr;
  PyObject* dtype = nullptr;
  PyObject* shape = nullptr;
  PyObject* stride = nullptr;
  PyObject* data_ptr = nullptr;
  PyObject* is_neg = nullptr;
  struct Dtype {
    const char* name;
    mha_dtype dtype;
    PyObject* object;
  } dtypes[7] = {{"float32", MHA_DTYPE_F32, nullptr},   {"float16", MHA_DTYPE_F16, nullptr},
                 {"bfloat16", MHA_DTYPE_BF16, nullptr}, {"bool", MHA_DTYPE_BOOL, nullptr},
                 {"int8", MHA_DTYPE_I8, nullptr},       {"int32", MHA_DTYPE_I32, nullptr},
                 {"int64", MHA_DTYPE_I64, nullptr}};
};

// Whether the libtorch_python mha._torch_tensors was linked against (its real
// path, MHA_TORCH_PYTHON_LIBRARY) is already loaded: by the running torch,
// then.  Checked before the module is imported, so that a package built for
// one torch never loads another torch's libraries (and their static
// initialisers) into a process whose torch is a different one.
bool linked_torch_loaded() {
#ifdef MHA_TORCH_PYTHON_LIBRARY
  char wanted[PATH_MAX];
  if (realpath(MHA_TORCH_PYTHON_LIBRARY, wanted) == nullptr) return false;
  // Only objects named libtorch_python* are resolved (torch loads hundreds).
  return dl_iterate_phdr(
             [](dl_phdr_info* info, size_t, void* target) {
               const char* name = info->dlpi_name;
               const char* base = name != nullptr ? std::strrchr(name, '/') : nullptr;
               char loaded[PATH_MAX];
               return base != nullptr && std::strncmp(base, "/libtorch_python", 16) == 0 &&
                              realpath(name, loaded) != nullptr &&
                              std::strcmp(loaded, static_cast<const char*>(target)) == 0
                          ? 1
                          : 0;
             },
             wanted) != 0;
#else
  return false;  // the package has no mha._torch_tensors
#endif
}

// The table of mha._torch_tensors, or null (with no Python error) when the
// package was built without it, or it refuses this process's torch.
const TorchTensorApi* fast_reader() {
  if (!linked_torch_loaded()) return nullptr;
  PyObject* module = PyImport_ImportModule(MHA_TORCH_TENSOR_API_MODULE);
  if (module == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  Py_DECREF(module);  // sys.modules keeps it, and with it the table
  const auto* api =
      static_cast<const TorchTensorApi*>(PyCapsule_Import(MHA_TORCH_TENSOR_API_CAPSULE, 0));
  if (api == nullptr) PyErr_Clear();
  return api != nullptr && api->version == kTorchTensorApiVersion ? api : nullptr;
}

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
    torch.is_cpu = PyUnicode_InternFromString("is_cpu");
    torch.requires_grad = PyUnicode_InternFromString("requires_grad");
    torch.dtype = PyUnicode_InternFromString("dtype");
    torch.shape = PyUnicode_InternFromString("shape");
    torch.stride = PyUnicode_InternFromString("stride");
    torch.data_ptr = PyUnicode_InternFromString("data_ptr");
    torch.is_neg = PyUnicode_InternFromString("is_neg");
    torch.fast = fast_reader();
    torch.tensor_type = reinterpret_cast<PyTypeObject*>(keep(torch_module, "Tensor"));
  } catch (const nb::python_error&) {
    return nullptr;  // a torch without them: tensors take nanobind's way
  }
  return &torch;
}

// object.name, or a Python error thrown.
nb::object attribute(nb::handle object, PyObject* name) {
  PyObject* value = PyObject_GetAttr(object.ptr(), name);
  if (value == nullptr) throw nb::python_error();
  return nb::steal(value);
}

// object.name(), without the bound method object a getattr would make.
nb::object call_method(nb::handle object, PyObject* name) {
  PyObject* self = object.ptr();
  PyObject* value =
      PyObject_VectorcallMethod(name, &self, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  if (value == nullptr) throw nb::python_error();
  return nb::steal(value);
}

// function(), or a Python error thrown.
nb::object call(PyObject* function) {
  PyObject* value = PyObject_CallNoArgs(function);
  if (value == nullptr) throw nb::python_error();
  return nb::steal(value);
}

// True for Python's True; a bool attribute's value (anything else is false).
bool is_true(const nb::object& value) {
  return value.ptr() == Py_True;
}

// A tuple of ints (torch.Size, stride()) into `values`; its length.
int32_t read_ints(nb::handle tuple, int64_t* values) {
  const auto n = static_cast<int32_t>(PyTuple_GET_SIZE(tuple.ptr()));
  for (int32_t d = 0; d < n && d < MHA_MAX_DIMS; ++d) {
    values[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple.ptr(), d));
  }
  return n;
}

// The refusal of a tensor that requires grad while autograd is on.
[[noreturn]] void refuse_grad(const char* name) {
  throw GradRequired(std::string(name) +
                     " requires grad, but this mha function has no gradient (only "
                     "mha.scaled_dot_product_attention, mha.multi_head_attention_forward "
                     "and mha.torch.MultiheadAttention have): call it under "
                     "torch.no_grad() (or torch.inference_mode()), or pass tensors that "
                     "do not require grad");
}

// The fields mha._torch_tensors read, with PyTorch's rule checked.
void take_fields(const TorchTensorApi& fast, const TorchTensorFields& fields, const char* name,
                 TorchArray* array) {
  if (fields.requires_grad != 0 && fast.grad_enabled() != 0) refuse_grad(name);
  array->data = fields.data;
  array->dtype = static_cast<mha_dtype>(fields.dtype);
  array->rank = fields.rank;
  for (int32_t d = 0; d < fields.rank; ++d) {
    array->shape[d] = fields.shape[d];
    array->strides[d] = fields.strides[d];
  }
}

}  // namespace

bool read_torch(nb::handle object, const char* name, TorchArray* array) {
  const Torch* torch = torch_functions();
  if (torch == nullptr || !PyObject_TypeCheck(object.ptr(), torch->tensor_type)) return false;
  if (TorchTensorFields fields{};
      torch->fast != nullptr && torch->fast->read(object.ptr(), &fields) != 0) {
    take_fields(*torch->fast, fields, name, array);
    return true;
  }
  try {
    if (!is_true(attribute(object, torch->is_cpu))) return false;
    if (is_true(call_method(object, torch->is_neg))) {
      // Its memory holds the negatives of its values; mha reads arrays in place.
      throw nb::type_error((std::string(name) +
                            " is a lazily negated view (torch._neg_view): call .resolve_neg() "
                            "on it first")
                               .c_str());
    }
    if (is_true(attribute(object, torch->requires_grad)) && is_true(call(torch->is_grad_enabled))) {
      refuse_grad(name);
    }
    const nb::object dtype = attribute(object, torch->dtype);
    array->dtype = MHA_DTYPE_INVALID;
    for (const Torch::Dtype& d : torch->dtypes) {
      if (dtype.ptr() == d.object) array->dtype = d.dtype;
    }
    if (array->dtype == MHA_DTYPE_INVALID) {
      array->dtype_name = nb::cast<std::string>(nb::str(dtype));
      if (array->dtype_name.rfind("torch.", 0) == 0) array->dtype_name.erase(0, 6);
    }
    const nb::object shape = attribute(object, torch->shape);
    const nb::object strides = call_method(object, torch->stride);
    if (!PyTuple_Check(shape.ptr()) || !PyTuple_Check(strides.ptr())) return false;
    array->rank = read_ints(shape, array->shape);
    read_ints(strides, array->strides);
    array->data = PyLong_AsVoidPtr(call_method(object, torch->data_ptr).ptr());
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

nb::object new_torch_output(nb::handle query, nb::handle value) {
  const Torch* torch = torch_functions();
  TorchTensorFields fields{};
  if (torch == nullptr || torch->fast == nullptr || torch->fast->read(value.ptr(), &fields) == 0 ||
      fields.rank == 0) {
    return nb::none();
  }
  PyObject* out = torch->fast->empty(query.ptr(), fields.shape[fields.rank - 1]);
  return out != nullptr ? nb::steal(out) : nb::none();
}

const char* torch_tensor_reader() {
  const Torch* torch = torch_functions();
  if (torch == nullptr) return "torch not imported";
  return torch->fast != nullptr ? "libtorch" : "attributes";
}

}  // namespace mha_python
