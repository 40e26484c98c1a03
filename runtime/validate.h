// Checking a call's arguments and turning them into the kernels' problem.
#pragma once

#include <mha/mha.h>
#include <mha/plugin_abi.h>

#include <cstdint>

namespace mha::rt {

// A validated mha_attention call: the kernels' view plus where the results go.
struct AttentionCall {
  mha_kernel_problem problem;
  float* out;
  int64_t out_strides[4];
  float* lse;  // nullptr when not wanted
  int64_t lse_strides[3];
};

// Checks every argument (pointers, dtypes, ranks, sizes, shapes, strides,
// overlap, parameters, valid-length values) and fills *call.  On failure the
// thread's error message names the argument; nothing is written anywhere else.
mha_status validate_attention(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                              const mha_tensor* out, const mha_attention_params* params,
                              AttentionCall* call);

// Shared checks, also used by the module.
mha_status check_tensor(const mha_tensor* t, const char* name, int32_t min_ndim, int32_t max_ndim);
const char* dtype_name(int32_t dtype);
// An output must not overlap itself (two indices, one address) or any of the
// `count` other tensors (nullptr entries are skipped).
mha_status check_no_overlap(const mha_tensor& output, const char* output_name,
                            const mha_tensor* const* others, const char* const* other_names,
                            int count);
int64_t dtype_size(int32_t dtype);  // 0 for unknown

}  // namespace mha::rt
