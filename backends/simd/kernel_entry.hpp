// The kernel entry points every SIMD plugin exports to its own table.
//
// They are defined once per plugin, in the translation unit compiled with the
// plugin's ISA flags (backends/<isa>/<isa>_kernels.cpp), by instantiating the
// shared templates of this folder for that ISA.  The table that points at them
// (plugin_table.hpp) is built in a file compiled without ISA flags, so that the
// runtime can read it on any CPU.
#pragma once

#include <mha/plugin_abi.h>

#include <cstddef>
#include <cstdint>

size_t mha_simd_scratch_bytes(const mha_kernel_problem* problem, int64_t max_queries);
int mha_simd_attend(const mha_kernel_problem* problem, const mha_work_item* item, void* scratch);
size_t mha_simd_backward_scratch_bytes(const mha_backward_problem* problem);
int mha_simd_backward(const mha_backward_problem* problem, const mha_backward_item* item,
                      void* scratch);
