// The parts of the extension module mha._mha, each adding its functions.
#pragma once

#include <nanobind/nanobind.h>

namespace mha_python {

void register_attention(nanobind::module_& module);
void register_backward(nanobind::module_& module);
void register_kv_cache(nanobind::module_& module);
void register_merge(nanobind::module_& module);
void register_module(nanobind::module_& module);
void register_quantize(nanobind::module_& module);
void register_runtime(nanobind::module_& module);
void register_varlen(nanobind::module_& module);
void register_varlen_backward(nanobind::module_& module);

}  // namespace mha_python
