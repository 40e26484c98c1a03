// The portable backend's backward pass (plugin_abi.h, ABI 8).
#pragma once

#include <mha/plugin_abi.h>

#include <cstddef>

namespace mha_scalar {

size_t backward_scratch_bytes(const mha_backward_problem* problem);
int backward(const mha_backward_problem* problem, const mha_backward_item* item, void* scratch);

}  // namespace mha_scalar
