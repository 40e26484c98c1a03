// Checking a call's arguments and turning them into the kernels' problem.
#pragma once

#include <mha/mha.h>
#include <mha/plugin_abi.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/dtype.h"

namespace mha::rt {

// A call the kernels can run: their view of it plus where the results go.
struct KernelCall {
  mha_kernel_problem problem;
  void* out;
  int32_t out_dtype;  // F32, BF16 or F16
  int64_t out_strides[4];
  float* lse;  // nullptr when not wanted
  int64_t lse_strides[3];
  int64_t window_left = -1, window_right = -1;  // as the caller gave them (verbose lines)
};

// Checks every argument of mha_attention (pointers, dtypes, ranks, sizes,
// shapes, strides, overlap, parameters, valid-length values) and fills *call.
// On failure the thread's error message names the argument; nothing is
// written anywhere else.
mha_status validate_attention(const mha_tensor* q, const mha_tensor* k, const mha_tensor* v,
                              const mha_tensor* out, const mha_attention_params* params,
                              KernelCall* call);

// *given = the caller's params (NULL: the defaults) completed to this
// version's struct; refuses a struct_size this library never had.
mha_status read_attention_params(const mha_attention_params* params, mha_attention_params* given);

// Fills *call from arguments known to be valid (params complete, of this
// version): the second half of validate_attention, for callers inside the
// library that built their tensors themselves (the module).
void describe_attention(const mha_tensor& q, const mha_tensor& k, const mha_tensor& v,
                        const mha_tensor& out, const mha_attention_params& params,
                        KernelCall* call);

// Shared checks, also used by the module.  Each names the argument `name` in
// its message.
mha_status check_tensor(const mha_tensor* t, const char* name, int32_t min_ndim, int32_t max_ndim);
mha_status check_f32(const mha_tensor* t, const char* name);
// valid_lens: I32/I64, [B] or [B, Lq], every value in [0, Lk].
mha_status check_valid_lens(const mha_tensor* vl, const char* name, int64_t batch, int64_t lq,
                            int64_t lk);
// "what: a has va but b has vb" unless va == vb.
mha_status check_shape_equal(const char* what, const char* a, int64_t va, const char* b,
                             int64_t vb);
// Two sizes of two arguments that must agree, and the first of a list that
// does not (check_shape_equal's error).
struct SizeAgreement {
  const char* what;
  const char* a;
  int64_t va;
  const char* b;
  int64_t vb;
};
mha_status check_agreements(std::initializer_list<SizeAgreement> agreements);
// Head sizes (D, Dv) above MHA_MAX_HEAD_DIM refused: "what = value exceeds ...".
struct NamedSize {
  const char* what;
  int64_t value;
};
mha_status check_head_sizes(std::initializer_list<NamedSize> sizes);
// The dtypes mha_attention takes for q, k, v and out.
mha_status check_dtypes(const mha_tensor& q, const mha_tensor& k, const mha_tensor& v,
                        const mha_tensor& out);
// The plain values of mha_attention_params: scale, causal, window, dropout.
mha_status check_call_values(const mha_attention_params& params);
// A block of a larger problem (params' query_offset, key_offset, full_lq,
// full_lk): whether the call is one, its resolved positions (a full length
// of 0 means offset + this call's length), and the check that it fits.
struct Block {
  int64_t query_offset, key_offset, full_lq, full_lk;
};
bool is_block(const mha_attention_params& params);
Block block_of(const mha_attention_params& params, int64_t lq, int64_t lk);
mha_status check_block(const mha_attention_params& params, int64_t lq, int64_t lk);
// The attention variants' parameters, as plain values (mha_attention_params'
// fields, or the module's).  The window: each side -1 (unbounded) or >= 0,
// the message naming params->window_left or _right.
// An int8 cache's row scales (params->k_scale and v_scale): F32 of `shape`
// (`layout` names its axes in messages), both, exactly when K and V are I8.
mha_status check_kv_scales(const mha_attention_params& params, bool int8_kv, const int64_t* shape,
                           int32_t ndim, const char* layout);

mha_status check_window(int64_t window_left, int64_t window_right);
// sinks (may be NULL) F32 [heads], each value finite or -inf; softcap 0 or
// finite and > 0 (named params->softcap); alibi_slopes (may be NULL) F32
// [heads] or [batch, heads], finite.  Tensor names in messages start with
// `prefix`: "" for mha_attention's (sinks, alibi_slopes), "params->" for the
// module's.
mha_status check_variants(const mha_tensor* sinks, float softcap, const mha_tensor* alibi_slopes,
                          int64_t batch, int64_t heads, const char* prefix);
// True when no two index tuples of t address the same element.
bool elements_distinct(const mha_tensor& t);
// An output must not overlap itself (two indices, one address) or any of the
// `count` other tensors (nullptr entries are skipped).
mha_status check_no_overlap(const mha_tensor& output, const char* output_name,
                            const mha_tensor* const* others, const char* const* other_names,
                            int count);
using mha_types::dtype_name;
int64_t dtype_size(int32_t dtype);            // 0 for unknown
std::string shape_text(const mha_tensor& t);  // "[2, 3]"

}  // namespace mha::rt
