#include "errors.h"

#include <Python.h>

namespace nb = nanobind;

namespace mha_python {
namespace {

const char* const kErrorDoc =
    "An mha library call failed.\n\n"
    "str(error) is the library's message, \"MHA_ERR_<STATUS>: what was wrong\", naming the\n"
    "argument at fault; error.status is the status name (\"MHA_ERR_SHAPE_MISMATCH\").";

// The Python class, created once with the module and kept for the process
// (the translator below runs long after the module's init returned).
PyObject* g_error_type = nullptr;
PyObject* g_grad_required_type = nullptr;

const char* const kGradRequiredDoc =
    "A tensor that requires grad reached a function without a gradient while autograd\n"
    "is on (a ValueError).  mha.scaled_dot_product_attention catches it and records the\n"
    "call for autograd instead: its fast path leaves the requires_grad checks to the\n"
    "extension, which reads those attributes anyway.";

void translate(const std::exception_ptr& thrown, void* /*payload*/) {
  try {
    std::rethrow_exception(thrown);
  } catch (const mha::Error& e) {
    nb::object error = nb::borrow(g_error_type)(nb::str(e.what()));
    error.attr("status") = nb::str(mha_status_name(e.status()));
    PyErr_SetObject(g_error_type, error.ptr());
  } catch (const GradRequired& e) {
    PyErr_SetString(g_grad_required_type, e.what());
  }
}

}  // namespace

mha::Error library_error(mha_status status) {
  return library_error(status, mha_last_error());
}

mha::Error library_error(mha_status status, const std::string& message) {
  return mha::Error(status, std::string(mha_status_name(status)) + ": " + message);
}

void register_errors(nb::module_& module) {
  g_error_type = PyErr_NewExceptionWithDoc("mha.Error", kErrorDoc, PyExc_RuntimeError, nullptr);
  if (g_error_type == nullptr) throw nb::python_error();
  module.attr("Error") = nb::borrow(g_error_type);
  nb::register_exception_translator(translate);
  g_grad_required_type = PyErr_NewExceptionWithDoc("mha._mha.GradRequired", kGradRequiredDoc,
                                                   PyExc_ValueError, nullptr);
  if (g_grad_required_type == nullptr) throw nb::python_error();
  module.attr("GradRequired") = nb::borrow(g_grad_required_type);
}

}  // namespace mha_python
