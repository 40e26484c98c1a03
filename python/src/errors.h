// How the library's failures reach Python: as mha.Error, a RuntimeError
// carrying the C API's status and message ("MHA_ERR_...: what was wrong").
#pragma once

#include <mha/mha.h>
#include <nanobind/nanobind.h>
#include <mha/mha.hpp>

#include <stdexcept>
#include <string>

namespace mha_python {

// The error of a failed call as mha.hpp words it; read it right after the
// call, before any other mha call on the thread replaces mha_last_error().
mha::Error library_error(mha_status status);
mha::Error library_error(mha_status status, const std::string& message);

// Thrown for a tensor that requires grad while autograd is on, read by a
// function without a gradient; Python sees _mha.GradRequired, a ValueError.
struct GradRequired : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Adds mha.Error (and _mha.GradRequired) to the module and turns mha::Error into it.
void register_errors(nanobind::module_& module);

}  // namespace mha_python
