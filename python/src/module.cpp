// mha._mha: the library's calls over arrays the Python layer (mha/) has
// checked and allocated.  The public API, with PyTorch's argument names and
// semantics, is mha/__init__.py's.
#include <nanobind/nanobind.h>

#include "bindings.h"
#include "errors.h"

NB_MODULE(_mha, module) {
  module.doc() = "The compiled part of mha: library calls over NumPy, PyTorch and DLPack arrays.";
  mha_python::register_errors(module);
  mha_python::register_attention(module);
  mha_python::register_backward(module);
  mha_python::register_kv_cache(module);
  mha_python::register_merge(module);
  mha_python::register_module(module);
  mha_python::register_quantize(module);
  mha_python::register_runtime(module);
  mha_python::register_varlen(module);
  mha_python::register_varlen_backward(module);
}
