#include "torch_export.h"

#include <Python.h>

namespace nb = nanobind;

namespace mha_python {
namespace {

// torch.Tensor and torch.utils.dlpack.to_dlpack, looked up once torch has
// been imported (by the caller: a tensor cannot exist before), then kept for
// the life of the process.  Called with the GIL held.
struct Torch {
  PyObject* tensor_type = nullptr;
  PyObject* to_dlpack = nullptr;
};

const Torch* torch_functions() {
  static Torch torch;
  if (torch.to_dlpack != nullptr) return &torch;
  PyObject* module = PyImport_GetModule(nb::str("torch").ptr());
  if (module == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  nb::object torch_module = nb::steal(module);
  try {
    nb::object tensor = torch_module.attr("Tensor");
    nb::object to_dlpack = torch_module.attr("utils").attr("dlpack").attr("to_dlpack");
    torch.tensor_type = tensor.release().ptr();
    torch.to_dlpack = to_dlpack.release().ptr();
  } catch (const nb::python_error&) {
    return nullptr;  // a torch without them: tensors take nanobind's way
  }
  return &torch;
}

}  // namespace

nb::object torch_capsule(nb::handle object) {
  const Torch* torch = torch_functions();
  if (torch == nullptr ||
      !PyObject_TypeCheck(object.ptr(), reinterpret_cast<PyTypeObject*>(torch->tensor_type))) {
    PyErr_Clear();
    return {};
  }
  PyObject* capsule = PyObject_CallOneArg(torch->to_dlpack, object.ptr());
  if (capsule == nullptr) {
    PyErr_Clear();
    return {};
  }
  return nb::steal(capsule);
}

}  // namespace mha_python
